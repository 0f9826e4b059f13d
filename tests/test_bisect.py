"""Per-op quantization SQNR and bisect: which ops to return to f32, and that return is exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mplower.backend.executor import Program, reference_runner
from mplower.ir.parser import parse_file
from mplower.ir.printer import print_module
from mplower.ir.verifier import verify
from mplower.pass_manager import PassContext, PassManager, parse_pipeline
from mplower.report.bisect import bisect, evaluate, keep_f32, rank
from mplower.report.quant import converted_ops, operand_sqnr

F32 = np.float32


def t(*shape: int) -> str:
    return "tensor<" + "".join(f"{d}x" for d in shape) + "f32>"


def three_layers(tmp_path: Path, outlier_column: bool = True) -> Path:
    rng = np.random.default_rng(0)
    ws = {f"w{i}": rng.standard_normal((16, 16)).astype(F32) for i in range(3)}
    if outlier_column:
        ws["w1"][:, 5] *= 1000  # per-tensor weight scales then wipe out w1's other columns
    body = "\n".join(
        [f'    %w{i} = mp.constant {{name = "w{i}"}} : () -> {t(16, 16)}' for i in range(3)] + [
            f"    %m0 = mp.matmul %x, %w0 : ({t(8, 16)}, {t(16, 16)}) -> {t(8, 16)}",
            f"    %h0 = mp.relu %m0 : ({t(8, 16)}) -> {t(8, 16)}",
            f"    %m1 = mp.matmul %h0, %w1 : ({t(8, 16)}, {t(16, 16)}) -> {t(8, 16)}",
            f"    %h1 = mp.tanh %m1 : ({t(8, 16)}) -> {t(8, 16)}",
            f"    %m2 = mp.matmul %h1, %w2 : ({t(8, 16)}, {t(16, 16)}) -> {t(8, 16)}",
            f"    return %m2 : {t(8, 16)}"])
    np.savez(tmp_path / "w.npz", **ws)
    path = tmp_path / "m.ir"
    path.write_text(f'module attributes {{mp.weights = "w.npz"}} {{\n'
                    f"  func.func @main(%x: {t(8, 16)}) -> {t(8, 16)} {{\n{body}\n  }}\n}}\n")
    return path


def lowered(path: Path, pipeline: str, x: np.ndarray):
    np.savez(path.parent / "calib.npz", x=x)
    module = parse_file(path)
    PassManager(parse_pipeline(pipeline.replace("CALIB", str(path.parent / "calib.npz")))).run(
        module, PassContext(runner=reference_runner))
    return module


X = np.random.default_rng(1).standard_normal((8, 16)).astype(F32)


@pytest.mark.parametrize("pipeline", [
    "calibrate{data=CALIB},quantize",
    "calibrate{data=CALIB},quantize{symmetric=false weights=per-tensor}",
    "quantize{scheme=w4a16 group=8}",
    "assign-precision{policy=bf16},insert-casts",
    "calibrate{data=CALIB},smooth-quant,calibrate{data=CALIB},quantize",
])
def test_keep_f32_of_every_converted_op_gives_back_the_fp32_model(tmp_path, pipeline):
    path = three_layers(tmp_path)
    x = X - 0.3  # two-sided inputs: the asymmetric case shifts them
    module = lowered(path, pipeline, x)
    names = [module.function().value_name((n, 0)) for n in converted_ops(module.function())]
    assert names
    restored = keep_f32(module, names)
    verify(restored)
    expect = Program(parse_file(path)).run([x], reference=False).outputs[0]
    got = Program(restored).run([x], reference=False).outputs[0]
    np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-6)
    assert converted_ops(restored.function()) == []


def test_keep_f32_of_a_quantized_conv_with_bias_is_exact(tmp_path):
    rng = np.random.default_rng(2)
    np.savez(tmp_path / "w.npz", w=rng.standard_normal((3, 2, 3, 3)).astype(F32),
             b=rng.standard_normal(3).astype(F32))
    (tmp_path / "m.ir").write_text(f"""module attributes {{mp.weights = "w.npz"}} {{
  func.func @main(%x: {t(1, 2, 5, 5)}) -> {t(1, 3, 5, 5)} {{
    %w = mp.constant {{name = "w"}} : () -> {t(3, 2, 3, 3)}
    %b = mp.constant {{name = "b"}} : () -> {t(3)}
    %c = mp.conv2d %x, %w, %b {{padding = [1, 1, 1, 1]}} : ({t(1, 2, 5, 5)}, {t(3, 2, 3, 3)}, {t(3)}) -> {t(1, 3, 5, 5)}
    return %c : {t(1, 3, 5, 5)}
  }}
}}
""")
    x = rng.standard_normal((1, 2, 5, 5)).astype(F32)
    module = lowered(tmp_path / "m.ir", "calibrate{data=CALIB},quantize", x)
    (conv,) = converted_ops(module.function())
    restored = keep_f32(module, [module.function().value_name((conv, 0))])
    expect = Program(parse_file(tmp_path / "m.ir")).run([x], reference=False).outputs[0]
    np.testing.assert_array_equal(Program(restored).run([x], reference=False).outputs[0], expect)


def test_operand_sqnr_separates_weights_from_activations_worst_first(tmp_path):
    module = lowered(three_layers(tmp_path),
                     "calibrate{data=CALIB},quantize{weights=per-tensor symmetric=true}", X)
    rows = operand_sqnr(Program(module), [X])
    assert rows[0]["name"] == "%m1"  # one huge column: the shared scale wipes out the rest
    by_name = {r["name"]: r for r in rows}
    assert by_name["%m1"]["local_sqnr_db"] < 10 and by_name["%m0"]["local_sqnr_db"] > 30
    # Tensor-wide, the weight looks fine: its energy is all in the column that survives.
    assert by_name["%m1"]["weight_sqnr_db"] > 30
    assert all(r["activation_sqnr_db"] is not None for r in rows)
    # %m2 inherits the damage (its input is far from fp32) but adds little of its own.
    assert by_name["%m2"]["activation_sqnr_db"] < 10
    assert by_name["%m2"]["local_sqnr_db"] > by_name["%m1"]["local_sqnr_db"] + 10
    # The first layer's input is the argument: its own conversion is all the error there is.
    assert by_name["%m0"]["activation_sqnr_db"] == by_name["%m0"]["activation_local_sqnr_db"]
    assert rank(module, [X])[0][0] == "%m1"


def test_bisect_names_the_one_layer_that_breaks_the_guardrail(tmp_path):
    module = lowered(three_layers(tmp_path), "calibrate{data=CALIB},quantize{weights=per-tensor}",
                     X)
    base = evaluate(module, [X], {})["sqnr_db"]
    fixed = evaluate(keep_f32(module, ["%m1"]), [X], {})["sqnr_db"]
    assert fixed > base + 10
    limit = {"min_sqnr_db": (base + fixed) / 2}
    before = print_module(module)
    result = bisect(module, [X], limit)
    assert print_module(module) == before  # bisect works on copies; its runs change nothing
    assert result.ops == ["%m1"] and result.met
    assert result.baseline["verdict"] == "fail" and result.final["verdict"] == "pass"
    assert result.runs <= 1 + 1 + 2 + 1  # baseline, all, the binary search, nothing to prune
    for other in ("%m0", "%m2"):  # no other single op would do
        assert evaluate(keep_f32(module, [other]), [X], limit)["verdict"] == "fail"


def test_bisect_returns_nothing_when_the_plan_already_passes_and_all_when_nothing_does(tmp_path):
    module = lowered(three_layers(tmp_path, outlier_column=False),
                     "calibrate{data=CALIB},quantize", X)
    assert bisect(module, [X], {"min_sqnr_db": 10.0}).ops == []
    hopeless = bisect(module, [X], {"max_overflow": -1})  # no run can have negative overflow
    assert not hopeless.met and sorted(hopeless.ops) == ["%m0", "%m1", "%m2"]
    with pytest.raises(ValueError, match="needs guardrails"):
        bisect(module, [X], {})
    with pytest.raises(KeyError, match="no op named %nope"):
        keep_f32(module, ["%nope"])
