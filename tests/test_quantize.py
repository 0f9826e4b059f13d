"""quantize: integer kernels, zero points, QDQ fallback, weight-only groups, plans, errors.

Expected values are ONNX QuantizeLinear / DequantizeLinear written out in numpy (round half to
even, saturate), the integer matmul in int64 and the scales multiplied as the pass documents;
none of them come from mplower's kernels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mplower.passes.insert_casts import materialize

from mplower.backend.executor import Program, reference_runner
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.opdef import attr_array
from mplower.ir.parser import parse_file
from mplower.ir.printer import print_module
from mplower.lowering.calibration import dense_f32
from mplower.pass_manager import PassContext, PassManager, parse_pipeline

F32 = np.float32


def t(*shape: int, elem: str = "f32") -> str:
    return "tensor<" + "".join(f"{d}x" for d in shape) + f"{elem}>"


def write(tmp_path: Path, body: str, args: str, result: str, weights: dict) -> Path:
    np.savez(tmp_path / "w.npz", **weights)
    path = tmp_path / "m.ir"
    path.write_text(f'module attributes {{mp.weights = "w.npz"}} {{\n'
                    f"  func.func @main({args}) -> {result} {{\n{body}\n  }}\n}}\n")
    return path


def run_passes(path: Path, pipeline: str, data: dict | None = None):
    module = parse_file(path)
    if data is not None:
        np.savez(path.parent / "calib.npz", **data)
        pipeline = pipeline.replace("CALIB", str(path.parent / "calib.npz"))
    ctx = PassContext(runner=reference_runner)
    PassManager(parse_pipeline(pipeline)).run(module, ctx)
    return module, ctx


def ops(module, name: str) -> list[int]:
    f = module.function()
    return [n for n in f.ops() if f.op(n) == name]


def q(x: np.ndarray, s, zp=0, lo=-128, hi=127) -> np.ndarray:
    """ONNX QuantizeLinear: saturate(round_half_even(x / s) + zp), in int64."""
    return np.clip(np.rint(x.astype(F32) / np.asarray(s, F32)) + zp, lo, hi).astype(np.int64)


def mlp(tmp_path: Path, rng, batch: int = 4):
    w1 = rng.standard_normal((16, 8)).astype(F32)
    b1 = rng.standard_normal(8).astype(F32)
    w2 = rng.standard_normal((8, 5)).astype(F32)
    body = f"""    %w1 = mp.constant {{name = "w1"}} : () -> {t(16, 8)}
    %b1 = mp.constant {{name = "b1"}} : () -> {t(8)}
    %w2 = mp.constant {{name = "w2"}} : () -> {t(8, 5)}
    %0 = mp.matmul %x, %w1 : ({t(batch, 16)}, {t(16, 8)}) -> {t(batch, 8)}
    %1 = mp.add %0, %b1 : ({t(batch, 8)}, {t(8)}) -> {t(batch, 8)}
    %2 = mp.relu %1 : ({t(batch, 8)}) -> {t(batch, 8)}
    %3 = mp.matmul %2, %w2 : ({t(batch, 8)}, {t(8, 5)}) -> {t(batch, 5)}
    return %3 : {t(batch, 5)}"""
    path = write(tmp_path, body, f"%x: {t(batch, 16)}", t(batch, 5),
                 {"w1": w1, "b1": b1, "w2": w2})
    return path, (w1, b1, w2)


def test_w8a8_matmul_is_an_i8_kernel_with_one_product_scale_dequantize(tmp_path):
    rng = np.random.default_rng(0)
    path, (w1, b1, w2) = mlp(tmp_path, rng)
    x = rng.standard_normal((4, 16)).astype(F32)
    module, ctx = run_passes(path, "calibrate{data=CALIB},quantize{symmetric=true}", {"x": x})
    f = module.function()
    mm = ops(module, "mp.matmul")
    assert [[t_.elem for t_ in f.operand_types(n)] for n in mm] == [["i8", "i8"]] * 2
    assert [f.types(n)[0].elem for n in mm] == ["i32", "i32"]
    assert ctx.stats["ops-quantized"] == 2 and ctx.stats["weights-quantized"] == 2

    # The same computation written out: per-tensor activation, per-column weight scales.
    sx = F32(np.abs(x).max() / 127)
    sw = (np.abs(w1).max(axis=0) / 127).astype(F32)
    acc = q(x, sx) @ q(w1, sw)
    (dq,) = [u for u, _ in f.uses((mm[0], 0))]
    assert np.array_equal(attr_array(f.attrs_of(dq)["scale"]).astype(F32), sx * sw)
    h = np.maximum(acc.astype(F32) * (sx * sw) + b1, 0)
    sh = F32(np.maximum(x @ w1 + b1, 0).max() / 127)  # calibrated on the fp32 reference
    sw2 = (np.abs(w2).max(axis=0) / 127).astype(F32)
    expect = (q(h, sh) @ q(w2, sw2)).astype(F32) * (sh * sw2)

    result = Program(module).run([x])
    np.testing.assert_allclose(result.outputs[0], expect, rtol=1e-6, atol=1e-6)
    mm_steps = [r.step for r in result.ops if r.step.op == "mp.matmul"]
    assert all(s.reason is None and s.executed["precision"] == "i8" for s in mm_steps)
    # The fp32 reference is still the float model.
    np.testing.assert_allclose(result.reference[0], np.maximum(x @ w1 + b1, 0) @ w2, rtol=1e-5)


def test_quantize_honours_the_int8_plan_and_clears_not_quantized(tmp_path):
    rng = np.random.default_rng(1)
    ws = {f"w{i}": rng.standard_normal((8, 8)).astype(F32) for i in range(3)}
    body = "\n".join([f'    %w{i} = mp.constant {{name = "w{i}"}} : () -> {t(8, 8)}'
                      for i in range(3)] + [
        f"    %m0 = mp.matmul %x, %w0 : ({t(2, 8)}, {t(8, 8)}) -> {t(2, 8)}",
        f"    %m1 = mp.matmul %m0, %w1 : ({t(2, 8)}, {t(8, 8)}) -> {t(2, 8)}",
        f"    %m2 = mp.matmul %m1, %w2 : ({t(2, 8)}, {t(8, 8)}) -> {t(2, 8)}",
        f"    return %m2 : {t(2, 8)}"])
    path = write(tmp_path, body, f"%x: {t(2, 8)}", t(2, 8), ws)
    planned, _ = run_passes(path, "assign-precision{policy=int8}")
    before = {s.name: s.reason for s in Program(planned).steps if s.op == "mp.matmul"}
    assert before == {"%m0": None, "%m1": "not-quantized", "%m2": None}  # keep-first-last

    x = rng.standard_normal((2, 8)).astype(F32)
    module, ctx = run_passes(path, "assign-precision{policy=int8},calibrate{data=CALIB},"
                                   "quantize", {"x": x})
    f = module.function()
    elems = {f.value_name((n, 0)): f.operand_types(n)[0].elem for n in ops(module, "mp.matmul")}
    assert elems == {"%m0": "f32", "%m1": "i8", "%m2": "f32"}
    assert ctx.stats["ops-quantized"] == 1
    steps = {s.name: s for s in Program(module).steps if s.op == "mp.matmul"}
    assert steps["%m1"].reason is None and steps["%m1"].executed["precision"] == "i8"


def test_asymmetric_one_sided_activations_take_ui8_with_zero_point_0(tmp_path):
    rng = np.random.default_rng(2)
    path, (w1, b1, w2) = mlp(tmp_path, rng)
    x = rng.uniform(0, 16, (4, 16)).astype(F32)  # pixels: one-sided
    module, _ = run_passes(path, "calibrate{data=CALIB},quantize{symmetric=false}", {"x": x})
    f = module.function()
    elems = {f.value_name(f.operands(n)[0]): f.types(n)[0].elem
             for n in ops(module, "mp.quantize")}
    assert elems == {"%x": "ui8", "%w1": "i8", "%2": "ui8", "%w2": "i8"}
    assert all("zero_point" not in f.attrs_of(n) for n in ops(module, "mp.quantize"))
    # ORT's int8 grid with zero point -128 is ui8 with zero point 0 and scale max / 255.
    sx = F32(x.max() / 255)
    sw = (np.abs(w1).max(axis=0) / 127).astype(F32)
    h = np.maximum((q(x, sx, lo=0, hi=255) @ q(w1, sw)).astype(F32) * (sx * sw) + b1, 0)
    sh = F32(np.maximum(x @ w1 + b1, 0).max() / 255)
    sw2 = (np.abs(w2).max(axis=0) / 127).astype(F32)
    expect = (q(h, sh, lo=0, hi=255) @ q(w2, sw2)).astype(F32) * (sh * sw2)
    np.testing.assert_allclose(Program(module).run([x]).outputs[0], expect, rtol=1e-5,
                               atol=1e-5)


def test_two_sided_asymmetric_activation_is_shifted_into_an_integer_kernel(tmp_path):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 8)).astype(F32)
    body = f"""    %w = mp.constant {{name = "w"}} : () -> {t(16, 8)}
    %0 = mp.matmul %x, %w : ({t(4, 16)}, {t(16, 8)}) -> {t(4, 8)}
    return %0 : {t(4, 8)}"""
    path = write(tmp_path, body, f"%x: {t(4, 16)}", t(4, 8), {"w": w})
    x = rng.uniform(-1, 7, (4, 16)).astype(F32)
    module, ctx = run_passes(path, "calibrate{data=CALIB},quantize{symmetric=false}", {"x": x})
    f = module.function()
    (mm,) = ops(module, "mp.matmul")
    assert [t_.elem for t_ in f.operand_types(mm)] == ["i8", "i8"]
    assert ctx.stats["activations-shifted"] == 1
    (zp_add,) = [n for n in ops(module, "mp.add") if f.attrs_of(n).get("mp.quant") == "zero-point"]
    assert zp_add is not None

    # ORT's asymmetric int8: scale (hi - lo) / 255, zero point round(-128 - lo / scale).
    s = F32((float(x.max()) - float(x.min())) / 255)
    z = int(np.rint(-128 - float(x.min()) / s))
    sw = (np.abs(w).max(axis=0) / 127).astype(F32)
    expect = ((q(x, s, z) - z) @ q(w, sw)).astype(F32) * (s * sw)
    result = Program(module).run([x])
    np.testing.assert_allclose(result.outputs[0], expect, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.reference[0], x @ w, rtol=1e-5, atol=1e-5)


def conv_model(tmp_path: Path, rng):
    w = rng.standard_normal((3, 2, 3, 3)).astype(F32)
    b = rng.standard_normal(3).astype(F32)
    body = f"""    %w = mp.constant {{name = "w"}} : () -> {t(3, 2, 3, 3)}
    %b = mp.constant {{name = "b"}} : () -> {t(3)}
    %0 = mp.conv2d %x, %w, %b {{padding = [1, 1, 1, 1]}} : ({t(1, 2, 6, 6)}, {t(3, 2, 3, 3)}, {t(3)}) -> {t(1, 3, 6, 6)}
    return %0 : {t(1, 3, 6, 6)}"""
    return write(tmp_path, body, f"%x: {t(1, 2, 6, 6)}", t(1, 3, 6, 6), {"w": w, "b": b}), w, b


def conv_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((1, w.shape[0], 6, 6), np.float64)
    for i in range(3):
        for j in range(3):
            out += np.einsum("nchw,oc->nohw", xp[:, :, i:i + 6, j:j + 6], w[:, :, i, j])
    return out


def test_conv_w8a8_runs_integer_with_per_output_channel_scales_and_the_bias_after(tmp_path):
    rng = np.random.default_rng(4)
    path, w, b = conv_model(tmp_path, rng)
    x = rng.standard_normal((1, 2, 6, 6)).astype(F32)
    module, _ = run_passes(path, "calibrate{data=CALIB},quantize{symmetric=true}", {"x": x})
    f = module.function()
    (conv,) = ops(module, "mp.conv2d")
    assert len(f.operands(conv)) == 2 and f.types(conv)[0].elem == "i32"
    (dq,) = [u for u, _ in f.uses((conv, 0))]
    assert f.op(dq) == "mp.dequantize" and f.attrs_of(dq)["axis"] == 1
    sx = F32(np.abs(x).max() / 127)
    sw = (np.abs(w).reshape(3, -1).max(axis=1) / 127).astype(F32)
    acc = conv_ref(q(x, sx).astype(np.float64), q(w, sw[:, None, None, None]).astype(np.float64))
    expect = acc.astype(F32) * (sx * sw)[None, :, None, None] + b[None, :, None, None]
    result = Program(module).run([x])
    np.testing.assert_allclose(result.outputs[0], expect, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.reference[0], conv_ref(x, w) + b[None, :, None, None],
                               rtol=1e-4, atol=1e-5)


def test_conv_with_a_zero_point_is_written_in_qdq_form_and_says_so(tmp_path):
    rng = np.random.default_rng(5)
    path, _w, _b = conv_model(tmp_path, rng)
    x = rng.uniform(-1, 5, (1, 2, 6, 6)).astype(F32)
    module, ctx = run_passes(path, "calibrate{data=CALIB},quantize{symmetric=false}", {"x": x})
    f = module.function()
    (conv,) = ops(module, "mp.conv2d")
    assert [f.op(u) for u, _ in f.operands(conv)[:2]] == ["mp.dequantize", "mp.dequantize"]
    assert f.attrs_of(conv)["mp.precision"].type == "f32"
    assert "QDQ form" in f.attrs_of(conv)["mp.reason"] and ctx.stats["ops-qdq"] == 1
    (qx,) = [n for n in ops(module, "mp.quantize") if f.operands(n)[0] == (f.args[0], 0)]
    assert f.attrs_of(qx)["zero_point"] != 0
    result = Program(module).run([x])
    # The report says that the conv asked for i8 runs in f32 on the int8 grid, and why.
    reasons = {r.step.name: (r.step.requested["precision"], r.step.executed["precision"],
                             r.step.reason) for r in result.ops if r.step.reason is not None}
    assert reasons == {f.value_name((conv, 0)): ("i8", "f32", "qdq-zero-point")}
    assert result.ops[-1].sqnr_db > 30


def test_weight_only_w4a16_quantizes_in_groups_along_the_reduction_axis(tmp_path):
    rng = np.random.default_rng(6)
    w = rng.standard_normal((256, 4)).astype(F32)
    w[:128] *= 10  # the groups see very different magnitudes
    body = f"""    %w = mp.constant {{name = "w"}} : () -> {t(256, 4)}
    %0 = mp.matmul %x, %w : ({t(2, 256)}, {t(256, 4)}) -> {t(2, 4)}
    return %0 : {t(2, 4)}"""
    path = write(tmp_path, body, f"%x: {t(2, 256)}", t(2, 4), {"w": w})
    module, _ctx = run_passes(path, "quantize{scheme=w4a16 group=128}")
    f = module.function()
    (mm,) = ops(module, "mp.matmul")
    assert f.attrs_of(mm)["mp.weight_quant"] == "i4 group 128"
    (quant,) = ops(module, "mp.quantize")
    assert f.types(quant)[0].elem == "i4"
    groups = w.reshape(2, 128, 4)
    s = (np.abs(groups).max(axis=1, keepdims=True) / 7).astype(F32)  # one per group and column
    expect = (q(groups, s, lo=-8, hi=7).astype(F32) * s).reshape(256, 4)
    x = rng.standard_normal((2, 256)).astype(F32)
    result = Program(module).run([x])
    np.testing.assert_allclose(result.outputs[0], x @ expect, rtol=1e-5, atol=1e-4)
    # Per channel (group=0) loses more on the small half: the groups are what helps.
    per_channel, _ = run_passes(path, "quantize{scheme=w4a16 group=0}")
    x[:, :128] = 0
    err = lambda m: float(np.abs(Program(m).run([x]).outputs[0] - x @ w).max())
    assert err(module) < err(per_channel)


def test_weight_only_with_the_w8a16_plan_computes_in_bf16(tmp_path):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((64, 8)).astype(F32)
    body = f"""    %w = mp.constant {{name = "w"}} : () -> {t(64, 8)}
    %0 = mp.matmul %x, %w : ({t(2, 64)}, {t(64, 8)}) -> {t(2, 8)}
    return %0 : {t(2, 8)}"""
    path = write(tmp_path, body, f"%x: {t(2, 64)}", t(2, 8), {"w": w})
    module, ctx = run_passes(path, "assign-precision{policy=w8a16},quantize{scheme=w8a16 "
                                   "group=32}")
    assert ctx.stats["ops-quantized"] == 1
    x = rng.standard_normal((2, 64)).astype(F32)
    materialize(module)  # the bf16 activations: the plan's casts, as `mplower run` adds them
    result = Program(module).run([x])
    (mm,) = [r.step for r in result.ops if r.step.op == "mp.matmul"]
    assert mm.executed["precision"] == "bf16" and mm.reason is None
    assert result.ops[-1].sqnr_db > 30


def test_groups_that_do_not_divide_fall_back_to_per_channel(tmp_path):
    rng = np.random.default_rng(8)
    body = f"""    %w = mp.constant {{name = "w"}} : () -> {t(96, 4)}
    %0 = mp.matmul %x, %w : ({t(2, 96)}, {t(96, 4)}) -> {t(2, 4)}
    return %0 : {t(2, 4)}"""
    path = write(tmp_path, body, f"%x: {t(2, 96)}", t(2, 4),
                 {"w": rng.standard_normal((96, 4)).astype(F32)})
    module, ctx = run_passes(path, "quantize{scheme=w8a16 group=64}")
    assert ctx.stats["groups-not-dividing"] == 1
    f = module.function()
    assert f.attrs_of(ops(module, "mp.matmul")[0])["mp.weight_quant"] == "i8 per-channel"


def test_per_tensor_weights_take_one_scale(tmp_path):
    rng = np.random.default_rng(9)
    path, _ = mlp(tmp_path, rng)
    x = rng.standard_normal((4, 16)).astype(F32)
    module, _ = run_passes(path, "calibrate{data=CALIB},quantize{weights=per-tensor}", {"x": x})
    f = module.function()
    for n in ops(module, "mp.quantize"):
        assert isinstance(f.attrs_of(n)["scale"], float)


def test_quantize_without_ranges_names_every_op_and_changes_nothing(tmp_path):
    rng = np.random.default_rng(10)
    path, _ = mlp(tmp_path, rng)
    module = parse_file(path)
    before = print_module(module)
    with pytest.raises(DiagnosticError) as e:
        PassManager(parse_pipeline("quantize")).run(module, PassContext(runner=reference_runner))
    messages = [d.message for d in e.value.diagnostics]
    assert len(messages) == 2 and "operand #0 %x has no calibrated range" in messages[0]
    assert "run calibrate{data=...} first" in messages[0]
    assert print_module(module) == before


def test_given_ranges_need_no_calibration_and_quantize_twice_is_quantize_once(tmp_path):
    w = np.arange(12, dtype=F32).reshape(4, 3) - 5
    body = f"""    %w = mp.constant {{name = "w"}} : () -> {t(4, 3)}
    %0 = mp.matmul %x, %w : ({t(2, 4)}, {t(4, 3)}) -> {t(2, 3)}
    return %0 : {t(2, 3)}"""
    path = write(tmp_path, body, f"%x: {t(2, 4)}", t(2, 3), {"w": w})
    text = path.read_text().replace("-> tensor<2x3xf32> {",
                                    "-> tensor<2x3xf32> attributes "
                                    "{arg_attrs = [{mp.range = [-2.0, 2.0]}]} {")
    path.write_text(text)
    once, _ = run_passes(path, "quantize{symmetric=true}")
    twice, _ctx = run_passes(path, "quantize{symmetric=true},quantize{symmetric=true}")
    assert print_module(once) == print_module(twice)
    f = once.function()
    (qx,) = [n for n in ops(once, "mp.quantize") if f.operands(n)[0] == (f.args[0], 0)]
    assert f.attrs_of(qx)["scale"] == float(F32(2.0 / 127))


@pytest.mark.parametrize("options, message", [
    ("scheme=w2a2", "unknown scheme 'w2a2'"),
    ("weights=per-row", "weights must be per-channel or per-tensor"),
    ("activations=per-token", "activations must be per-tensor"),
])
def test_quantize_rejects_unknown_options(tmp_path, options, message):
    path, _ = mlp(tmp_path, np.random.default_rng(11))
    with pytest.raises(DiagnosticError, match=message):
        run_passes(path, f"quantize{{{options}}}")


def test_dense_f32_keeps_scalars_zero_dimensional():
    assert dense_f32(np.float32(2.5)).array.shape == ()
