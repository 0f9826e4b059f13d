"""What a run report may claim: overflow guardrails, top-1 agreement, plans that ran as asked,
defaults, overrides that match through `mplower opt`, and readable verdict lines (issue 10)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import mplower
from mplower.report.run import evaluate_guardrails, render

EXAMPLES = Path(__file__).resolve().parent.parent / "ir_examples"
F32 = np.float32


def run_json(cli, ir: Path, *args: object) -> tuple[int, dict]:
    res = cli("run", ir, "--format", "json", *args)
    assert res.rc in (0, 3), res.err
    return res.rc, json.loads(res.out)


# ---- overflow guardrails on the built-in sheets --------------------------------------------


def light_model(name: str) -> Path:
    onnx = pytest.importorskip("onnx")
    path = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"light_{name}.onnx"
    if not path.is_file():
        pytest.skip(f"the onnx wheel has no light_{name}.onnx")
    return path


def unscaled_fp8_sheet(tmp_path: Path) -> Path:
    """The built-in fp8 sheet without its [scaling] table: fp8 as a plain saturating cast."""
    text = (Path(mplower.__file__).parent / "policies" / "fp8.toml").read_text()
    head, _, rest = text.partition("[scaling]")
    sheet = tmp_path / "fp8_unscaled.toml"
    sheet.write_text(head + rest[rest.index("[guardrails]"):])
    return sheet


def logits_sqnr(report: dict) -> float:
    """SQNR of the final softmax's input (its output is flat for the shipped weights)."""
    ops = [o for o in report["ops"] if o["op"] != "mp.constant"]
    assert ops[-1]["op"] == "mp.softmax"
    return ops[-2]["sqnr_db"]


def test_fp8_sheet_scales_a_light_resnet50_that_the_plain_cast_saturates(cli, tmp_path):
    ir = tmp_path / "r50.ir"
    assert cli("import", light_model("resnet50"), "-o", ir).rc == 0
    reports = {}
    for name, sheet in (("plain", unscaled_fp8_sheet(tmp_path)), ("scaled", "fp8")):
        low = tmp_path / f"r50_{name}.ir"
        assert cli("opt", ir, f"--pass-pipeline=assign-precision{{policy={sheet}}},"
                   "insert-casts", "-o", low).rc == 0
        reports[name] = run_json(cli, low, "--check")
    rc, plain = reports["plain"]
    # The plain cast: within the rel_l2 limit, only the overflow guardrail sees the 2.6M
    # saturated values (activations up to 1e10; issue 14).
    assert plain["summary"]["guardrails"]["max_rel_l2"]["ok"] is True
    assert plain["summary"]["overflow"] == 2641664 and rc == 3
    rc, scaled = reports["scaled"]
    assert scaled["summary"]["overflow"] == 0 and scaled["summary"]["verdict"] == "pass"
    assert rc == 0
    assert logits_sqnr(scaled) >= logits_sqnr(plain) + 20


BIG = """module attributes {mp.weights = "w.npz"} {
  func.func @main(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %w = mp.constant {name = "w"} : () -> tensor<8x8xf32>
    %h = mp.matmul %x, %w : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    return %h : tensor<4x8xf32>
  }
}
"""


@pytest.mark.parametrize("scale, overflowed", [(1.0, 0), (1e4, None)])
def test_fp16_sheet_fails_where_activations_exceed_f16_and_passes_a_healthy_model(
        cli, tmp_path, scale, overflowed):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 8)).astype(F32)
    x = (np.abs(rng.standard_normal((4, 8))) * scale).astype(F32)
    (tmp_path / "m.ir").write_text(BIG)
    np.savez(tmp_path / "w.npz", w=np.abs(w))
    np.savez(tmp_path / "x.npz", x=x)
    low = tmp_path / "low.ir"
    assert cli("opt", tmp_path / "m.ir", "--pass-pipeline=assign-precision{policy=fp16},"
               "insert-casts", "-o", low).rc == 0
    rc, report = run_json(cli, low, "--inputs", tmp_path / "x.npz", "--check")
    g = report["summary"]["guardrails"]["max_overflow"]
    # Independent count: products of f16-exact inputs summed in f32, then rounded to f16.
    y = x.astype(np.float16).astype(F32) @ np.abs(w).astype(np.float16).astype(F32)
    expected = int(np.sum(np.abs(y) > np.finfo(np.float16).max))
    assert (expected == 0) == (overflowed == 0)
    assert g == {"limit": 0, "value": expected, "ok": expected == 0}
    assert rc == (0 if expected == 0 else 3)


@pytest.mark.parametrize("model, sheet", [("cnn", "fp8"), ("transformer", "fp8"),
                                          ("transformer", "bf16"), ("cnn", "fp16")])
def test_bundled_examples_keep_passing_their_sheets_with_the_overflow_guardrail(
        cli, tmp_path, model, sheet):
    low = tmp_path / f"{model}.ir"
    assert cli("opt", EXAMPLES / f"{model}.ir",
               f"--pass-pipeline=assign-precision{{policy={sheet}}},insert-casts",
               "-o", low).rc == 0
    rc, report = run_json(cli, low, "--weights", EXAMPLES / f"{model}.npz", "--inputs",
                          EXAMPLES / f"{model}_inputs.npz", "--check")
    s = report["summary"]
    assert s["guardrails"]["max_overflow"] == {"limit": 0, "value": 0, "ok": True}
    assert s["verdict"] == "pass" and rc == 0


def test_int8_sheet_limits_the_rate_of_clamped_values_not_their_count() -> None:
    summary = {"output_rel_l2": 0.01, "sqnr_db": 40.0, "overflow": 7, "overflow_rate": 7 / 10000,
               "top1_agreement": 1.0}
    g = evaluate_guardrails({"max_overflow_rate": 0.001}, summary)
    assert g == {"max_overflow_rate": {"limit": 0.001, "value": 0.0007, "ok": True}}
    summary["overflow_rate"] = 11 / 10000
    assert evaluate_guardrails({"max_overflow_rate": 0.001}, summary)[
        "max_overflow_rate"]["ok"] is False


def test_int8_sheet_fails_inputs_far_outside_the_calibrated_ranges(cli, tmp_path) -> None:
    low = tmp_path / "cnn_int8.ir"
    pipeline = (f"assign-precision{{policy=int8}},calibrate{{data={EXAMPLES}/cnn_inputs.npz}},"
                f"quantize,insert-casts")
    assert cli("opt", EXAMPLES / "cnn.ir", f"--pass-pipeline={pipeline}", "-o", low).rc == 0
    with np.load(EXAMPLES / "cnn_inputs.npz") as data:
        np.savez(tmp_path / "x.npz", **{k: v * 4 for k, v in data.items()})
    rc, report = run_json(cli, low, "--weights", EXAMPLES / "cnn.npz", "--inputs",
                          tmp_path / "x.npz", "--check")
    s = report["summary"]
    written = sum(int(np.prod([int(d) for d in re.findall(r"(\d+)x", o["type"])]))
                  for o in report["ops"])
    assert s["overflow"] > 0 and s["overflow_rate"] == s["overflow"] / written
    assert s["guardrails"]["max_overflow_rate"] == {
        "limit": 0.001, "value": s["overflow_rate"], "ok": s["overflow_rate"] <= 0.001}
    assert s["overflow_rate"] > 0.001 and s["verdict"] == "fail" and rc == 3


# ---- top-1 agreement ----------------------------------------------------------------------


def top1_agreement(y: np.ndarray, ref: np.ndarray) -> float | None:
    from mplower.report.run import top1_agreement as top1  # new in issue 10

    return top1(y, ref)


def test_top1_of_nchw_output_is_argmax_over_axis_1() -> None:
    ref = np.zeros((2, 3, 1, 2), F32)  # 2 images x 2 pixels, 3 classes each: 4 samples
    ref[0, 2, 0, 0] = ref[0, 1, 0, 1] = ref[1, 0, 0, 0] = ref[1, 2, 0, 1] = 1.0
    y = ref.copy()
    y[1, 0, 0, 0], y[1, 1, 0, 0] = 0.2, 0.9  # sample (1, pixel 0) now picks class 1
    assert top1_agreement(y, ref) == 0.75
    # The last axis (2 pixels) is not the class axis: that would give another figure.
    assert float(np.mean(y.argmax(-1) == ref.argmax(-1))) != 0.75


def test_top1_of_a_single_sample_and_of_rows() -> None:
    assert top1_agreement(np.array([0.1, 0.7, 0.2], F32), np.array([0.0, 1.0, 0.0], F32)) == 1.0
    assert top1_agreement(np.array([0.8, 0.7, 0.2], F32), np.array([0.0, 1.0, 0.0], F32)) == 0.0
    assert top1_agreement(np.ones((3, 1), F32), np.ones((3, 1), F32)) is None
    assert top1_agreement(np.ones((3, 4), np.int32), np.ones((3, 4), np.int32)) is None


def test_a_nan_sample_never_agrees() -> None:
    ref = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]], F32)
    y = ref.copy()
    y[0] = np.nan  # all NaN: numpy's argmax would pick 0, which is the reference's class
    y[1, 2] = np.nan
    assert top1_agreement(y, ref) == 0.5
    assert top1_agreement(np.full((4, 3), np.nan, np.float16), ref) == 0.0


def test_ties_in_the_reference_agree_with_any_of_the_tied_classes() -> None:
    ref = np.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.5, 0.5, 0.0]], F32)
    y = np.array([[0.9, 0.1, 0.0], [0.1, 0.9, 0.0], [0.1, 0.2, 0.9]], F32)
    assert top1_agreement(y, ref) == pytest.approx(2 / 3)


# ---- the plan that was asked for is the one that ran ----------------------------------------


def test_int8_sheet_on_two_matmuls_quantizes_nothing_and_checks_its_guardrails(cli, tmp_path):
    low = tmp_path / "mlp_int8.ir"
    pipeline = (f"assign-precision{{policy=int8}},calibrate{{data={EXAMPLES}/mlp_inputs.npz}},"
                f"quantize,insert-casts")
    assert cli("opt", EXAMPLES / "mlp.ir", f"--pass-pipeline={pipeline}", "-o", low).rc == 0
    text = low.read_text()
    assert "mp.quantize" not in text and 'mp.policy = "int8"' in text
    assert text.count('mp.reason = "keep-first-last"') == 2
    rc, report = run_json(cli, low, "--weights", EXAMPLES / "mlp.npz", "--inputs",
                          EXAMPLES / "mlp_inputs.npz", "--check")
    s = report["summary"]
    assert set(s["guardrails"]) == {"max_rel_l2", "min_top1_agreement", "max_overflow_rate"}
    assert s["output_rel_l2"] == 0.0 and s["verdict"] == "pass" and rc == 0
    for o in report["ops"]:
        assert o["requested"]["precision"] == o["executed"]["precision"] == "f32", o


def test_check_without_guardrails_is_a_usage_error_not_a_pass(cli, tmp_path) -> None:
    res = cli("run", EXAMPLES / "mlp.ir", "--inputs", EXAMPLES / "mlp_inputs.npz", "--check")
    assert res.rc == 2 and "--check needs guardrails" in res.err and res.out == ""
    res = cli("run", EXAMPLES / "mlp.ir", "--inputs", EXAMPLES / "mlp_inputs.npz")
    assert res.rc == 0 and res.out.startswith("verdict: unchecked (no guardrails)\n")


# ---- defaults ------------------------------------------------------------------------------


def test_quantize_defaults_to_asymmetric_activations_on_orts_grid(cli, tmp_path) -> None:
    rng = np.random.default_rng(3)
    (tmp_path / "m.ir").write_text(BIG)
    np.savez(tmp_path / "w.npz", w=rng.standard_normal((8, 8)).astype(F32))
    x = rng.uniform(-1.0, 3.0, (4, 8)).astype(F32)
    np.savez(tmp_path / "x.npz", x=x)
    outs = []
    for options in ("", "{symmetric=false}"):
        out = tmp_path / f"q{len(outs)}.ir"
        res = cli("opt", tmp_path / "m.ir", "--statistics", "--pass-pipeline",
                  f"calibrate{{data={tmp_path / 'x.npz'}}},quantize{options}", "-o", out)
        assert res.rc == 0, res.err
        outs.append(out.read_text())
    assert outs[0] == outs[1]
    # ORT's asymmetric int8: scale (hi - lo) / 255, shifted by c = -zero_point * scale.
    lo, hi = float(x.min()), float(x.max())
    scale = F32((hi - lo) / 255)
    zp = int(np.clip(np.rint(-128 - lo / float(scale)), -128, 127))
    assert f"{float(scale)!r}" in outs[0] or f"{scale}" in outs[0]
    assert "_shift" in outs[0] and zp != 0


# ---- overrides through `mplower opt` --------------------------------------------------------

NAMED = """module attributes {mp.weights = "w.npz"} {
  func.func @main(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %w = mp.constant {name = "w"} : () -> tensor<8x8xf32>
    %fc1 = mp.matmul %x, %w : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %fc2 = mp.matmul %fc1, %w : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %head = mp.matmul %fc2, %w : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    return %head : tensor<4x8xf32>
  }
}
"""


@pytest.mark.parametrize("glob", ["%fc*", "fc*"])
def test_override_name_glob_matches_through_mplower_opt(cli, tmp_path, glob) -> None:
    (tmp_path / "m.ir").write_text(NAMED)
    (tmp_path / "s.toml").write_text(
        '[policy]\ncompute = "bf16"\nallow = ["mp.matmul"]\n\n'
        f'[[override]]\nname = "{glob}"\ncompute = "f32"\n')
    res = cli("opt", tmp_path / "m.ir", f"--pass=assign-precision{{policy={tmp_path}/s.toml}}")
    assert res.rc == 0, res.err
    plans = dict(re.findall(r"(%\w+) = mp\.matmul .*mp\.precision = (\w+)", res.out))
    assert plans == {"%fc1": "f32", "%fc2": "f32", "%head": "bf16"}
    assert res.out.count(f'mp.reason = "override {glob}"') == 2


@pytest.mark.parametrize("model, sheet, limit, first_line", [
    ("transformer", "bf16", "max_rel_l2 = 0.02", "verdict: fail (max_rel_l2 0.00365 <= 0.002 "),
    # Quantized convs with a bias are rebuilt by quantize: the suggestion still names them as
    # the source does (%c1, %c2), not as the rewrite's new ops.
    ("cnn", "bf16-int8", "max_rel_l2 = 0.05", "verdict: fail (max_rel_l2 0.0092 <= 0.002 "),
], ids=["transformer-bf16", "cnn-bf16-int8"])
def test_bisect_suggestion_pasted_into_the_sheet_meets_the_guardrail(
        cli, tmp_path, model, sheet, limit, first_line) -> None:
    text = (Path(__file__).resolve().parent.parent / "mplower" / "policies" / f"{sheet}.toml")
    sheet_text = text.read_text().replace(limit, "max_rel_l2 = 0.002")
    (tmp_path / "sheet.toml").write_text(sheet_text)
    (tmp_path / f"{model}.npz").write_bytes((EXAMPLES / f"{model}.npz").read_bytes())
    source = (EXAMPLES / f"{model}.ir").read_text()
    (tmp_path / "m.ir").write_text(source)
    inputs = EXAMPLES / f"{model}_inputs.npz"
    pipeline = f"--pass-pipeline=assign-precision{{policy={tmp_path}/sheet.toml}}"
    if "int8" in sheet:
        pipeline += f",calibrate{{data={inputs}}},quantize,insert-casts"
    low = tmp_path / "low.ir"
    assert cli("opt", tmp_path / "m.ir", pipeline, "-o", low).rc == 0
    res = cli("run", low, "--inputs", inputs, "--bisect")
    assert res.rc == 0 and res.out.startswith(first_line), res.out[:200]
    snippet = res.out[res.out.index("[[override]]"):]
    kept = re.search(r"^bisect: keep in f32: (.*) \(", res.out, re.MULTILINE).group(1).split(", ")
    assert re.findall(r'^name = "(%\w+)"$', snippet, re.MULTILINE) == kept
    assert all(re.search(rf"^ *{name} = ", source, re.MULTILINE) for name in kept)
    (tmp_path / "sheet.toml").write_text(sheet_text + "\n" + snippet)
    fixed = tmp_path / "fixed.ir"
    assert cli("opt", tmp_path / "m.ir", pipeline, "-o", fixed).rc == 0
    for name in kept:
        assert re.search(rf'{name} = mp\.\w+ .*mp\.precision = f32.*'
                         rf'mp\.reason = "override {name}"', fixed.read_text())
    rc, report = run_json(cli, fixed, "--inputs", inputs, "--check")
    assert report["summary"]["guardrails"]["max_rel_l2"]["ok"] is True and rc == 0


# ---- verdict lines -------------------------------------------------------------------------


def report_with(guardrails: dict) -> dict:
    return {"function": "main", "policy": None, "ops": [],
            "summary": {"ops": 0, "fallback_ops": 0, "fallback_rate": 0.0, "overflow": 0,
                        "overflow_rate": 0.0, "underflow": 0, "nan": 0, "nonfinite_weights": [],
                        "nonfinite_mismatch": 0,
                        "output_rel_l2": 0.004234567891234, "output_max_abs": 0.1,
                        "sqnr_db": 47.46, "top1_agreement": None, "guardrails": guardrails,
                        "verdict": "pass"}}


def test_verdict_line_prints_three_significant_digits_and_json_keeps_all() -> None:
    report = report_with({
        "max_rel_l2": {"limit": 0.01, "value": 0.004234567891234, "ok": True},
        "min_sqnr_db": {"limit": 40.0, "value": 47.4612345, "ok": True},
        "max_overflow": {"limit": 0, "value": 0, "ok": True}})
    first = render(report, "table").splitlines()[0]
    assert first == ("verdict: pass (max_rel_l2 0.00423 <= 0.01 ok, min_sqnr_db 47.5 >= 40 ok, "
                     "max_overflow 0 <= 0 ok)")
    back = json.loads(render(report, "json"))["summary"]["guardrails"]
    assert back["max_rel_l2"]["value"] == 0.004234567891234


def test_verdict_line_shows_enough_digits_to_tell_a_value_from_its_limit() -> None:
    report = report_with({"max_rel_l2": {"limit": 0.01, "value": 0.0100004, "ok": False}})
    first = render(report, "table").splitlines()[0]
    assert first == "verdict: pass (max_rel_l2 0.0100004 <= 0.01 FAILED)"


def bench_quant():
    """benchmarks/quant.py, whose models and tool runs the anchor comparison reuses."""
    import importlib.util

    for name in ("sklearn", "skl2onnx", "onnxruntime.quantization"):
        pytest.importorskip(name)
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "quant.py"
    spec = importlib.util.spec_from_file_location("bench_quant", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_quant", module)  # its dataclasses look themselves up there
    spec.loader.exec_module(sys.modules["bench_quant"])
    return sys.modules["bench_quant"]


def test_default_int8_is_at_least_as_good_as_onnxruntimes_default_on_held_out_data(
        tmp_path) -> None:
    import math

    from onnxruntime.quantization import CalibrationDataReader, quantize_static

    from mplower.ir.parser import parse_file

    bq = bench_quant()
    # ir_examples/mlp's network, unfolded; calibrated on its training split, measured on the
    # test split (ORT 32.9 dB; mplower 34.3 dB asymmetric, 29.0 dB symmetric).
    model = bq.MODELS["digits-mlp"]()
    batch = math.gcd(len(model.x_train), len(model.x_test))
    ir = bq.write_ir(model, tmp_path, batch)
    np.savez(tmp_path / "train.npz", x=bq.batches(model.x_train, batch))
    ref = bq.run_program(parse_file(ir), model.x_test, batch)
    q = bq.mplower_quantized(ir, tmp_path / "train.npz", "calibrate{data=CALIB},quantize")
    ours = bq.sqnr_db(bq.run_program(q, model.x_test, batch), ref)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([{"X": b} for b in bq.batches(model.x_train, batch)])

        def get_next(self):
            return next(self.it, None)

    src, dst = tmp_path / "model.onnx", tmp_path / "model.q.onnx"
    bq.onnx_model(model, src)
    quantize_static(str(src), str(dst), Reader())  # every option at ORT's default
    theirs = bq.sqnr_db(bq.ort_run(dst, model.x_test), bq.ort_run(src, model.x_test))
    assert ours >= theirs
