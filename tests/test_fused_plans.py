"""The lowered plans' own fusions (issue 12): a bf16/fp16/fp8 conv's bias add, relu and rounding,
and mp.scaled_quant's scale-and-round, against independent references (ml_dtypes, numpy) and
against the same ops run one at a time."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mplower.passes.fuse import Fuse

from mplower.backend.executor import Program
from mplower.ir.graph import Module
from mplower.ir.parser import parse
from mplower.numerics.rounding import SERIAL_BELOW, amax, scale_round
from mplower.pass_manager import PassContext

ML = {"f8E4M3FN": ml_dtypes.float8_e4m3fn, "f8E5M2": ml_dtypes.float8_e5m2,
      "bf16": ml_dtypes.bfloat16, "f16": np.float16}


def _fused(text: str) -> Module:
    """The module parsed and put through the `fuse` pass (not verified: some of these modules
    mix element types as only the executor accepts): the fused ops run_lowered runs."""
    module = parse(text, "m.ir")
    Fuse().run(module, PassContext())
    return module


def _awkward(n: int, seed: int) -> np.ndarray:
    """Normal values with zeros of both signs, subnormals, huge values, infinities and NaN."""
    x = (np.random.default_rng(seed).standard_normal(n) * 30).astype(np.float32)
    x[::97] = 0.0
    x[1::89] = -0.0
    x[2::101] = np.float32(3e-41)
    x[3::211] = np.float32(1e30)
    if n > 20:
        x[5], x[7], x[9] = np.inf, -np.inf, np.nan
    return x


@pytest.mark.parametrize("n", [0, 1, 333, SERIAL_BELOW + 4097])
def test_amax_is_numpys_max_of_abs_with_nan_and_without_a_temporary(n) -> None:
    x = _awkward(n, 1)
    finite = x.copy()
    finite[~np.isfinite(finite)] = 1.0
    for v in (x, finite, -np.abs(finite), np.zeros(n, np.float32) - 0.0):
        expect = float(np.max(np.abs(v))) if n else 0.0
        got = amax(v)
        assert np.float32(got).tobytes() == np.float32(expect).tobytes()


@pytest.mark.parametrize("fmt", ["f8E4M3FN", "f8E5M2", "bf16", "f16"])
@pytest.mark.parametrize("n", [50, SERIAL_BELOW + 4097])
def test_scale_round_is_the_saturating_ml_dtypes_cast_of_x_times_scale_decoded(fmt, n) -> None:
    x = _awkward(n, 2)
    sf = 7.25
    top = np.float32(ml_dtypes.finfo(ML[fmt]).max)
    scaled = x * np.float32(sf)
    cast = np.clip(scaled, -top, top).astype(ML[fmt]).astype(np.float32)
    expect = cast * (np.float32(1) / np.float32(sf))
    values, counts = scale_round(x, fmt, sf)
    assert values.tobytes() == expect.astype(np.float32).tobytes()
    assert (counts.overflow, counts.underflow, counts.nan) == _cast_counts(scaled, fmt)


def _cast_counts(scaled: np.ndarray, fmt: str) -> tuple[int, int, int]:
    """(overflow, underflow, nan) of ml_dtypes' saturating cast of `scaled` to fmt."""
    top = np.float32(ml_dtypes.finfo(ML[fmt]).max)
    cast = np.clip(scaled, -top, top).astype(ML[fmt]).astype(np.float32)
    with np.errstate(over="ignore"):
        plain = scaled.astype(ML[fmt]).astype(np.float32)  # the unsaturated cast
    beyond = ~np.isnan(scaled) & (~np.isfinite(plain) | (np.abs(plain) > top))
    beyond &= ~(np.isinf(scaled) & np.isinf(plain) & (np.abs(scaled) == top))
    return (int(np.count_nonzero(beyond)), int(np.count_nonzero((scaled != 0) & (cast == 0))),
            int(np.count_nonzero(np.isnan(cast))))


def _finite_awkward(n: int, seed: int, fmt: str, sf: float) -> np.ndarray:
    """Finite values that scale to every part of the format's range: zeros of both signs, f32
    subnormals, the format's subnormals and ties between them, normals, ties at the largest
    finite and beyond it, and values far beyond (which saturate)."""
    rng = np.random.default_rng(seed)
    top = float(ml_dtypes.finfo(ML[fmt]).max)
    tiny = float(ml_dtypes.finfo(ML[fmt]).smallest_subnormal)
    parts = [rng.standard_normal(n) * top / 8, rng.uniform(-8, 8, n) * tiny,
             np.round(rng.uniform(-64, 64, n)) * tiny / 2, rng.uniform(-1.2, 1.2, n) * top,
             rng.standard_normal(n) * 1e30, rng.standard_normal(n) * 1e-40]
    f32 = float(np.finfo(np.float32).max) * (1 - 2.0 ** -10)  # finite once scaled back
    scaled = np.clip(np.stack(parts, axis=1).reshape(-1)[:n], -f32, f32).astype(np.float32)
    x = (scaled / np.float32(sf)).astype(np.float32)
    x[::97] = 0.0
    x[1::89] = -0.0
    return x


@pytest.mark.parametrize("fmt", ["f8E4M3FN", "f8E5M2", "bf16", "f16"])
@pytest.mark.parametrize("n", [500, SERIAL_BELOW + 4097])
@pytest.mark.parametrize("overwrite", [False, True])
def test_scale_round_of_finite_data_with_its_amax_is_the_saturating_ml_dtypes_cast(
        fmt, n, overwrite) -> None:
    """Given max|x| (all finite once scaled), scale_round takes its NaN-free kernel and may
    write over x: the values and counts are still those of ml_dtypes' cast after numpy's
    product, on one thread and in blocks on the workers."""
    sf = 3.0
    x = _finite_awkward(n, 5, fmt, sf)
    assert np.all(np.isfinite(x * np.float32(sf)))
    top = np.float32(ml_dtypes.finfo(ML[fmt]).max)
    scaled = x * np.float32(sf)
    cast = np.clip(scaled, -top, top).astype(ML[fmt]).astype(np.float32)
    expect = cast * (np.float32(1) / np.float32(sf))
    overflow, underflow, nan = _cast_counts(scaled, fmt)
    assert overflow > 0 and underflow > 0 and nan == 0
    operand = x.copy()
    values, counts = scale_round(operand, fmt, sf, float(np.max(np.abs(x))), overwrite)
    assert values.tobytes() == expect.tobytes()
    assert (counts.overflow, counts.underflow, counts.nan) == (overflow, underflow, 0)
    # Written over the operand only where asked and where the finite kernel ran (bf16's
    # largest spacing has no finite C: it keeps the general kernel and a new array).
    assert (values is operand) == (overwrite and fmt != "bf16")
    if values is not operand:
        assert operand.tobytes() == x.tobytes()
    # Without counts (run_lowered's): the same values, no counts where the finite kernel ran.
    operand = x.copy()
    values, counts = scale_round(operand, fmt, sf, float(np.max(np.abs(x))), overwrite,
                                 counted=False)
    assert values.tobytes() == expect.tobytes()
    assert (counts is None) == (fmt != "bf16")
    assert (values is operand) == (overwrite and fmt != "bf16")
    if values is not operand:
        assert operand.tobytes() == x.tobytes()


@pytest.mark.parametrize("amax", [float("nan"), float("inf"), 3e38])
def test_scale_round_with_an_amax_that_is_not_finite_once_scaled_takes_the_general_kernel(
        amax) -> None:
    """NaN or inf in the data (as its amax says), or a product that overflows: the general
    kernel, a new array, and the counts of ml_dtypes' cast."""
    x = _awkward(SERIAL_BELOW + 11, 3)
    if not np.isnan(amax):  # its largest value, the data's only non-finite ones
        x[~np.isfinite(x)] = amax
    assert np.max(np.abs(x)) == np.float32(amax) or np.isnan(amax)
    sf = 4.0
    with np.errstate(over="ignore"):
        scaled = x * np.float32(sf)
    top = np.float32(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    cast = np.clip(scaled, -top, top).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    operand = x.copy()
    values, counts = scale_round(operand, "f8E4M3FN", sf, amax, overwrite=True)
    assert values is not operand and operand.tobytes() == x.tobytes()
    assert values.tobytes() == (cast * np.float32(0.25)).tobytes()
    assert (counts.overflow, counts.underflow, counts.nan) == _cast_counts(scaled, "f8E4M3FN")
    assert counts.overflow > 0 and (counts.nan > 0) == np.isnan(amax)


def test_scale_round_takes_the_finite_kernel_exactly_where_numpys_float32_product_is_finite(
        ) -> None:
    """Whether amax * sf overflows is decided in float64 (the product of two float32 values
    is exact there) against the float32 overflow threshold: at every pair around it, the
    finite kernel (the operand overwritten) runs exactly where numpy's float32 product is
    finite."""
    top = float(np.finfo(np.float32).max)
    ulp = 2.0 ** 104
    x = np.array([1.0, -0.5], np.float32)
    pairs = [(top, 1.0), (top, 1.0 + 2.0 ** -23), (top / 2, 2.0),
             (top - ulp, 1.0 + 2.0 ** -23), (2.0 ** 127 * 1.5, 4 / 3), (3e38, 1.1342746),
             (float(np.nextafter(np.float32(top / 3), np.float32(0))), 3.0),
             # above the largest float32 before rounding, finite after it
             (2.2518305930020944e+38, 1.511136531829834)]
    assert 2.2518305930020944e+38 * 1.511136531829834 > top
    for largest, sf in pairs:
        largest, sf = float(np.float32(largest)), float(np.float32(sf))
        with np.errstate(over="ignore"):
            finite = bool(np.isfinite(np.float32(largest) * np.float32(sf)))
        operand = x.copy()
        values, _ = scale_round(operand, "f8E4M3FN", sf, largest, overwrite=True)
        assert (values is operand) == finite, (largest, sf)
    with np.errstate(over="ignore"):
        assert len({bool(np.isfinite(np.float32(a) * np.float32(b))) for a, b in pairs}) == 2


_FP8_CONV = """func.func @main(%x: tensor<2x8x7x7xf32>) -> tensor<2x4x7x7xf32> {
  %w = mp.constant {value = dense<0.25> : tensor<4x8x3x3xf32>} : () -> tensor<4x8x3x3xf32>
  %b = mp.constant {value = dense<[-0.5, 0.25, -2.0, 1.0]> : tensor<4xf32>} : () -> tensor<4xf32>
  %b3 = mp.reshape %b : (tensor<4xf32>) -> tensor<4x1x1xf32>
  %xq = mp.scaled_quant %x {recipe = "current"} : (tensor<2x8x7x7xf32>) -> tensor<2x8x7x7xf8E4M3FN>
  %wq = mp.scaled_quant %w {recipe = "current"} : (tensor<4x8x3x3xf32>) -> tensor<4x8x3x3xf8E4M3FN>
  %c = mp.conv2d %xq, %wq {padding = [1, 1, 1, 1], mp.precision = f8E4M3FN, mp.accum = f32} : (tensor<2x8x7x7xf8E4M3FN>, tensor<4x8x3x3xf8E4M3FN>) -> tensor<2x4x7x7xf32>
  %a = mp.add %c, %b3 : (tensor<2x4x7x7xf32>, tensor<4x1x1xf32>) -> tensor<2x4x7x7xf32>
  %r = mp.relu %a : (tensor<2x4x7x7xf32>) -> tensor<2x4x7x7xf32>
  return %r : tensor<2x4x7x7xf32>
}
"""

_ROUNDED_CONV = """func.func @main(%x: tensor<2x8x7x7xf32>) -> tensor<2x4x7x7xELEM> {
  %w = mp.constant {value = dense<0.25> : tensor<4x8x3x3xf32>} : () -> tensor<4x8x3x3xf32>
  %b = mp.constant {value = dense<[-0.5, 0.25, -2.0, 1.0]> : tensor<4xf32>} : () -> tensor<4xf32>
  %xc = mp.cast %x : (tensor<2x8x7x7xf32>) -> tensor<2x8x7x7xELEM>
  %wc = mp.cast %w : (tensor<4x8x3x3xf32>) -> tensor<4x8x3x3xELEM>
  %bc = mp.cast %b : (tensor<4xf32>) -> tensor<4xELEM>
  %c = mp.conv2d %xc, %wc, %bc {padding = [1, 1, 1, 1], mp.precision = ELEM, mp.accum = f32} : (tensor<2x8x7x7xELEM>, tensor<4x8x3x3xELEM>, tensor<4xELEM>) -> tensor<2x4x7x7xELEM>
  %r = mp.relu %c {mp.precision = ELEM} : (tensor<2x4x7x7xELEM>) -> tensor<2x4x7x7xELEM>
  return %r : tensor<2x4x7x7xELEM>
}
"""


def _inputs(seed: int, scale: float) -> np.ndarray:
    x = (np.random.default_rng(seed).standard_normal((2, 8, 7, 7)) * scale).astype(np.float32)
    x[0, 0, 0, :3] = [np.inf, -np.inf, np.nan]  # a NaN and infinities reach some outputs
    return x


def test_fp8_conv_runs_its_bias_add_and_relu_as_it_stores_with_the_same_bits() -> None:
    program, unfused = Program(_fused(_FP8_CONV)), Program(parse(_FP8_CONV, "m.ir"))
    x = _inputs(3, 2.0)
    x[0, 0, 0, :3] = [3.0, -2.0, 1.0]  # current scaling: a non-finite amax keeps the scale 1
    expect = unfused.run([x], reference=False).outputs[0]
    got = program.run_lowered(program.prepare_inputs([x]))[0]
    assert got.tobytes() == expect.tobytes()
    assert [s.op for s in program._live] == ["mp.scaled_quant", "mp.fused_conv2d"]
    # Unfused, run_lowered runs the ops as they are, with the same bits.
    assert unfused.run_lowered(unfused.prepare_inputs([x]))[0].tobytes() == expect.tobytes()
    assert [s.op for s in unfused._live] == ["mp.scaled_quant", "mp.conv2d", "mp.add", "mp.relu"]
    assert (got == 0).any() and (got > 0).any()


@pytest.mark.parametrize("elem,scale", [("bf16", 1.0), ("f16", 1.0), ("f16", 20000.0),
                                        ("f16", 1e-6)])
def test_rounded_conv_takes_its_relu_before_rounding_with_the_same_bits(elem, scale) -> None:
    """Large inputs overflow f16 to +-inf, tiny ones underflow: the relu before the rounding
    gives what the relu after it gives, for every value."""
    text = _ROUNDED_CONV.replace("ELEM", elem)
    program, unfused = Program(_fused(text)), Program(parse(text, "m.ir"))
    x = _inputs(4, scale)
    expect = unfused.run([x], reference=False).outputs[0]
    got = program.run_lowered(program.prepare_inputs([x]))[0]
    assert got.tobytes() == expect.tobytes()
    assert [s.op for s in program._live] == ["mp.cast", "mp.fused_conv2d"]
    assert unfused.run_lowered(unfused.prepare_inputs([x]))[0].tobytes() == expect.tobytes()
    assert np.isnan(got).any() and (got == 0).any() and (got > 0).any()
    if scale > 1:
        assert np.isinf(got).any()


_ROUNDED_ALONE = """func.func @main(%x: tensor<2x8x7x7xf32>) -> tensor<2x4x7x7xELEM> {
  %w = mp.constant {value = dense<WEIGHTS> : tensor<4x4x1x1xf32>} : () -> tensor<4x4x1x1xf32>
  %b = mp.constant {value = dense<[-0.5, 0.25, -2.0, 1.0]> : tensor<4xf32>} : () -> tensor<4xf32>
  %xc = mp.cast %x : (tensor<2x8x7x7xf32>) -> tensor<2x8x7x7xELEM>
  %wc = mp.cast %w : (tensor<4x4x1x1xf32>) -> tensor<4x4x1x1xELEM>
  %bc = mp.cast %b : (tensor<4xf32>) -> tensor<4xELEM>
  %c = mp.conv2d %xc, %wc, %bc {groups = 2, mp.precision = ELEM, mp.accum = f32} : (tensor<2x8x7x7xELEM>, tensor<4x4x1x1xELEM>, tensor<4xELEM>) -> tensor<2x4x7x7xELEM>
  return %c : tensor<2x4x7x7xELEM>
}
"""


@pytest.mark.parametrize("elem,scale", [("bf16", 1.0), ("f16", 1.0), ("f16", 20000.0)])
def test_rounded_grouped_conv_with_nothing_to_fuse_rounds_as_it_stores(elem, scale) -> None:
    """A bf16/f16 conv whose result no bias add or relu follows (its bias an operand) still
    rounds in its tiles: one pass, the bits of the conv then the rounding."""
    weights = np.random.default_rng(8).standard_normal(16).round(3).reshape(4, 4)
    text = _ROUNDED_ALONE.replace("ELEM", elem).replace(
        "WEIGHTS", str([[[[v]] for v in row] for row in weights.tolist()]))
    program = Program(parse(text, "m.ir"))
    x = _inputs(6, scale)
    expect = program.run([x], reference=False).outputs[0]
    got = program.run_lowered(program.prepare_inputs([x]))[0]
    assert got.tobytes() == expect.tobytes()
    conv = program._live[-1]  # the op as it is, on the kernel that rounds as it stores
    assert conv.op == "mp.conv2d" and conv.run is conv.fast and conv.conv.rounded == elem
    assert _fused(text).functions["main"].op(conv.node) == "mp.conv2d"  # nothing to fuse
    assert np.isnan(got).any() and (got < 0).any() and (got > 0).any()
    if scale > 1:
        assert np.isinf(got).any()


_RESIDUAL = """func.func @main(%x: tensor<3x5x9xf32>, %y: tensor<3x5x9xf32>) -> tensor<3x5x9xELEM> {
  %xc = mp.cast %x : (tensor<3x5x9xf32>) -> tensor<3x5x9xELEM>
  %yc = mp.cast %y : (tensor<3x5x9xf32>) -> tensor<3x5x9xELEM>
  %a = mp.add %xc, %yc {mp.precision = ELEM} : (tensor<3x5x9xELEM>, tensor<3x5x9xELEM>) -> tensor<3x5x9xELEM>
  %r = mp.relu %a {mp.precision = ELEM} : (tensor<3x5x9xELEM>) -> tensor<3x5x9xELEM>
  return %r : tensor<3x5x9xELEM>
}
"""


@pytest.mark.parametrize("elem", ["f32", "bf16", "f16"])
def test_residual_add_and_relu_run_as_one_pass_with_numpys_bits(elem) -> None:
    text = _RESIDUAL.replace("ELEM", elem)
    if elem == "f32":
        text = "\n".join(line for line in text.splitlines() if "mp.cast" not in line)
        text = text.replace("%xc", "%x").replace("%yc", "%y")
    program = Program(_fused(text))
    rng = np.random.default_rng(5)
    x, y = (rng.standard_normal((2, 3, 5, 9)) * 40000).astype(np.float32)
    x.reshape(-1)[:6] = [np.nan, -0.0, 0.0, np.inf, 1e-40, -3.0]
    y.reshape(-1)[:6] = [1.0, -0.0, -0.0, -np.inf, 1e-40, 3.0]
    got = program.run_lowered(program.prepare_inputs([x, y]))[0]
    assert [s.op for s in program._live] == ["mp.cast"] * 2 * (elem != "f32") + ["mp.add_relu"]
    unfused = Program(parse(text, "m.ir"))  # the same bits, op by op
    assert unfused.run_lowered(unfused.prepare_inputs([x, y]))[0].tobytes() == got.tobytes()
    with np.errstate(all="ignore"):
        if elem == "f32":
            expect = np.maximum(x + y, np.float32(0))
        else:  # numpy / ml_dtypes: operands cast, added in f32, rounded, then the relu
            t = ML[elem]
            xs, ys = x.astype(t).astype(np.float32), y.astype(t).astype(np.float32)
            expect = np.maximum((xs + ys).astype(t).astype(np.float32), np.float32(0))
    assert got.tobytes() == expect.tobytes()
    assert np.isinf(got).any() == (elem == "f16")


@pytest.mark.parametrize("fmt", ["bf16", "f16", "f8E5M2"])
@pytest.mark.parametrize("n", [333, 3 * SERIAL_BELOW + 7])  # one thread, and the blocks
def test_add_relu_rounds_as_it_stores_with_the_bits_of_ml_dtypes_after_numpy(fmt, n) -> None:
    from mplower.numerics.elementwise import add_relu

    a, b = _awkward(n, 3), _awkward(n, 4)[::-1].copy()
    with np.errstate(all="ignore"):
        expect = np.maximum(a + b, np.float32(0)).astype(ML[fmt]).astype(np.float32)
    got = add_relu(a, b, fmt)
    assert got.tobytes() == expect.tobytes()
    assert np.isnan(got).any() and (got == 0).any()
    with pytest.raises(ValueError, match="float32"):
        add_relu(a.astype(np.float64), b.astype(np.float64), fmt)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [333, 3 * SERIAL_BELOW + 7])  # one thread, and the blocks
def test_compiled_add_and_relu_are_numpys_bits(dtype, n) -> None:
    """elementwise.add and relu (the reference's add and relu of large float arrays) against
    np.add and np.maximum(x, 0): NaN payloads, signed zeros, infinities, subnormals."""
    from mplower.numerics.elementwise import add, relu

    a, b = _awkward(n, 7).astype(dtype), _awkward(n, 8)[::-1].astype(dtype)
    a[10:14] = [-0.0, 0.0, -0.0, np.nan]
    b[10:14] = [-0.0, -0.0, 0.0, 1.0]
    a[20] = np.array(0x7FC00123, np.uint32).view(np.float32)  # a NaN with a payload
    with np.errstate(all="ignore"):
        expect_add = np.add(a, b)
    assert add(a, b).tobytes() == expect_add.tobytes()
    assert relu(a).tobytes() == np.maximum(a, dtype(0)).tobytes()
    assert relu(a.reshape(-1, 1)).shape == (n, 1)
    with pytest.raises(ValueError, match="one shape"):
        add(a, b[1:])
    with pytest.raises(ValueError, match="float32 or float64"):
        relu(np.ones(3, np.float16))


def test_reference_add_and_relu_of_large_arrays_run_compiled_with_numpys_bits(
        monkeypatch) -> None:
    """mp.add and mp.relu of float arrays of 64K values and more run in
    mplower.numerics.elementwise, and `run` gives numpy's bits."""
    from mplower.numerics import elementwise

    calls = []

    def counted(name: str):
        f = getattr(elementwise, name)
        return lambda *a: calls.append(name) or f(*a)

    for name in ("add", "relu"):
        monkeypatch.setattr(elementwise, name, counted(name))
    text = _RESIDUAL.replace("ELEM", "f32").replace("3x5x9", "4x130x130")
    text = "\n".join(line for line in text.splitlines() if "mp.cast" not in line)
    program = Program(parse(text.replace("%xc", "%x").replace("%yc", "%y"), "m.ir"))
    rng = np.random.default_rng(9)
    x, y = (rng.standard_normal((2, 4, 130, 130)) * 3).astype(np.float32)
    x.reshape(-1)[:3], y.reshape(-1)[:3] = [np.nan, -0.0, -0.0], [1.0, -0.0, 0.0]
    got = program.run([x, y], reference=False).outputs[0]
    with np.errstate(all="ignore"):
        assert got.tobytes() == np.maximum(x + y, np.float32(0)).tobytes()
    assert calls == ["add", "relu"]


@pytest.mark.parametrize("elem", ["f8E4M3FN", "f8E5M2"])
def test_fp8_conv_relu_fuses_only_where_the_format_keeps_a_negative_overflow_negative(elem):
    """f8E4M3FN has no infinity: a conv result below -448 rounds to NaN, which the relu after
    it keeps; a relu before the rounding would make it 0. So that relu stays an op of its own.
    f8E5M2 overflows to -inf, which the relu makes 0 either way: fused."""
    text = _ROUNDED_CONV.replace("mp.precision = ELEM, ", "").replace(" {mp.precision = ELEM}", "")
    text = text.replace("ELEM", elem)
    program = Program(_fused(text))
    x = _inputs(4, 1.0)
    x[1] = -100.0  # every output of image 1 is -100 * 72 * 0.25 - bias: beyond fp8's range
    expect = Program(parse(text, "m.ir")).run([x], reference=False).outputs[0]
    got = program.run_lowered(program.prepare_inputs([x]))[0]
    assert got.tobytes() == expect.tobytes()
    if elem == "f8E4M3FN":
        assert np.isnan(got[1]).all()
        assert [s.op for s in program._live] == ["mp.cast", "mp.conv2d", "mp.relu"]
    else:
        assert (got[1] == 0).all()
        assert [s.op for s in program._live] == ["mp.cast", "mp.fused_conv2d"]


_WEIGHTED = """func.func @main(%x: tensor<2x24x40xf32>) -> tensor<2x24x48xf32> {
  %w = mp.constant {value = dense<WEIGHTS> : tensor<40x48xf32>} : () -> tensor<40x48xf32>
  %y = mp.matmul %x, %w : (tensor<2x24x40xf32>, tensor<40x48xf32>) -> tensor<2x24x48xf32>
  %t = mp.transpose %w {perm = [1, 0]} : (tensor<40x48xf32>) -> tensor<48x40xf32>
  %z = mp.matmul %y, %t : (tensor<2x24x48xf32>, tensor<48x40xf32>) -> tensor<2x24x40xf32>
  %u = mp.matmul %z, %w : (tensor<2x24x40xf32>, tensor<40x48xf32>) -> tensor<2x24x48xf32>
  return %u : tensor<2x24x48xf32>
}
"""


def test_constant_matmul_weights_are_packed_once_with_the_bits_of_the_plain_product() -> None:
    """run_lowered packs a constant b once (gemm.PackedMatrix); the weight's other use (the
    transpose, folded once into a constant that is packed in turn) still reads the array, and
    every result is the op-by-op run's bits."""
    from conftest import sequential_matmul

    from mplower.numerics.gemm import PackedMatrix

    w = np.random.default_rng(8).standard_normal((40, 48)).astype(np.float32)
    text = _WEIGHTED.replace("WEIGHTS", np.array2string(
        w, separator=", ", threshold=10**6, floatmode="unique", max_line_width=10**6))
    program = Program(parse(text, "m.ir"))
    x = np.random.default_rng(9).standard_normal((2, 24, 40)).astype(np.float32)
    got = program.run_lowered(program.prepare_inputs([x]))[0]
    assert got.tobytes() == program.run([x], reference=False).outputs[0].tobytes()
    y = np.stack([sequential_matmul(v, w) for v in x])
    z = np.stack([sequential_matmul(v, np.ascontiguousarray(w.T)) for v in y])
    assert got.tobytes() == np.stack([sequential_matmul(v, w) for v in z]).tobytes()
    packed = [s.run.args[1] for s in program._live if s.op == "mp.matmul"
              and hasattr(s.run, "args")]
    assert len(packed) == 3 and all(isinstance(p, PackedMatrix) for p in packed)
    assert [p.stack.tobytes() for p in packed] == [w.tobytes(), w.T.tobytes(), w.tobytes()]


_SHUFFLE = """func.func @main(%x: tensor<3x12x9x10xf32>) -> (tensor<3x12x5x5xf32>, OUTPUTS) {
  %w = mp.constant {value = dense<WEIGHTS> : tensor<12x1x3x3xf32>} : () -> tensor<12x1x3x3xf32>
  %b = mp.constant {value = dense<BIAS> : tensor<12xf32>} : () -> tensor<12xf32>
  %s = mp.reshape %x : (tensor<3x12x9x10xf32>) -> tensor<3x4x3x9x10xf32>
  %t = mp.transpose %s {perm = [0, 2, 1, 3, 4]} : (tensor<3x4x3x9x10xf32>) -> tensor<3x3x4x9x10xf32>
  %u = mp.reshape %t : (tensor<3x3x4x9x10xf32>) -> tensor<3x12x9x10xf32>
  %y = mp.conv2d %u, %w, %b {strides = [2, 2], padding = [1, 1, 1, 0], groups = 12} : (tensor<3x12x9x10xf32>, tensor<12x1x3x3xf32>, tensor<12xf32>) -> tensor<3x12x5x5xf32>
  return %y, RETURNED
}
"""


@pytest.mark.parametrize("shared", [False, True])
def test_a_channel_shuffle_read_by_a_depthwise_conv_is_read_in_place(shared) -> None:
    """ShuffleNet's shuffle (reshape, swap, reshape) feeding a depthwise conv: the conv reads
    the channels in the shuffled order (no copy), with the bits of numpy's shuffle and the
    sequential depthwise sum; a shuffle that something else reads too stays."""
    rng = np.random.default_rng(12)
    w = rng.standard_normal((12, 1, 3, 3)).astype(np.float32)
    b = rng.standard_normal(12).astype(np.float32)

    def dense(v: np.ndarray) -> str:
        return np.array2string(v, separator=", ", threshold=10**6, floatmode="unique",
                               max_line_width=10**6)
    text = _SHUFFLE.replace("WEIGHTS", dense(w)).replace("BIAS", dense(b))
    if shared:
        text = text.replace("OUTPUTS", "tensor<3x12x9x10xf32>").replace(
            "RETURNED", "%u : tensor<3x12x5x5xf32>, tensor<3x12x9x10xf32>")
    else:
        text = text.replace(", OUTPUTS)", ")").replace("RETURNED", ": tensor<3x12x5x5xf32>")
        text = text.replace("return %y, :", "return %y :")
    program = Program(_fused(text))
    x = rng.standard_normal((3, 12, 9, 10)).astype(np.float32)
    x[0, 5, 2, 3] = np.nan
    got = program.run_lowered(program.prepare_inputs([x]))[0]
    ops = [s.op for s in program._live]
    assert ops == (["mp.reshape", "mp.transpose", "mp.reshape", "mp.conv2d"] if shared
                   else ["mp.fused_conv2d"])
    u = x.reshape(3, 4, 3, 9, 10).transpose(0, 2, 1, 3, 4).reshape(3, 12, 9, 10)
    padded = np.pad(u, ((0, 0), (0, 0), (1, 1), (1, 0)))
    expect = np.zeros((3, 12, 5, 5), np.float32)
    for ky in range(3):
        for kx in range(3):
            expect += padded[:, :, ky:ky + 9:2, kx:kx + 10:2][:, :, :5, :5] * w[:, 0, ky, kx][
                None, :, None, None]
    expect += b[None, :, None, None]
    assert got.tobytes() == expect.tobytes()
    unfused = Program(parse(text, "m.ir"))
    assert got.tobytes() == unfused.run([x], reference=False).outputs[0].tobytes()
    assert got.tobytes() == unfused.run_lowered(unfused.prepare_inputs([x]))[0].tobytes()


_SHUFFLE_INT8 = """func.func @main(%x: tensor<2x12x7x7xf32>) -> tensor<2x12x7x7xf32> {
  %w = mp.constant {value = dense<WEIGHTS> : tensor<12x1x3x3xi8>} : () -> tensor<12x1x3x3xi8>
  %s = mp.reshape %x : (tensor<2x12x7x7xf32>) -> tensor<2x3x4x7x7xf32>
  %t = mp.transpose %s {perm = [0, 2, 1, 3, 4]} : (tensor<2x3x4x7x7xf32>) -> tensor<2x4x3x7x7xf32>
  %u = mp.reshape %t : (tensor<2x4x3x7x7xf32>) -> tensor<2x12x7x7xf32>
  %q = mp.quantize %u {scale = 0.05 : f32, zero_point = 3 : ui8} : (tensor<2x12x7x7xf32>) -> tensor<2x12x7x7xui8>
  %c = mp.conv2d %q, %w {padding = [1, 1, 1, 1], groups = 12} : (tensor<2x12x7x7xui8>, tensor<12x1x3x3xi8>) -> tensor<2x12x7x7xi32>
  %y = mp.dequantize %c {scale = 0.001 : f32} : (tensor<2x12x7x7xi32>) -> tensor<2x12x7x7xf32>
  return %y : tensor<2x12x7x7xf32>
}
"""


def test_a_shuffle_quantized_per_tensor_for_an_int8_depthwise_conv_is_read_in_place() -> None:
    """In an int8 plan a per-tensor quantize sits between the shuffle and the conv: it runs on
    the unshuffled tensor and the conv (with its dequantize fused) reads the channels in the
    shuffled order, the exact integer sums numpy gives on the shuffled codes."""
    rng = np.random.default_rng(13)
    w = rng.integers(-128, 128, (12, 1, 3, 3)).astype(np.int8)
    text = _SHUFFLE_INT8.replace("WEIGHTS", np.array2string(w, separator=", "))
    program = Program(_fused(text))
    x = (rng.standard_normal((2, 12, 7, 7)) * 4).astype(np.float32)
    got = program.run_lowered(program.prepare_inputs([x]))[0]
    assert [s.op for s in program._live] == ["mp.quantize", "mp.fused_conv2d"]
    unfused = Program(parse(text, "m.ir"))
    assert got.tobytes() == unfused.run([x], reference=False).outputs[0].tobytes()
    u = x.reshape(2, 3, 4, 7, 7).transpose(0, 2, 1, 3, 4).reshape(2, 12, 7, 7)
    # The conv multiplies the stored codes (the zero point is the plan's business).
    codes = np.clip(np.round(u / np.float32(0.05)) + 3, 0, 255).astype(np.int64)
    padded = np.pad(codes, ((0, 0), (0, 0), (1, 1), (1, 1)))
    acc = sum(padded[:, :, ky:ky + 7, kx:kx + 7] * w[:, 0, ky, kx].astype(np.int64)[
        None, :, None, None] for ky in range(3) for kx in range(3))
    assert got.tobytes() == (acc.astype(np.float32) * np.float32(0.001)).tobytes()


_FIRE = """func.func @main(%x: tensor<2x16x9x9xf32>) -> tensor<2x40x9x9xf32> {
  %w1 = mp.constant {value = dense<W1> : tensor<16x16x1x1xf32>} : () -> tensor<16x16x1x1xf32>
  %b1 = mp.constant {value = dense<B1> : tensor<16xf32>} : () -> tensor<16xf32>
  %w3 = mp.constant {value = dense<W3> : tensor<24x16x3x3xf32>} : () -> tensor<24x16x3x3xf32>
  %b3 = mp.constant {value = dense<B3> : tensor<24xf32>} : () -> tensor<24xf32>
  %e1 = mp.conv2d %x, %w1, %b1 : (tensor<2x16x9x9xf32>, tensor<16x16x1x1xf32>, tensor<16xf32>) -> tensor<2x16x9x9xf32>
  %r1 = mp.relu %e1 : (tensor<2x16x9x9xf32>) -> tensor<2x16x9x9xf32>
  %e3 = mp.conv2d %x, %w3, %b3 {padding = [1, 1, 1, 1]} : (tensor<2x16x9x9xf32>, tensor<24x16x3x3xf32>, tensor<24xf32>) -> tensor<2x24x9x9xf32>
  %c = mp.concat %r1, %e3 {axis = 1} : (tensor<2x16x9x9xf32>, tensor<2x24x9x9xf32>) -> tensor<2x40x9x9xf32>
  return %c : tensor<2x40x9x9xf32>
}
"""


def test_convs_concatenated_along_channels_write_their_channels_in_place() -> None:
    """SqueezeNet's fire module: two convs (one with its relu fused) concatenated along the
    channels write straight into the concatenation, with the bits of the separate ops."""
    rng = np.random.default_rng(14)

    def dense(v: np.ndarray) -> str:
        return np.array2string(v, separator=", ", threshold=10**6, floatmode="unique",
                               max_line_width=10**6)
    w1 = rng.standard_normal((16, 16, 1, 1)).astype(np.float32)
    w3 = rng.standard_normal((24, 16, 3, 3)).astype(np.float32)
    b1, b3 = rng.standard_normal(16).astype(np.float32), rng.standard_normal(24).astype(np.float32)
    text = _FIRE.replace("W1", dense(w1)).replace("W3", dense(w3)).replace(
        "B1", dense(b1)).replace("B3", dense(b3))
    program = Program(_fused(text))
    x = rng.standard_normal((2, 16, 9, 9)).astype(np.float32)
    x[1, 3, 4, 4] = np.nan
    got = program.run_lowered(program.prepare_inputs([x]))[0]
    # The concat still runs: the convs wrote their channels into its buffer (their slots hold
    # it), and it returns that.
    assert [s.op for s in program._live] == ["mp.fused_conv2d", "mp.conv2d", "mp.concat"]
    assert program._live[1].inputs[-1] == program._live[0].output
    unfused = Program(parse(text, "m.ir"))
    assert got.tobytes() == unfused.run([x], reference=False).outputs[0].tobytes()
    from conftest import sequential_matmul

    e1 = np.stack([sequential_matmul(w1.reshape(16, 16), v.reshape(16, 81)) for v in x])
    e1 = np.maximum(e1 + b1[None, :, None], np.float32(0)).reshape(2, 16, 9, 9)
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    cols = np.stack([padded[:, c, ky:ky + 9, kx:kx + 9] for c in range(16) for ky in range(3)
                     for kx in range(3)], axis=1).reshape(2, 144, 81)
    e3 = np.stack([sequential_matmul(w3.reshape(24, 144), v) for v in cols])
    e3 = (e3 + b3[None, :, None]).reshape(2, 24, 9, 9)
    assert got.tobytes() == np.concatenate([e1, e3], axis=1).tobytes()


@pytest.mark.parametrize("case", ["float", "int8", "int8 chunked", "depthwise", "two groups"])
def test_conv_into_a_concatenation_gives_the_bits_of_the_conv_then_a_copy(case) -> None:
    """conv2d(into=(y, c0)) writes the result into channels c0.. of y: in place where the
    implicit GEMM stores each sum once (float, an 8-bit product within one exact chunk), as
    a copy elsewhere; every other channel of y is left as it was."""
    from mplower.numerics.conv import conv2d

    rng = np.random.default_rng(15)
    c, o, groups, k = {"float": (8, 16, 1, 3), "int8": (8, 16, 1, 3),
                       "int8 chunked": (80, 16, 1, 3), "depthwise": (8, 8, 8, 3),
                       "two groups": (8, 16, 2, 1)}[case]
    if case.startswith("int8"):
        x = rng.integers(0, 256, (2, c, 6, 7)).astype(np.uint8)
        w = rng.integers(-128, 128, (o, c // groups, k, k)).astype(np.int8)
        kwargs = {"scale": (rng.random(o) * 1e-3).astype(np.float32),
                  "bias": rng.standard_normal(o).astype(np.float32), "relu": True}
    else:
        x = rng.standard_normal((2, c, 6, 7)).astype(np.float32)
        w = rng.standard_normal((o, c // groups, k, k)).astype(np.float32)
        kwargs = {"bias": rng.standard_normal(o).astype(np.float32), "relu": True}
    geometry = ((1, 1), (k // 2,) * 4, (1, 1), groups)
    alone = conv2d(x, w, *geometry, **kwargs)
    y = np.full((2, o + 5, 6, 7), 7.0, np.float32)
    got = conv2d(x, w, *geometry, **kwargs, into=(y, 3))
    assert got is y and y[:, 3:3 + o].tobytes() == np.ascontiguousarray(alone).tobytes()
    assert (y[:, :3] == 7).all() and (y[:, 3 + o:] == 7).all()


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
@pytest.mark.parametrize("case", ["float", "depthwise", "two groups"])
def test_conv_into_a_concatenation_rounds_its_own_channels_as_ml_dtypes_casts(fmt, case):
    """conv2d(into=(y, c0), rounding=fmt): channels c0.. of y hold ml_dtypes' cast of the
    conv's float32 result (rounded in the implicit GEMM's tiles, or after a copy), and every
    other channel of y is left as it was, unrounded."""
    from mplower.numerics.conv import conv2d

    rng = np.random.default_rng(16)
    c, o, groups, k = {"float": (8, 16, 1, 3), "depthwise": (8, 8, 8, 3),
                       "two groups": (8, 16, 2, 1)}[case]
    x = (rng.standard_normal((2, c, 6, 7)) * 3e4).astype(np.float32)  # f16 overflows too
    w = rng.standard_normal((o, c // groups, k, k)).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32)
    geometry = ((1, 1), (k // 2,) * 4, (1, 1), groups)
    with np.errstate(over="ignore"):
        expect = conv2d(x, w, *geometry, bias=b).astype(ML[fmt]).astype(np.float32)
    y = np.full((2, o + 5, 6, 7), 1.0 + 2.0 ** -20, np.float32)  # not a bf16/f16 value
    got = conv2d(x, w, *geometry, bias=b, into=(y, 3), rounding=fmt)
    assert got is y and y[:, 3:3 + o].tobytes() == np.ascontiguousarray(expect).tobytes()
    assert (y[:, :3] == np.float32(1.0 + 2.0 ** -20)).all()
    assert (y[:, 3 + o:] == np.float32(1.0 + 2.0 ** -20)).all()


@pytest.mark.parametrize("fmt", ["bf16", "f16", "f8E4M3FN", "f8E5M2"])
@pytest.mark.parametrize("relu", [False, True])
def test_conv_rounding_in_its_tiles_is_round_to_of_the_result(fmt, relu) -> None:
    """conv2d(rounding=...) rounds each tile as the GEMM stores it (16 output channels: the
    implicit GEMM), each work unit's outputs as a depthwise conv stores them (same-size and
    strided layouts) and elsewhere after it (4 channels): the bits of rounding.round_to of
    the plain result, overflow, underflow and NaN included."""
    from mplower.numerics.conv import conv2d
    from mplower.numerics.rounding import round_to

    rng = np.random.default_rng(17)
    x = (rng.standard_normal((2, 8, 9, 9)) * 30).astype(np.float32)
    x[0, 0, 0, :4] = [np.nan, np.inf, 1e30, 1e-30]
    for w, groups, s in ((rng.standard_normal((16, 8, 3, 3)), 1, 1),
                         (rng.standard_normal((4, 8, 1, 1)), 1, 1),
                         (rng.standard_normal((8, 1, 3, 3)), 8, 1),
                         (rng.standard_normal((16, 1, 3, 3)), 8, 2)):
        w = (w * 40).astype(np.float32)
        bias = rng.standard_normal(w.shape[0]).astype(np.float32)
        geometry = ((s, s), (1, 1, 1, 1), (1, 1), groups)
        plain = conv2d(x, w, *geometry, bias=bias, relu=relu)
        got = conv2d(x, w, *geometry, bias=bias, relu=relu, rounding=fmt)
        assert got.tobytes() == round_to(np.ascontiguousarray(plain), fmt)[0].tobytes()
        assert np.isnan(got).any()


def test_bf16_rounding_in_the_conv_registers_is_ml_dtypes_cast_at_ties_and_edges() -> None:
    """The implicit GEMM rounds bf16 in its registers (gemm._post_epilogue): outputs that are
    exactly the inputs (an identity 1x1 conv, 40 pixels: a full panel and a partial one) at
    ties to even, just off them, the largest finite floats (to inf), subnormals and NaNs with
    payloads and signs: ml_dtypes' cast bit for bit, a NaN a NaN of the same sign."""
    from mplower.numerics.conv import conv2d

    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF, 0xBF808000, 0x7F7FFFFF,
                     0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00008000, 0x00018000, 0x80007FFF,
                     0x7F800000, 0xFF800000, 0x7F800001, 0xFFC12345, 0x7FBFFFFF, 0x00000000,
                     0x3F800000, 0x4049FFFF], np.uint32)
    values = np.resize(bits, 16 * 40).view(np.float32).reshape(1, 16, 5, 8)
    values = np.ascontiguousarray(np.roll(values, 3, axis=1))
    w = np.eye(16, dtype=np.float32).reshape(16, 16, 1, 1)
    geometry = ((1, 1), (0, 0, 0, 0), (1, 1), 1)
    plain = conv2d(values, w, *geometry)
    got = conv2d(values, w, *geometry, rounding="bf16")
    expect = plain.astype(ml_dtypes.bfloat16).astype(np.float32)
    nan = np.isnan(expect)
    assert nan.sum() >= 16 * 40 * 3 // 20
    assert got[~nan].tobytes() == expect[~nan].tobytes()
    assert np.isnan(got[nan]).all()
    assert (np.signbit(got[nan]) == np.signbit(plain[nan])).all()


def test_f16_rounding_in_the_conv_registers_is_numpys_float16_cast_bit_for_bit() -> None:
    """The implicit GEMM rounds f16 in its registers with the CPU's float16 conversion
    (gemm._post_epilogue): at ties to even, the overflow boundary (65520 to inf, just below it
    to 65504), f16 subnormals and their ties, and NaNs whose payload lies only in the bits
    f16 drops: numpy's float16 cast and back, bit for bit, NaNs included."""
    from mplower.numerics.conv import conv2d

    bits = np.array([0x3F801000, 0x3F803000, 0x3F801001, 0x477FF000, 0x477FEFFF, 0xC77FF000,
                     0x33000000, 0x33000001, 0x33800000, 0x33C00000, 0x34200000, 0x387FC000,
                     0x387FE000, 0x80001234, 0x7F800001, 0xFF800001, 0xFFC12345, 0x7FBFFFFF,
                     0x7F800000, 0x3F800000], np.uint32)
    # Channel 0 holds them (40 pixels: a full panel and a partial one), channel 1 zeros; every
    # output channel is 0 + 1 * x0 + 0 * 0: x0, a signalling NaN made quiet.
    values = np.zeros((1, 2, 5, 8), np.float32)
    values[0, 0] = np.resize(bits, 40).view(np.float32).reshape(5, 8)
    w = np.zeros((16, 2, 1, 1), np.float32)
    w[:, 0] = 1.0
    geometry = ((1, 1), (0, 0, 0, 0), (1, 1), 1)
    plain = conv2d(values, w, *geometry)
    assert np.isnan(plain).sum() == 16 * 8 and np.isinf(plain).sum() == 16 * 2
    got = conv2d(values, w, *geometry, rounding="f16")
    with np.errstate(over="ignore"):
        expect = plain.astype(np.float16).astype(np.float32)
    assert got.tobytes() == expect.tobytes()


@pytest.mark.parametrize("kernel", [1, 3])
def test_conv_amax_counts_only_the_columns_a_partial_panel_stores(kernel) -> None:
    """The lanes of a partial panel past the last pixel compute the bias alone; the amax the
    implicit GEMM takes in its registers leaves them out: here every pixel gives 0.5 while
    those lanes would give 100 (35 pixels: a panel of 32, one of 3; two input channels, so
    that it is no depthwise conv)."""
    from mplower.numerics import conv

    x = np.full((1, 2, 5, 7), -99.5, np.float32)
    w = np.zeros((8, 2, kernel, kernel), np.float32)
    w[:, 0, kernel // 2, kernel // 2] = 1.0
    pad = kernel // 2
    for rounding in (None, "bf16"):
        found = []
        y = conv.conv2d(x, w, (1, 1), (pad,) * 4, (1, 1), 1, bias=np.full(8, 100, np.float32),
                        rounding=rounding, amax=found)
        assert (y == 0.5).all()
        assert found == [0.5]


_QDQ = """func.func @main(%x: tensor<2x4x5x6xf32>) -> tensor<2x4x5x6xf32> {
  %q = mp.quantize %x {scale = SCALE, zero_point = ZP, axis = 1} : (tensor<2x4x5x6xf32>) -> tensor<2x4x5x6xELEM>
  %d = mp.dequantize %q {scale = SCALE, zero_point = ZP, axis = 1} : (tensor<2x4x5x6xELEM>) -> tensor<2x4x5x6xf32>
  %r = mp.relu %d : (tensor<2x4x5x6xf32>) -> tensor<2x4x5x6xf32>
  return %r : tensor<2x4x5x6xf32>
}
"""


@pytest.mark.parametrize("elem,per_channel", [("i8", True), ("ui8", True), ("i8", False)])
def test_a_quantize_read_only_by_its_dequantize_runs_as_one_pass_with_numpys_bits(
        elem, per_channel) -> None:
    """The int8 plan's QDQ pair in front of a float32 op: one step computes (q - zp) * s
    without storing q; the bits of ONNX's formulas written in numpy."""
    rng = np.random.default_rng(14)
    s = np.array([0.05, 0.11, 0.013, 0.3], np.float32)
    zp = np.array([0, 3, -7, 1]) if elem == "i8" else np.array([128, 0, 255, 7])
    if not per_channel:
        s, zp = s[:1], zp[:1]
    text = _QDQ.replace("ELEM", elem)
    if per_channel:
        text = text.replace("SCALE", f"dense<{s.tolist()}> : tensor<4xf32>").replace(
            "ZP", f"dense<{zp.tolist()}> : tensor<4x{elem}>")
    else:
        text = text.replace("SCALE", f"{float(s[0])} : f32").replace(
            "ZP", f"{int(zp[0])} : {elem}").replace(", axis = 1", "")
    program = Program(_fused(text))
    x = (rng.standard_normal((2, 4, 5, 6)) * 20).astype(np.float32)
    x[0, 0, 0, :3] = [np.inf, -np.inf, 1e30]
    x[1, 2, 3, :2] = [-0.0, s[-1] * np.float32(2.5)]  # a tie: half to even
    got = program.run_lowered(program.prepare_inputs([x]))[0]
    assert [st.op for st in program._live] == ["mp.fake_quant", "mp.relu"]
    unfused = Program(parse(text, "m.ir"))
    assert got.tobytes() == unfused.run([x], reference=False).outputs[0].tobytes()
    assert got.tobytes() == program.run([x], reference=False).outputs[0].tobytes()
    info = np.iinfo(np.int8 if elem == "i8" else np.uint8)
    shape = (1, -1, 1, 1)
    with np.errstate(over="ignore"):
        q = np.clip(np.rint(x / s.reshape(shape)) + zp.reshape(shape), info.min, info.max)
    expect = (q - zp.reshape(shape)).astype(np.int32).astype(np.float32) * s.reshape(shape)
    assert got.tobytes() == np.maximum(expect, np.float32(0)).tobytes()


@pytest.mark.parametrize("case", ["gemm", "gemm-bf16", "depthwise", "depthwise-s2", "narrow"])
def test_conv_amax_is_taken_as_the_outputs_are_stored_with_rounding_amaxs_value(
        monkeypatch, case) -> None:
    """conv2d(amax=) gives rounding.amax of its result: from the tiles of the implicit GEMM and
    the depthwise kernel's units (no pass after them), from a pass elsewhere (4 channels)."""
    from mplower.numerics import conv
    from mplower.numerics.rounding import amax

    rng = np.random.default_rng(19)
    x = (rng.standard_normal((2, 8, 9, 9)) * 30).astype(np.float32)
    w_shape, groups, s, rounding = {
        "gemm": ((16, 8, 3, 3), 1, 1, None), "gemm-bf16": ((16, 8, 3, 3), 1, 1, "bf16"),
        "depthwise": ((8, 1, 3, 3), 8, 1, None), "depthwise-s2": ((16, 1, 3, 3), 8, 2, "f16"),
        "narrow": ((4, 8, 1, 1), 1, 1, None)}[case]
    w = (rng.standard_normal(w_shape) * 3).astype(np.float32)
    geometry = ((s, s), (1, 1, 1, 1), (1, 1), groups)
    passes = []
    monkeypatch.setattr(conv, "rounding_amax", lambda y: passes.append(1) or amax(y))
    for relu in (False, True):
        found = []
        y = conv.conv2d(x, w, *geometry, relu=relu, rounding=rounding, amax=found)
        assert np.float32(found[0]).tobytes() == np.float32(np.max(np.abs(y))).tobytes()
    assert len(passes) == (2 if case == "narrow" else 0)
    x[1, 3, 4, 4] = np.nan  # a NaN output makes the amax NaN, as rounding.amax
    found = []
    conv.conv2d(x, w, *geometry, rounding=rounding, amax=found)
    assert np.isnan(found[0])


@pytest.mark.parametrize("n", [333, 3 * SERIAL_BELOW + 7])
def test_add_relu_amax_is_numpys_max_of_abs_of_its_result(n) -> None:
    from mplower.numerics.elementwise import add_relu

    a, b = _awkward(n, 5), _awkward(n, 6)
    a[np.isnan(a)] = 1.0
    b[np.isnan(b)] = 2.0
    for rounding in (None, "bf16"):
        found = []
        y = add_relu(a, b, rounding, amax=found)
        with np.errstate(invalid="ignore"):
            expect = np.max(np.abs(y))
        assert np.float32(found[0]).tobytes() == np.float32(expect).tobytes()
    a[7] = np.nan
    found = []
    add_relu(a, b, amax=found)
    assert np.isnan(found[0])


_FP8_CHAIN = """func.func @main(%x: tensor<2x8x7x7xf32>, %s: tensor<2x4x7x7xf32>) -> tensor<2x4x7x7xf32> {
  %w = mp.constant {value = dense<0.25> : tensor<4x8x3x3xf32>} : () -> tensor<4x8x3x3xf32>
  %w2 = mp.constant {value = dense<-0.5> : tensor<4x1x3x3xf32>} : () -> tensor<4x1x3x3xf32>
  %xq = mp.scaled_quant %x {recipe = "current"} : (tensor<2x8x7x7xf32>) -> tensor<2x8x7x7xf8E4M3FN>
  %wq = mp.scaled_quant %w {recipe = "current"} : (tensor<4x8x3x3xf32>) -> tensor<4x8x3x3xf8E4M3FN>
  %c = mp.conv2d %xq, %wq {padding = [1, 1, 1, 1], mp.precision = f8E4M3FN, mp.accum = f32} : (tensor<2x8x7x7xf8E4M3FN>, tensor<4x8x3x3xf8E4M3FN>) -> tensor<2x4x7x7xf32>
  %a = mp.add %c, %s : (tensor<2x4x7x7xf32>, tensor<2x4x7x7xf32>) -> tensor<2x4x7x7xf32>
  %r = mp.relu %a : (tensor<2x4x7x7xf32>) -> tensor<2x4x7x7xf32>
  %rq = mp.scaled_quant %r {recipe = "current"} : (tensor<2x4x7x7xf32>) -> tensor<2x4x7x7xf8E4M3FN>
  %w2q = mp.scaled_quant %w2 {recipe = "current"} : (tensor<4x1x3x3xf32>) -> tensor<4x1x3x3xf8E4M3FN>
  %d = mp.conv2d %rq, %w2q {padding = [1, 1, 1, 1], groups = 4, mp.precision = f8E4M3FN, mp.accum = f32} : (tensor<2x4x7x7xf8E4M3FN>, tensor<4x1x3x3xf8E4M3FN>) -> tensor<2x4x7x7xf32>
  %dq = mp.scaled_quant %d {recipe = "current"} : (tensor<2x4x7x7xf32>) -> tensor<2x4x7x7xf8E4M3FN>
  %y = mp.add %dq, %r : (tensor<2x4x7x7xf8E4M3FN>, tensor<2x4x7x7xf32>) -> tensor<2x4x7x7xf32>
  return %y : tensor<2x4x7x7xf32>
}
"""


def test_scaled_quants_of_conv_and_residual_results_take_the_amax_their_producer_took(
        monkeypatch) -> None:
    """Current scaling after a residual add + relu and after a depthwise conv: the producers
    take the amax as they store, the scaled_quants make no pass of their own; the bits of the
    ops run one at a time."""
    from mplower.numerics import rounding

    program = Program(_fused(_FP8_CHAIN))
    rng = np.random.default_rng(23)
    x = (rng.standard_normal((2, 8, 7, 7)) * 3).astype(np.float32)
    s = (rng.standard_normal((2, 4, 7, 7)) * 5).astype(np.float32)
    expect = Program(parse(_FP8_CHAIN, "m.ir")).run([x, s], reference=False).outputs[0]
    inputs = program.prepare_inputs([x, s])
    program.run_lowered(inputs)  # folds the weights' scaled_quants, fuses
    passes, overwrites = [], []
    original, scale_round = rounding.amax, rounding.scale_round
    monkeypatch.setattr(rounding, "amax", lambda v: passes.append(v.shape) or original(v))
    # (shape, overwrite, counted) of each call: scale_round(x, fmt, sf, amax, overwrite[,
    # counted]).
    monkeypatch.setattr(rounding, "scale_round", lambda x, *a: overwrites.append(
        (x.shape, a[3], a[4] if len(a) > 4 else True)) or scale_round(x, *a))
    got = program.run_lowered(inputs)[0]
    assert got.tobytes() == expect.tobytes()
    assert passes == [(2, 8, 7, 7)]  # only the input's: no step computes x
    # The depthwise conv's result is read by its scaled_quant alone, which writes over it;
    # the relu's is read by the final add too, and the program's input belongs to the caller.
    # The two that read their producer's amax take no counts (run_lowered keeps none).
    assert overwrites == [((2, 8, 7, 7), False, True), ((2, 4, 7, 7), False, False),
                          ((2, 4, 7, 7), True, False)]
    assert inputs[0].tobytes() == program.prepare_inputs([x, s])[0].tobytes()
    ops = [st.op for st in program._live]
    assert ops.count("mp.scaled_quant") == 3 and "mp.relu" not in ops  # add + relu fused


_DW_QDQ = """func.func @main(%x: tensor<2x4x6x6xf32>) -> tensor<2x4x6x6xf32> {
  %w = mp.constant {value = dense<WEIGHTS> : tensor<4x1x3x3xf32>} : () -> tensor<4x1x3x3xf32>
  %b = mp.constant {value = dense<[0.5, -1.0, 0.25, 2.0]> : tensor<4xf32>} : () -> tensor<4xf32>
  %c = mp.conv2d %x, %w, %b {padding = [1, 1, 1, 1], groups = 4} : (tensor<2x4x6x6xf32>, tensor<4x1x3x3xf32>, tensor<4xf32>) -> tensor<2x4x6x6xf32>
  %q = mp.quantize %c {scale = dense<[0.05, 0.11, 0.013, 0.3]> : tensor<4xf32>, zero_point = dense<[0, 3, -7, 1]> : tensor<4xi8>, axis = 1} : (tensor<2x4x6x6xf32>) -> tensor<2x4x6x6xi8>
  %d = mp.dequantize %q {scale = dense<[0.05, 0.11, 0.013, 0.3]> : tensor<4xf32>, zero_point = dense<[0, 3, -7, 1]> : tensor<4xi8>, axis = 1} : (tensor<2x4x6x6xi8>) -> tensor<2x4x6x6xf32>
  return %d : tensor<2x4x6x6xf32>
}
"""


def test_a_depthwise_conv_read_only_by_a_qdq_pair_requantizes_as_it_stores() -> None:
    """The int8 plan's depthwise conv -> quantize -> dequantize: the conv's kernel quantizes
    and dequantizes each output as it stores it; the bits of the three ops, and of ONNX's
    formulas in numpy on the conv's result."""
    rng = np.random.default_rng(29)
    w = (rng.standard_normal((4, 1, 3, 3)) * 2).astype(np.float32)
    text = _DW_QDQ.replace("WEIGHTS", np.array2string(w, separator=", ", floatmode="unique"))
    program = Program(_fused(text))
    x = (rng.standard_normal((2, 4, 6, 6)) * 3).astype(np.float32)
    x[0, 0, 0, 0] = np.inf
    got = program.run_lowered(program.prepare_inputs([x]))[0]
    assert [st.op for st in program._live] == ["mp.fused_conv2d"]
    unfused = Program(parse(text, "m.ir"))
    assert got.tobytes() == unfused.run([x], reference=False).outputs[0].tobytes()
    from mplower.numerics.conv import conv2d

    bias = np.array([0.5, -1.0, 0.25, 2.0], np.float32)
    y = conv2d(x, w, (1, 1), (1, 1, 1, 1), (1, 1), 4, bias=bias)
    s = np.array([0.05, 0.11, 0.013, 0.3], np.float32).reshape(1, -1, 1, 1)
    zp = np.array([0, 3, -7, 1]).reshape(1, -1, 1, 1)
    with np.errstate(invalid="ignore"):
        q = np.clip(np.nan_to_num(np.rint(y / s), nan=0.0) + zp, -128, 127)
    expect = (q - zp).astype(np.int32).astype(np.float32) * s
    assert got.tobytes() == expect.tobytes()


_INT8_MATMUL = """func.func @main(%x: tensor<2x5xKxf32>) -> tensor<2x5x6xf32> {
  %w = mp.constant {value = dense<WEIGHT> : tensor<Kx6xi8>} : () -> tensor<Kx6xi8>
  %xq = mp.quantize %x {scale = 0.05 : f32, zero_point = 0 : ELEM} : (tensor<2x5xKxf32>) -> tensor<2x5xKxELEM>
  %acc = mp.matmul %xq, %w : (tensor<2x5xKxELEM>, tensor<Kx6xi8>) -> tensor<2x5x6xi32>
  %y = mp.dequantize %acc {scale = dense<SCALE> : tensor<6xf32>, zero_point = 0 : i32, axis = 2} : (tensor<2x5x6xi32>) -> tensor<2x5x6xf32>
  %c = mp.constant {value = dense<CORRECTION> : tensor<1x6xf32>} : () -> tensor<1x6xf32>
  %yc = mp.add %y, %c : (tensor<2x5x6xf32>, tensor<1x6xf32>) -> tensor<2x5x6xf32>
  %b = mp.constant {value = dense<BIAS> : tensor<6xf32>} : () -> tensor<6xf32>
  %r = mp.add %b, %yc : (tensor<6xf32>, tensor<2x5x6xf32>) -> tensor<2x5x6xf32>
  return %r : tensor<2x5x6xf32>
}
"""


@pytest.mark.parametrize("elem,k,fused", [("i8", 64, True), ("ui8", 48, True),
                                          ("i8", 1040, False)])
def test_an_int8_matmuls_dequantize_and_constant_adds_run_as_its_epilogue(elem, k,
                                                                          fused) -> None:
    """A static int8 matmul (BERT's projections), its per-column dequantize and the adds of a
    (1, N) and an (N,) constant: one step in run_lowered where the float32 GEMM's sums are
    the exact integers (128 * 128 * K <= 2^24), with the bits of ONNX's formulas written in
    numpy (int64 sums, float32(q) * s, then each add); beyond that bound the ops stay apart,
    with the same bits."""
    rng = np.random.default_rng(21)
    w = rng.integers(-128, 128, (k, 6)).astype(np.int8)
    scale = (rng.random(6) * 1e-3).astype(np.float32)
    correction = rng.standard_normal((1, 6)).astype(np.float32)
    bias = rng.standard_normal(6).astype(np.float32)
    text = (_INT8_MATMUL.replace("ELEM", elem).replace("WEIGHT", str(w.tolist()))
            .replace("SCALE", str(scale.tolist())).replace("CORRECTION",
                                                          str(correction.tolist()))
            .replace("BIAS", str(bias.tolist())).replace("xK", f"x{k}").replace("<K", f"<{k}"))
    program = Program(_fused(text))
    x = (rng.standard_normal((2, 5, k)) * 4).astype(np.float32)
    if elem == "ui8":
        x = np.abs(x)
    got = program.run_lowered(program.prepare_inputs([x]))[0]
    ops = [s.op for s in program._live]
    assert ops == (["mp.quantize", "mp.fused_matmul"] if fused else
                   ["mp.quantize", "mp.matmul", "mp.dequantize", "mp.add", "mp.add"])
    info = np.iinfo(np.int8 if elem == "i8" else np.uint8)
    q = np.clip(np.rint(x / np.float32(0.05)), info.min, info.max).astype(np.int64)
    acc = q @ w.astype(np.int64)
    expect = (acc.astype(np.int32).astype(np.float32) * scale + correction) + bias
    assert expect.dtype == np.float32 and got.tobytes() == expect.tobytes()
    assert got.tobytes() == program.run([x], reference=False).outputs[0].tobytes()
    unfused = Program(parse(text, "m.ir"))
    assert got.tobytes() == unfused.run([x], reference=False).outputs[0].tobytes()


_FLOAT_MATMUL = """func.func @main(%x: tensor<2x5x16xE0>) -> tensor<2x5x6xE2> {
  %w = mp.constant {value = dense<WEIGHT> : tensor<16x6xE0>} : () -> tensor<16x6xE0>
  %y = mp.matmul %x, %w : (tensor<2x5x16xE0>, tensor<16x6xE0>) -> tensor<2x5x6xE0>
  %b = mp.constant {value = dense<BIAS> : tensor<6xE0>} : () -> tensor<6xE0>
  %yb = mp.add %b, %y : (tensor<6xE0>, tensor<2x5x6xE0>) -> tensor<2x5x6xE1>
  %c = mp.constant {value = dense<CORRECTION> : tensor<1x6xE1>} : () -> tensor<1x6xE1>
  %r = mp.add %yb, %c : (tensor<2x5x6xE1>, tensor<1x6xE1>) -> tensor<2x5x6xE2>
  return %r : tensor<2x5x6xE2>
}
"""


@pytest.mark.parametrize("elems", [("bf16", "bf16", "bf16"), ("f16", "f16", "f16"),
                                   ("f32", "f32", "f32"), ("bf16", "f32", "f32")])
def test_a_float_matmuls_rounding_and_bias_adds_run_as_one_pass(elems, monkeypatch) -> None:
    """A float matmul rounded to its format, then the adds of an (N,) and a (1, N) constant,
    each rounded to its own: one step in run_lowered, whose bits are the GEMM's fixed-order
    sums in numpy, then each rounding and float32 add through ml_dtypes' and numpy's types,
    and run's. Serial and split over the worker threads; NaN, infinities and halfway values
    among the sums."""
    from conftest import sequential_matmul

    from mplower.numerics import elementwise

    types = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}

    def rounded(v, elem):
        with np.errstate(over="ignore"):
            return v.astype(types[elem]).astype(np.float32)

    rng = np.random.default_rng(23)
    w = rounded((rng.standard_normal((16, 6)) * 3).astype(np.float32), elems[0])
    bias = rounded(rng.standard_normal(6).astype(np.float32), elems[0])
    correction = rounded(rng.standard_normal((1, 6)).astype(np.float32) * 1e3, elems[1])
    text = (_FLOAT_MATMUL.replace("WEIGHT", str(w.tolist())).replace("BIAS", str(bias.tolist()))
            .replace("CORRECTION", str(correction.tolist())))
    for i, elem in enumerate(elems):
        text = text.replace(f"E{i}", elem)
    program = Program(_fused(text))
    x = rounded((rng.standard_normal((2, 5, 16)) * 40).astype(np.float32), elems[0])
    x[0, 0, 0], x[0, 1, 1], x[1, 0, 2] = np.nan, np.inf, -np.inf
    y = np.stack([sequential_matmul(x[i], w) for i in range(2)])
    expect = rounded(rounded(rounded(y, elems[0]) + bias, elems[1]) + correction, elems[2])
    for serial_below in (elementwise.SERIAL_BELOW, 0):
        monkeypatch.setattr(elementwise, "SERIAL_BELOW", serial_below)
        got = program.run_lowered(program.prepare_inputs([x]))[0]
        assert [s.op for s in program._live] == ["mp.fused_matmul"]
        assert got.tobytes() == expect.tobytes()
    assert got.tobytes() == program.run([x], reference=False).outputs[0].tobytes()
    unfused = Program(parse(text, "m.ir"))
    assert got.tobytes() == unfused.run([x], reference=False).outputs[0].tobytes()
    assert np.isnan(got).any() and np.isinf(got).any()


@pytest.mark.parametrize("fmt", ["bf16", "f16", "f8E4M3FN", "f8E5M2"])
def test_round_add_columns_is_round_to_then_each_float32_add_and_round_to(fmt,
                                                                         monkeypatch) -> None:
    """elementwise.round_add_columns against ml_dtypes' casts and numpy's float32 adds, at
    values on and off the ties, beyond the range, subnormal and NaN, in blocks of rows on the
    worker threads as well; "f32" steps round nothing."""
    from mplower.numerics import elementwise
    from mplower.numerics.elementwise import round_add_columns

    types = {"f32": np.float32, **ML}
    rng = np.random.default_rng(24)
    y = (rng.standard_normal((7, 33, 40)) * 10.0 ** rng.integers(-45, 38, (7, 33, 40))
         ).astype(np.float32)
    y.reshape(-1)[:6] = [np.nan, -np.inf, np.inf, -0.0, 1.0 + 2.0 ** -8, 1.0 + 2.0 ** -11]
    vectors = [(rng.standard_normal(40) * 100).astype(np.float32) for _ in range(2)]

    def rounded(v, f):
        with np.errstate(over="ignore", invalid="ignore"):
            return v.astype(types[f]).astype(np.float32)

    expect = rounded(rounded(y, fmt) + vectors[0], "f32")
    expect = rounded(expect + vectors[1], fmt)
    for serial_below in (elementwise.SERIAL_BELOW, 0):
        monkeypatch.setattr(elementwise, "SERIAL_BELOW", serial_below)
        got = y.copy()
        round_add_columns(got, fmt, [(vectors[0], "f32"), (vectors[1], fmt)])
        assert got.tobytes() == expect.tobytes()
    with pytest.raises(ValueError, match="round_add_columns"):
        round_add_columns(y.copy(), "f4E2M1FN", [])
    with pytest.raises(ValueError, match="round_add_columns"):
        round_add_columns(y.copy(), fmt, [(vectors[0][:39], fmt)])


_ADD_RELU_Q = """func.func @main(%a: tensor<2x8x9x9xf32>, %b: tensor<2x8x9x9xf32>) -> (tensor<2x8x9x9xELEM>, tensor<2x8x9x9xf32>) {
  %s = mp.add %a, %b : (tensor<2x8x9x9xf32>, tensor<2x8x9x9xf32>) -> tensor<2x8x9x9xf32>
  %r = mp.relu %s : (tensor<2x8x9x9xf32>) -> tensor<2x8x9x9xf32>
  %q = mp.quantize %r {scale = 0.05 : f32, zero_point = ZP : ELEM} : (tensor<2x8x9x9xf32>) -> tensor<2x8x9x9xELEM>
  %t = mp.add %r, %a : (tensor<2x8x9x9xf32>, tensor<2x8x9x9xf32>) -> tensor<2x8x9x9xf32>
  return %q, %t : tensor<2x8x9x9xELEM>, tensor<2x8x9x9xf32>
}
"""


def _onnx_quantize(y: np.ndarray, scale: float, zp: int, dtype: type) -> np.ndarray:
    """ONNX QuantizeLinear in numpy: float32 division, half to even, plus the zero point,
    saturated; NaN to the zero point."""
    info = np.iinfo(dtype)
    with np.errstate(invalid="ignore"):
        q = np.rint(y / np.float32(scale)) + np.float32(zp)
        return np.where(np.isnan(q), zp, np.clip(q, info.min, info.max)).astype(dtype)


@pytest.mark.parametrize("elem,zp", [("ui8", 3), ("i8", -5)])
def test_a_residual_add_relu_read_quantized_and_as_it_is_quantizes_in_its_own_pass(
        elem, zp, monkeypatch) -> None:
    """An add + relu whose result a quantize and another add both read (ResNet's residual
    before the next block): run_lowered's add_relu pass quantizes it too and the quantize step
    takes those integers, with numpy's ONNX QuantizeLinear's bits and run's; serial and in
    blocks on the worker threads."""
    from mplower.numerics import elementwise

    text = _ADD_RELU_Q.replace("ELEM", elem).replace("ZP", str(zp))
    program = Program(_fused(text))
    rng = np.random.default_rng(27)
    a, b = ((rng.standard_normal((2, 8, 9, 9)) * 8).astype(np.float32) for _ in range(2))
    a[0, 0, 0, :3] = [np.nan, np.inf, -np.inf]
    dtype = np.uint8 if elem == "ui8" else np.int8
    r = np.maximum(a + b, np.float32(0))
    expect_q, expect_t = _onnx_quantize(r, 0.05, zp, dtype), r + a
    for serial_below in (elementwise.SERIAL_BELOW, 0):
        monkeypatch.setattr(elementwise, "SERIAL_BELOW", serial_below)
        q, t = program.run_lowered(program.prepare_inputs([a, b]))
        assert [s.op for s in program._live] == ["mp.add_relu", "mp.quantize", "mp.add"]
        assert q.dtype == dtype and q.tobytes() == expect_q.tobytes()
        assert t.tobytes() == expect_t.tobytes()
    ran = program.run([a, b], reference=False).outputs
    assert q.tobytes() == ran[0].tobytes() and t.tobytes() == ran[1].tobytes()
    ran = Program(parse(text, "m.ir")).run([a, b], reference=False).outputs  # unfused
    assert q.tobytes() == ran[0].tobytes() and t.tobytes() == ran[1].tobytes()
    info = np.iinfo(dtype)
    assert (q == info.max).any() and (q == zp).any()


def test_add_relu_quantize_refuses_what_it_cannot_quantize() -> None:
    from mplower.numerics.elementwise import add_relu

    a = np.ones((4, 4), np.float32)
    for quantize in ((0.1, 0, "f8E4M3FN", []), (np.ones(2, np.float32), 0, "ui8", []),
                     (0.1, 0, "i16", [])):
        with pytest.raises(ValueError, match="quantize"):
            add_relu(a, a, quantize=quantize)


_BINARY_CHAIN = """func.func @main(%x: tensor<2x40x48xbf16>, %z: tensor<2x40x48xbf16>) -> (tensor<2x40x48xbf16>, tensor<2x40x48xf16>) {
  %s = mp.constant {value = dense<0.7> : tensor<bf16>} : () -> tensor<bf16>
  %m = mp.mul %x, %s : (tensor<2x40x48xbf16>, tensor<bf16>) -> tensor<2x40x48xbf16>
  %c = mp.cast %m : (tensor<2x40x48xbf16>) -> tensor<2x40x48xf32>
  %v = mp.constant {value = dense<VECTOR> : tensor<48xf32>} : () -> tensor<48xf32>
  %d = mp.sub %v, %c : (tensor<48xf32>, tensor<2x40x48xf32>) -> tensor<2x40x48xf32>
  %h = mp.cast %d : (tensor<2x40x48xf32>) -> tensor<2x40x48xf16>
  %p = mp.add %x, %z : (tensor<2x40x48xbf16>, tensor<2x40x48xbf16>) -> tensor<2x40x48xbf16>
  return %p, %h : tensor<2x40x48xbf16>, tensor<2x40x48xf16>
}
"""


def test_bf16_and_fp16_elementwise_ops_round_in_the_same_pass(monkeypatch) -> None:
    """A bf16 mul by a scalar constant and its cast to f32 (which rounds nothing), an f32 sub
    from a column vector and its cast to f16, a bf16 add of two tensors: run_lowered runs each op
    with the casts after it as one pass (elementwise.binary_rounded), with the bits of numpy's
    float32 ops and ml_dtypes' casts, and of run; serial and on the worker threads."""
    from mplower.numerics import elementwise

    rng = np.random.default_rng(25)
    vector = (rng.standard_normal(48) * 1e4).astype(np.float32)
    text = _BINARY_CHAIN.replace("VECTOR", str(vector.tolist()))
    program = Program(_fused(text))
    bf = ml_dtypes.bfloat16
    x, z = ((rng.standard_normal((2, 40, 48)) * 1e3).astype(bf).astype(np.float32)
            for _ in range(2))
    x[0, 0, :3] = [np.nan, np.inf, -np.inf]
    z[0, 1, 0] = 3e38
    m = (x * np.float32(np.float32(0.7).astype(bf))).astype(bf).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        h = (vector - m).astype(np.float16)
        p = (x + z).astype(bf).astype(np.float32)
    for serial_below in (elementwise.SERIAL_BELOW, 0):
        monkeypatch.setattr(elementwise, "SERIAL_BELOW", serial_below)
        got_p, got_h = program.run_lowered(program.prepare_inputs([x, z]))
        assert [s.op for s in program._live] == ["mp.fused_binary", "mp.fused_binary", "mp.add"]
        assert got_p.tobytes() == p.tobytes()
        assert got_h.astype(np.float16).tobytes() == h.tobytes()
    ran = Program(parse(text, "m.ir")).run([x, z], reference=False).outputs
    assert got_p.tobytes() == ran[0].tobytes() and got_h.tobytes() == ran[1].tobytes()
    assert np.isinf(got_h).any() and np.isinf(got_p).any() and np.isnan(got_p).any()


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
def test_binary_rounded_is_numpys_op_then_round_to_per_format(op, monkeypatch) -> None:
    """elementwise.binary_rounded against numpy's float32 op and ml_dtypes' casts: operands of
    one shape, a vector along the last axis on either side, a single value; one format and
    two; NaN, infinities, subnormal results; serial and on the worker threads."""
    from mplower.numerics import elementwise
    from mplower.numerics.elementwise import binary_rounded

    fn = {"add": np.add, "sub": np.subtract, "mul": np.multiply}[op]
    rng = np.random.default_rng(26)
    a = (rng.standard_normal((3, 50, 36)) * 10.0 ** rng.integers(-40, 38, (3, 50, 36))
         ).astype(np.float32)
    a.reshape(-1)[:4] = [np.nan, np.inf, -np.inf, -0.0]
    b = (rng.standard_normal((3, 50, 36)) * 10.0 ** rng.integers(-20, 20, (3, 50, 36))
         ).astype(np.float32)
    vector = rng.standard_normal((1, 36)).astype(np.float32)
    scalar = np.array(1.5, np.float32)
    for serial_below in (elementwise.SERIAL_BELOW, 0):
        monkeypatch.setattr(elementwise, "SERIAL_BELOW", serial_below)
        for x, y in ((a, b), (a, vector), (vector, a), (scalar, a), (a, scalar)):
            for formats in (("bf16",), ("f32", "f16"), ("bf16", "f8E4M3FN")):
                with np.errstate(all="ignore"):
                    expect = fn(x, y)
                    for f in formats:
                        expect = expect.astype(ML.get(f, np.float32)).astype(np.float32)
                got = binary_rounded(op, x, y, formats)
                assert got.shape == a.shape and got.tobytes() == expect.tobytes()
    with pytest.raises(ValueError, match="binary_rounded"):
        binary_rounded(op, a, b[:, :, :35], ("bf16",))
    with pytest.raises(ValueError, match="binary_rounded"):
        binary_rounded("div", a, b, ("bf16",))


@pytest.mark.parametrize("elem", ["ui8", "i8"])
@pytest.mark.parametrize("case", ["gemm-f32", "gemm-int8", "gemm-int8-chunked", "depthwise",
                                  "narrow"])
def test_conv_quantize_gives_the_integers_of_numpys_quantize_of_its_result(elem, case) -> None:
    """conv2d(quantize=...) quantizes each tile of the implicit GEMM as it stores it (float
    sums, 8-bit operands with their dequantize epilogue, and K split into exact chunks), else
    after (depthwise, 4 channels): ONNX QuantizeLinear written in numpy (half to even,
    saturation, NaN to the zero point) on the plain result, and its dtype."""
    from mplower.numerics.conv import conv2d

    rng = np.random.default_rng(23)
    s, zp = np.float32(0.25), (3 if elem == "ui8" else -2)
    info = np.iinfo(np.uint8 if elem == "ui8" else np.int8)
    geometry, scale = ((1, 1), (1, 1, 1, 1), (1, 1), 1), None
    if case == "gemm-f32":
        x = (rng.standard_normal((2, 8, 9, 9)) * 20).astype(np.float32)
        x[0, 0, 0, :3] = [np.nan, np.inf, -np.inf]
        w = rng.standard_normal((16, 8, 3, 3)).astype(np.float32)
    elif case in ("gemm-int8", "gemm-int8-chunked"):
        c = 8 if case == "gemm-int8" else 600  # K = 5400: chunks of 514 below 2^24
        x = rng.integers(0, 256, (2, c, 6, 6)).astype(np.uint8)
        w = rng.integers(-128, 128, (16, c, 3, 3)).astype(np.int8)
        scale = np.full(16, 0.01 if case == "gemm-int8" else 0.0002, np.float32)
    elif case == "depthwise":
        x = (rng.standard_normal((2, 8, 9, 9)) * 20).astype(np.float32)
        w = rng.standard_normal((8, 1, 3, 3)).astype(np.float32)
        geometry = ((1, 1), (1, 1, 1, 1), (1, 1), 8)
    else:
        x = (rng.standard_normal((2, 8, 9, 9)) * 20).astype(np.float32)
        w = rng.standard_normal((4, 8, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(w.shape[0]).astype(np.float32)
    plain = conv2d(x, w, *geometry, scale=scale, bias=bias)
    got = conv2d(x, w, *geometry, scale=scale, bias=bias, quantize=(s, zp, elem))
    with np.errstate(invalid="ignore"):
        q = np.rint(plain / s) + np.float32(zp)
        expect = np.where(np.isnan(q), zp, np.clip(q, info.min, info.max)).astype(info.dtype)
    assert got.dtype == info.dtype and got.shape == plain.shape
    assert got.tobytes() == expect.tobytes()
    assert (got == info.min).any() and (got == info.max).any()


_CONV_Q_CONV = """func.func @main(%x: tensor<2x8x7x7xf32>) -> tensor<2x16x7x7xf32> {
  %w = mp.constant {value = dense<0.75> : tensor<16x8x3x3xf32>} : () -> tensor<16x8x3x3xf32>
  %w2 = mp.constant {value = dense<-3> : tensor<16x16x1x1xi8>} : () -> tensor<16x16x1x1xi8>
  %c = mp.conv2d %x, %w {padding = [1, 1, 1, 1]} : (tensor<2x8x7x7xf32>, tensor<16x8x3x3xf32>) -> tensor<2x16x7x7xf32>
  %q = mp.quantize %c {scale = 0.5 : f32, zero_point = 7 : ui8} : (tensor<2x16x7x7xf32>) -> tensor<2x16x7x7xui8>
  %d = mp.conv2d %q, %w2 : (tensor<2x16x7x7xui8>, tensor<16x16x1x1xi8>) -> tensor<2x16x7x7xi32>
  %y = mp.dequantize %d {scale = 0.125 : f32, zero_point = 0 : i32} : (tensor<2x16x7x7xi32>) -> tensor<2x16x7x7xf32>
  return %y : tensor<2x16x7x7xf32>
}
"""


def test_a_quantize_read_only_by_the_next_conv_is_done_by_the_conv_that_computes_it() -> None:
    """A static int8 plan's conv -> quantize -> integer conv: run_lowered has the first conv
    quantize its tiles (no quantize step left), with the bits of the ops run one at a time
    and of numpy's integer conv of numpy's quantize."""
    program = Program(_fused(_CONV_Q_CONV))
    rng = np.random.default_rng(29)
    x = (rng.standard_normal((2, 8, 7, 7)) * 3).astype(np.float32)
    got = program.run_lowered(program.prepare_inputs([x]))[0]
    assert [st.op for st in program._live] == ["mp.fused_conv2d", "mp.fused_conv2d"]
    # The integer conv reads its constant weight's float32 copy, made once.
    from mplower.numerics.conv import IntegerWeights, conv2d

    weight = program._live[1].run.args[1]
    assert isinstance(weight, IntegerWeights) and weight.bound == 3 and weight.float32 is not None
    unfused = Program(parse(_CONV_Q_CONV, "m.ir"))
    assert got.tobytes() == unfused.run([x], reference=False).outputs[0].tobytes()

    c = conv2d(x, np.full((16, 8, 3, 3), 0.75, np.float32), (1, 1), (1, 1, 1, 1), (1, 1), 1)
    q = np.clip(np.rint(c / np.float32(0.5)) + 7, 0, 255).astype(np.int64)
    d = np.einsum("nchw,oc->nohw", q, np.full((16, 16), -3, np.int64))
    assert got.tobytes() == (d.astype(np.int32).astype(np.float32)
                             * np.float32(0.125)).tobytes()


@pytest.mark.parametrize("case", ["fp8 conv", "depthwise qdq", "conv quantize conv"])
def test_fused_convs_are_checked_against_the_fp32_reference_of_the_unfused_ops(case) -> None:
    """`run` of the fused module: the fp32 reference of each fused conv is its ops' (a
    quantize and a dequantize of a float are no-ops there), so the outputs' reference is the
    unfused module's, bit for bit; an integer conv whose weight never was a float has none,
    fused or not, and that is no error."""
    rng = np.random.default_rng(31)
    text, shape = {
        "fp8 conv": (_FP8_CONV, (2, 8, 7, 7)),
        "depthwise qdq": (_DW_QDQ.replace("WEIGHTS", str(
            rng.standard_normal((4, 1, 3, 3)).astype(np.float32).tolist())), (2, 4, 6, 6)),
        "conv quantize conv": (_CONV_Q_CONV, (2, 8, 7, 7))}[case]
    x = rng.standard_normal(shape).astype(np.float32)
    ours, theirs = Program(_fused(text)).run([x]), Program(parse(text, "m.ir")).run([x])
    assert "mp.fused_conv2d" in [r.step.op for r in ours.ops]
    assert ours.outputs[0].tobytes() == theirs.outputs[0].tobytes()
    if case == "conv quantize conv":
        assert ours.reference[0] is None and theirs.reference[0] is None
    else:
        assert ours.reference[0].tobytes() == theirs.reference[0].tobytes()
        assert ours.ops[-1].rel_l2 is not None
