"""The limited-precision fp8 tensor-core accumulator (DeepSeek-V3's measurement on Hopper)."""

import ml_dtypes
import numpy as np

from mplower.numerics.accum import matmul_limited_accum


def reference(a: np.ndarray, b: np.ndarray, bits: int, interval: int) -> np.ndarray:
    """The model written out in numpy: products exact in float64, the running sum truncated
    toward zero to `bits` significant bits after every addition, promoted to f32 per interval."""
    total = np.zeros((a.shape[0], b.shape[1]), np.float32)
    scale = 2.0 ** bits
    for k0 in range(0, a.shape[1], interval):
        acc = np.zeros(total.shape)
        for k in range(k0, min(a.shape[1], k0 + interval)):
            acc = acc + np.outer(a[:, k].astype(np.float64), b[k].astype(np.float64))
            m, e = np.frexp(acc)
            acc = np.ldexp(np.trunc(m * scale) / scale, e)
        total = (total + acc.astype(np.float32)).astype(np.float32)
    return total


def fp8(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def test_limited_accumulator_equals_the_numpy_model_bit_for_bit():
    rng = np.random.default_rng(0)
    a, b = fp8(rng.standard_normal((3, 300))), fp8(rng.standard_normal((300, 4)))
    for bits, interval in [(14, 128), (14, 300), (8, 7), (24, 1)]:
        assert np.array_equal(matmul_limited_accum(a, b, bits, interval),
                              reference(a, b, bits, interval))


def test_promotion_every_128_removes_most_of_the_drift_of_a_14_bit_accumulator_at_k_4096():
    # Positive products, as in DeepSeek-V3's illustration: the running sum outgrows each
    # addend, and a 14-bit accumulator drops their low bits (its report: ~2% error at K=4096).
    rng = np.random.default_rng(1)
    a = fp8(rng.uniform(0.5, 1.5, (4, 4096)))
    b = fp8(rng.uniform(0.5, 1.5, (4096, 8)))
    exact = a.astype(np.float64) @ b.astype(np.float64)

    def err(y):
        return float(np.max(np.abs(y - exact) / exact))
    f32 = err(matmul_limited_accum(a, b, 24, 4096))
    never = err(matmul_limited_accum(a, b, 14, 4096))
    every_128 = err(matmul_limited_accum(a, b, 14, 128))
    assert f32 == 0.0  # exact here: every partial sum fits f32's 24 bits
    assert never > 0.05  # 7.1%: the unpromoted 14-bit accumulator
    assert every_128 < 5e-4  # 0.019%: promoted to f32 every 128, two orders of magnitude less


def test_scale_recipes_accum_option_makes_the_matmul_accumulate_in_14_bits(cli, tmp_path):
    from mplower.backend.executor import Program
    from mplower.ir.parser import parse_file

    src = tmp_path / "m.ir"
    src.write_text("""func.func @main(%x: tensor<2x512xf32>, %w: tensor<512x3xf32>) -> tensor<2x3xf32> {
  %a = mp.cast %x : (tensor<2x512xf32>) -> tensor<2x512xf8E4M3FN>
  %b = mp.cast %w : (tensor<512x3xf32>) -> tensor<512x3xf8E4M3FN>
  %y = mp.matmul %a, %b : (tensor<2x512xf8E4M3FN>, tensor<512x3xf8E4M3FN>) -> tensor<2x3xf32>
  return %y : tensor<2x3xf32>
}""")
    out = tmp_path / "o.ir"
    assert cli("opt", src, "--pass=scale-recipes{accum_bits=14 promote_every=256}", "-o",
               out).rc == 0
    assert "mp.accum_bits = 14" in out.read_text()
    rng = np.random.default_rng(2)
    x = rng.uniform(0.5, 1.5, (2, 512)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, (512, 3)).astype(np.float32)
    y = Program(parse_file(out)).run([x, w], reference=False).outputs[0]

    def scaled(v):  # current scaling: 448 / amax, decoded with 1 / scale
        sf = np.float32(448) / np.abs(v).max()
        return fp8(v * sf) * (np.float32(1) / sf)
    assert np.array_equal(y, reference(scaled(x), scaled(w), 14, 256))
