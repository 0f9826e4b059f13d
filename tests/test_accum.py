"""The limited-precision fp8 tensor-core accumulator (DeepSeek-V3's measurement on Hopper)."""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mplower.numerics.accum import matmul_limited_accum


def reference(a: np.ndarray, b: np.ndarray, bits: int, interval: int,
              group: int = 32) -> np.ndarray:
    """The model written out in numpy: per step of `group` products, the running sum and the
    products (exact in float64) truncated toward zero at `bits` bits below the largest one's
    leading bit, summed, the sum truncated to `bits` significant bits; promoted to f32 per
    interval."""
    total = np.zeros((a.shape[0], b.shape[1]), np.float32)
    scale = 2.0 ** bits
    for k0 in range(0, a.shape[1], interval):
        k1 = min(a.shape[1], k0 + interval)
        acc = np.zeros(total.shape)
        for g0 in range(k0, k1, group):
            prods = a[:, None, g0:min(k1, g0 + group)].astype(np.float64) * \
                b[g0:min(k1, g0 + group)].T[None].astype(np.float64)
            terms = np.concatenate([acc[..., None], prods], axis=-1)
            _, e = np.frexp(np.abs(terms).max(axis=-1))
            unit = np.ldexp(1.0, e - bits)[..., None]
            m, e = np.frexp((np.trunc(terms / unit) * unit).sum(axis=-1))
            acc = np.ldexp(np.trunc(m * scale) / scale, e)
        total = (total + acc.astype(np.float32)).astype(np.float32)
    return total


def fp8(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def test_limited_accumulator_equals_the_numpy_model_bit_for_bit():
    rng = np.random.default_rng(0)
    a, b = fp8(rng.standard_normal((3, 300))), fp8(rng.standard_normal((300, 4)))
    for bits, interval, group in [(14, 128, 32), (14, 300, 32), (8, 7, 3), (24, 1, 32),
                                  (14, 300, 1)]:
        assert np.array_equal(matmul_limited_accum(a, b, bits, interval, group),
                              reference(a, b, bits, interval, group))


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
    assert every_128 < 5e-4  # 0.014%: promoted to f32 every 128, two orders of magnitude less


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


def h200_operands(case: str) -> tuple[np.ndarray, np.ndarray]:
    """The operands benchmarks/gpu_check.py drew (seed 0, after its bf16 pair), first 24 rows
    of a and columns of b: fp8 E4M3 values whose largest magnitude is 448 (scales of 1)."""
    rng = np.random.default_rng(0)
    rng.standard_normal((256, 4096))
    rng.standard_normal((4096, 512))
    operands = {}
    for name in ("pos", "signed"):
        if name == "pos":
            a = fp8(rng.uniform(128, 384, (256, 4096)))
            b = fp8(rng.uniform(0.5, 1.5, (4096, 256)))
        else:
            a = fp8(np.clip(rng.standard_normal((256, 4096)) * 64, -448, 448))
            b = fp8(np.clip(rng.standard_normal((4096, 256)) * 64, -448, 448))
        a[0, 0], b[0, 0] = 448, 448
        operands[name] = a[:24], b[:, :24]
    return operands[case]


@pytest.mark.parametrize("case, mode, interval, at_least", [
    ("pos", "fast", 4096, 0.98), ("signed", "fast", 4096, 0.89), ("pos", "default", 128, 0.96)])
def test_the_model_reproduces_h200_fp8_scaled_mm_outputs(case, mode, interval, at_least):
    # tests/data/h200_fp8_scaled_mm.npz: torch 2.11 + CUDA 13.0 on an H200,
    # torch._scaled_mm(a, b, scale 1, out f32, use_fast_accum=fast|default), K = 4096
    # (benchmarks/gpu_check.py measure). Fast accumulation never promotes; cuBLAS's default
    # promotes every 128 (the fit in docs/benchmarks.md).
    a, b = h200_operands(case)
    with np.load(Path(__file__).parent / "data" / "h200_fp8_scaled_mm.npz") as z:
        measured = z[f"{case}_{mode}"]
    model = matmul_limited_accum(a, b, 14, interval)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.mean(model == measured) >= at_least

    def rel(y):
        return np.linalg.norm(y - exact) / np.linalg.norm(exact)
    assert rel(model) == pytest.approx(rel(measured), rel=0.05)
