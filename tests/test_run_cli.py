"""`mplower run` and `mplower bench` (DESIGN §6, §7): report schema, formats, guardrails, safety.

Every error case asserts a located diagnostic, exit code 1 and no traceback, and that the
`--save-outputs` / `--report` files a failing run names are left exactly as they were.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mplower.report.run import SCHEMA_PATH

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "ir_examples"

MATMUL_IR = """module @m attributes {mp.weights = "w.npz"} {
  func.func @main(%x: tensor<4x8xf32>) -> tensor<4x3xf32> {
    %w = mp.constant {name = "w"} : () -> tensor<8x3xf32>
    %y = mp.matmul %x, %w : (tensor<4x8xf32>, tensor<8x3xf32>) -> tensor<4x3xf32>
    return %y : tensor<4x3xf32>
  }
}
"""


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A one-matmul model with its weights and inputs in tmp_path."""
    rng = np.random.default_rng(0)
    (tmp_path / "m.ir").write_text(MATMUL_IR)
    np.savez(tmp_path / "w.npz", w=rng.standard_normal((8, 3)).astype(np.float32))
    np.savez(tmp_path / "in.npz", x=rng.standard_normal((4, 8)).astype(np.float32))
    return tmp_path / "m.ir"


@pytest.fixture
def lowered(tmp_path: Path, cli) -> Path:
    """The transformer example under the bf16 sheet (assign-precision only), in tmp_path."""
    out = tmp_path / "t_bf16.ir"
    assert cli("opt", EXAMPLES / "transformer.ir", "--pass=assign-precision{policy=bf16}",
               "-o", out).rc == 0
    (tmp_path / "transformer.npz").write_bytes((EXAMPLES / "transformer.npz").read_bytes())
    return out


def validate(report: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(report, json.loads(SCHEMA_PATH.read_text()))


def assert_clean_error(res, *fragments: str) -> None:
    assert res.rc == 1, res.err
    assert "Traceback" not in res.err and "internal error" not in res.err
    assert ": error: " in res.err
    for f in fragments:
        assert f in res.err


# ---- report and formats ------------------------------------------------------------------


@pytest.mark.parametrize("passes", [
    [],
    ["--pass=assign-precision{policy=bf16}"],
    ["--pass=assign-precision{policy=fp8}", "--pass=legalize{target=a100}"],
    ["--pass=assign-precision{policy=int8}"],
])
def test_report_json_validates_against_the_schema(cli, tmp_path, passes) -> None:
    ir = tmp_path / "t.ir"
    assert cli("opt", EXAMPLES / "transformer.ir", *passes, "-o", ir).rc == 0
    res = cli("run", ir, "--weights", EXAMPLES / "transformer.npz", "--inputs",
              EXAMPLES / "transformer_inputs.npz", "--format", "json",
              "--report", tmp_path / "r.json")
    assert res.rc == 0, res.err
    report = json.loads(res.out)
    validate(report)
    assert json.loads((tmp_path / "r.json").read_text()) == report
    s = report["summary"]
    assert s["ops"] == sum(1 for o in report["ops"] if o["op"] != "mp.constant")
    assert s["fallback_ops"] == sum(1 for o in report["ops"] if o["fallback"])
    assert s["verdict"] == ("pass" if passes else "unchecked")  # no sheet: nothing claimed


def test_report_dash_prints_the_json_report_on_stdout_and_writes_no_file(cli, tmp_path,
                                                                         monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    res = cli("run", EXAMPLES / "transformer.ir", "--weights", EXAMPLES / "transformer.npz",
              "--inputs", EXAMPLES / "transformer_inputs.npz", "--report", "-")
    assert res.rc == 0, res.err
    report = json.loads(res.out)  # JSON, in place of the default text table
    validate(report)
    assert report["summary"]["verdict"] == "unchecked"
    assert not (tmp_path / "-").exists()


def test_counts_reach_the_report_and_the_schema_accepts_nulls(cli, tmp_path) -> None:
    from test_backend import COUNTS_IR, COUNTS_X, EXPECTED_COUNTS

    (tmp_path / "c.ir").write_text(COUNTS_IR)
    np.savez(tmp_path / "x.npz", x=COUNTS_X)
    res = cli("run", tmp_path / "c.ir", "--inputs", tmp_path / "x.npz", "--format", "json")
    assert res.rc == 0, res.err
    report = json.loads(res.out)
    validate(report)
    got = {o["name"]: (o["overflow"], o["underflow"], o["nan"]) for o in report["ops"]}
    assert got == EXPECTED_COUNTS
    s = report["summary"]
    assert (s["overflow"], s["underflow"], s["nan"]) == (11, 12, 3)
    assert s["output_rel_l2"] is None and s["sqnr_db"] is None


def test_table_and_markdown_show_the_worst_ops_first(cli, lowered) -> None:
    args = ("run", lowered, "--inputs", EXAMPLES / "transformer_inputs.npz")
    report = json.loads(cli(*args, "--format", "json").out)
    drifts = {o["name"]: o["rel_l2"] for o in report["ops"] if o["op"] != "mp.constant"}
    worst = max(drifts, key=lambda n: drifts[n] or 0)
    table = cli(*args).out.splitlines()
    assert table[0].startswith("verdict: pass (max_rel_l2 ")  # the bf16 sheet's guardrail
    header = next(i for i, line in enumerate(table) if line.startswith("name "))
    end = table.index("", header)  # the per-op quantization table follows a blank line
    rows = [line.split()[0] for line in table[header + 1:end]]
    assert "quantization error (worst first):" in table[end:]
    assert rows[0] == worst
    assert len(rows) == len(drifts)
    shown = [drifts[n] or 0 for n in rows]
    assert shown == sorted(shown, reverse=True)
    md = cli(*args, "--format", "markdown").out.splitlines()
    first = md.index(next(line for line in md if line.startswith("| name |")))
    assert md[first + 2].startswith(f"| {worst} |")


def test_save_outputs_writes_output_n_in_result_order(cli, model, tmp_path) -> None:
    res = cli("run", model, "--inputs", tmp_path / "in.npz", "--save-outputs", tmp_path / "o.npz")
    assert res.rc == 0, res.err
    with np.load(tmp_path / "o.npz") as out, np.load(tmp_path / "w.npz") as w, \
            np.load(tmp_path / "in.npz") as x:
        assert out.files == ["output_0"]
        np.testing.assert_allclose(out["output_0"], x["x"] @ w["w"], rtol=1e-6)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_random_inputs_are_seeded_and_exclusive_with_inputs(cli, model, tmp_path) -> None:
    outs = []
    for seed in ("1", "1", "2"):
        res = cli("run", model, "--random-inputs", "--seed", seed, "--save-outputs",
                  tmp_path / "o.npz")
        assert res.rc == 0, res.err
        with np.load(tmp_path / "o.npz") as out:
            outs.append(out["output_0"].tobytes())
    assert outs[0] == outs[1] != outs[2]
    res = cli("run", model, "--random-inputs", "--inputs", tmp_path / "in.npz")
    assert res.rc == 2 and "not allowed with" in res.err


def test_func_picks_the_function_and_an_unknown_one_is_a_usage_error(cli, tmp_path) -> None:
    (tmp_path / "two.ir").write_text("""
func.func @first(%x: tensor<3xf32>) -> tensor<3xf32> {
  %0 = mp.neg %x : (tensor<3xf32>) -> tensor<3xf32>
  return %0 : tensor<3xf32>
}
func.func @second(%x: tensor<3xf32>) -> tensor<3xf32> {
  %0 = mp.relu %x : (tensor<3xf32>) -> tensor<3xf32>
  return %0 : tensor<3xf32>
}
""")
    np.savez(tmp_path / "x.npz", x=np.array([-1.0, 0.5, 2.0], np.float32))
    res = cli("run", tmp_path / "two.ir", "--inputs", tmp_path / "x.npz", "--func", "second",
              "--save-outputs", tmp_path / "o.npz", "--format", "json")
    assert res.rc == 0, res.err
    assert json.loads(res.out)["function"] == "second"
    with np.load(tmp_path / "o.npz") as out:
        assert out["output_0"].tolist() == [0.0, 0.5, 2.0]
    res = cli("run", tmp_path / "two.ir", "--func", "third")  # a usage error: exit 2
    assert res.rc == 2 and "Traceback" not in res.err
    assert res.err.endswith(f"--func: {tmp_path / 'two.ir'} has no function @third (it has: "
                            f"@first, @second)\n")
    assert_clean_error(cli("run", tmp_path / "two.ir"), "--func")


def test_run_reads_the_module_from_stdin(cli, model, tmp_path, monkeypatch) -> None:
    import io

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(MATMUL_IR.encode())))
    res = cli("run", "-", "--inputs", "in.npz", "--format", "json")
    assert res.rc == 0, res.err
    assert json.loads(res.out)["summary"]["ops"] == 1


# ---- guardrails and --check ------------------------------------------------------------


def test_policy_sheet_guardrails_pass_under_check(cli, lowered) -> None:
    res = cli("run", lowered, "--check", "--format", "json")
    assert res.rc == 0, res.err
    report = json.loads(res.out)
    assert report["policy"] == "bf16"
    g = report["summary"]["guardrails"]["max_rel_l2"]
    assert g["limit"] == 0.02 and g["ok"] and 0 < g["value"] <= 0.02


def test_failing_guardrail_exits_3_only_under_check(cli, lowered, tmp_path) -> None:
    args = ("run", lowered, "--guardrail", "max_rel_l2=1e-9", "--report", tmp_path / "r.json")
    res = cli(*args, "--check")
    assert res.rc == 3
    assert res.out.startswith("verdict: fail")
    assert "FAILED" in res.out
    report = json.loads((tmp_path / "r.json").read_text())  # the report says why
    assert report["summary"]["guardrails"]["max_rel_l2"]["ok"] is False
    assert report["summary"]["verdict"] == "fail"
    assert cli(*args).rc == 0
    res = cli("run", lowered, "--guardrail", "max_rel_l2=0.5", "--guardrail",
              "min_sqnr_db=20", "--check")
    assert res.rc == 0, res.out


def test_guardrails_come_from_a_custom_policy_sheet(cli, tmp_path) -> None:
    sheet = tmp_path / "strict.toml"
    sheet.write_text((ROOT / "mplower" / "policies" / "bf16.toml").read_text())
    text = sheet.read_text()
    assert "max_rel_l2" in text
    sheet.write_text("\n".join("max_rel_l2 = 1e-9" if line.startswith("max_rel_l2") else line
                               for line in text.splitlines()) + "\n")
    ir = tmp_path / "t.ir"
    assert cli("opt", EXAMPLES / "transformer.ir",
               f"--pass=assign-precision{{policy={sheet}}}", "-o", ir).rc == 0
    (tmp_path / "transformer.npz").write_bytes((EXAMPLES / "transformer.npz").read_bytes())
    assert cli("run", ir, "--check").rc == 3
    assert cli("run", ir, "--check", "--guardrail", "max_rel_l2=0.05").rc == 0  # flag wins


def test_rtol_atol_guardrail_reports_the_worst_allclose_ratio_of_the_outputs(
        cli, tmp_path, lowered) -> None:
    inputs = EXAMPLES / "transformer_inputs.npz"
    assert cli("run", EXAMPLES / "transformer.ir", "--inputs", inputs,
               "--save-outputs", tmp_path / "ref.npz").rc == 0
    ref = np.load(tmp_path / "ref.npz")["output_0"]
    res = cli("run", lowered, "--inputs", inputs, "--guardrail", "rtol=0.01", "--guardrail",
              "atol=0.0001", "--format", "json", "--save-outputs", tmp_path / "y.npz", "--check")
    report = json.loads(res.out)
    validate(report)
    y = np.load(tmp_path / "y.npz")["output_0"]
    worst = np.max(np.abs(y.astype(np.float64) - ref) / (1e-4 + 0.01 * np.abs(ref.astype(float))))
    g = report["summary"]["guardrails"]["max_allclose_ratio"]  # beside the bf16 sheet's own
    assert g == {"limit": 1.0, "value": pytest.approx(worst, rel=1e-12),
                 "ok": bool(np.allclose(y, ref, 0.01, 1e-4)), "rtol": 0.01, "atol": 0.0001}
    assert report["summary"]["allclose_ratio"] == g["value"]
    assert res.rc == (0 if report["summary"]["verdict"] == "pass" else 3)
    text = cli("run", lowered, "--inputs", inputs, "--guardrail", "rtol=0.01",
               "--guardrail", "atol=0.0001").out.splitlines()[0]
    assert text.startswith("verdict: ") and "max_allclose_ratio " in text and " <= 1 " in text


@pytest.mark.parametrize("flag", ["max_rel_l2", "max_rel=0.1", "max_rel_l2=abc",
                                  "max_rel_l2=nan"])
def test_bad_guardrail_flag_is_a_usage_error(cli, model, flag) -> None:
    res = cli("run", model, "--guardrail", flag, "--check")
    assert res.rc == 2
    assert "--guardrail" in res.err and "Traceback" not in res.err


# ---- safety ------------------------------------------------------------------------------


def test_weights_path_leaving_the_model_folder_is_refused(cli, tmp_path) -> None:
    inner = tmp_path / "models"
    inner.mkdir()
    (inner / "m.ir").write_text(MATMUL_IR.replace('"w.npz"', '"../x.npz"'))
    np.savez(tmp_path / "x.npz", w=np.zeros((8, 3), np.float32))
    res = cli("run", inner / "m.ir")
    assert_clean_error(res, f"{inner / 'm.ir'}:1:", "leaves the model's folder", "--weights")
    # Named deliberately with --weights, the same file is fine.
    assert cli("run", inner / "m.ir", "--weights", tmp_path / "x.npz").rc == 0


def test_missing_weight_and_shape_mismatch_point_at_the_constant(cli, model, tmp_path) -> None:
    np.savez(tmp_path / "w.npz", other=np.zeros((8, 3), np.float32))
    assert_clean_error(cli("run", model), f"{model}:3:", "weight 'w' is missing")
    np.savez(tmp_path / "w.npz", w=np.zeros((3, 8), np.float32))
    res = cli("run", model)
    assert_clean_error(res, f"{model}:3:", "shape [3, 8]", "declares [8, 3]")
    assert "%w = mp.constant" in res.err and "^" in res.err  # the source line and a caret


def test_npz_with_pickled_objects_is_not_loaded(cli, model, tmp_path) -> None:
    np.savez(tmp_path / "w.npz", w=np.array([{"boom": 1}] * 24, dtype=object).reshape(8, 3),
             allow_pickle=True)
    assert_clean_error(cli("run", model), "cannot read weights", "allow_pickle=False")
    np.savez(tmp_path / "evil.npz", x=np.array([object()] * 32, dtype=object).reshape(4, 8),
             allow_pickle=True)
    np.savez(tmp_path / "w.npz", w=np.zeros((8, 3), np.float32))
    assert_clean_error(cli("run", model, "--inputs", tmp_path / "evil.npz"),
                       "cannot read inputs")


def test_bad_inputs_are_diagnostics_at_the_argument(cli, model, tmp_path) -> None:
    x = np.ones((4, 8), np.float64)
    x[1, 2], x[3, 3] = 1e300, -1e39
    np.savez(tmp_path / "big.npz", x=x)
    assert_clean_error(cli("run", model, "--inputs", tmp_path / "big.npz"),
                       f"{model}:2:", "input 'x' has 2 finite values that f32 cannot hold")
    np.savez(tmp_path / "other.npz", y=np.ones((4, 8), np.float32))
    assert_clean_error(cli("run", model, "--inputs", tmp_path / "other.npz"),
                       "input 'x' is missing", "(it has: y)")
    np.savez(tmp_path / "shape.npz", x=np.ones((8, 4), np.float32))
    assert_clean_error(cli("run", model, "--inputs", tmp_path / "shape.npz"), "shape [8, 4]")
    np.save(tmp_path / "bare.npy", x)
    assert_clean_error(cli("run", model, "--inputs", tmp_path / "bare.npy"), "not an .npz")
    assert_clean_error(cli("run", model, "--inputs", tmp_path / "none.npz"), "does not exist")


def test_failed_run_leaves_output_files_untouched(cli, model, tmp_path) -> None:
    outputs, report = tmp_path / "o.npz", tmp_path / "r.json"
    outputs.write_bytes(b"previous outputs")
    report.write_text("previous report")
    np.savez(tmp_path / "big.npz", x=np.full((4, 8), 1e300, np.float64))
    res = cli("run", model, "--inputs", tmp_path / "big.npz", "--save-outputs", outputs,
              "--report", report)
    assert_clean_error(res)
    assert outputs.read_bytes() == b"previous outputs"
    assert report.read_text() == "previous report"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["m.ir", "w.npz", "in.npz", "big.npz", "o.npz", "r.json"])
    res = cli("run", model, "--save-outputs", tmp_path / "missing" / "o.npz")
    assert_clean_error(res, "cannot write output")


# ---- bench -------------------------------------------------------------------------------


def test_bench_json_has_measured_and_modeled_figures(cli, lowered) -> None:
    res = cli("bench", lowered, "--format", "json", "--iterations", "5", "--warmup", "1",
              "--target", "h100")
    assert res.rc == 0, res.err
    out = json.loads(res.out)
    lat = out["latency_ms"]
    assert set(lat) == {"p50", "p95", "p99"}
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"]
    assert out["inferences_per_s"] == pytest.approx(1e3 / lat["p50"])
    assert out["modeled"]["target"] == "h100"
    assert out["modeled"]["time_s"] > 0
    assert out["modeled"]["inferences_per_s"] == pytest.approx(1 / out["modeled"]["time_s"])
    assert out["samples"] == 5
    assert "warning: p99 rests on 5 samples (fewer than 100" in res.err
    # samples/s is inferences/s times the batch (the first argument's leading dimension)
    (arg,) = re.findall(r"func.func @\w+\(%\w+: tensor<(\d+)x", lowered.read_text())
    assert out["batch"] == int(arg)
    assert out["samples_per_s"] == pytest.approx(out["inferences_per_s"] * out["batch"])
    assert out["modeled"]["samples_per_s"] == pytest.approx(
        out["modeled"]["inferences_per_s"] * out["batch"])


def test_bench_table_and_random_inputs_by_default(cli, model) -> None:
    res = cli("bench", model, "-n", "3")
    assert res.rc == 0, res.err
    assert "p50" in res.out and "inferences/s" in res.out and "modeled on generic" in res.out
    assert "measured (3 samples" in res.out
    assert cli("bench", model, "-n", "0").rc == 2


def test_bench_default_takes_200_samples_or_its_time_budget(cli, model) -> None:
    res = cli("bench", model, "--format", "json", "--warmup", "0")
    assert res.rc == 0, res.err
    out = json.loads(res.out)
    assert (out["samples"], out["time_budget_s"]) == (200, 10.0)  # a tiny model: 200 first
    assert "warning" not in res.err
    res = cli("bench", model, "--format", "json", "--warmup", "0", "--time-budget", "1e-9")
    out = json.loads(res.out)
    assert res.rc == 0 and out["samples"] == 1 and "rests on 1 samples" in res.err


def test_bench_and_report_count_tokens_along_the_sequence_axis(cli, tmp_path) -> None:
    ir = tmp_path / "seq.ir"
    ir.write_text("func.func @main(%x: tensor<4x6x8xf32>) -> tensor<4x6x8xf32> {\n"
                  "  %y = mp.relu %x : (tensor<4x6x8xf32>) -> tensor<4x6x8xf32>\n"
                  "  return %y : tensor<4x6x8xf32>\n}\n")
    res = cli("bench", ir, "-n", "2", "--format", "json", "--seq-axis", "1")
    out = json.loads(res.out)
    assert (out["batch"], out["tokens_per_inference"]) == (4, 24)
    assert out["tokens_per_s"] == pytest.approx(24 * out["inferences_per_s"])
    rep = json.loads(cli("report", ir, "--format", "json", "--seq-axis", "1").out)["summary"]
    assert (rep["samples_per_inference"], rep["tokens_per_inference"]) == (4, 24)
    assert rep["modeled_tokens_per_s"] == pytest.approx(24 * rep["modeled_inferences_per_s"])
    # without an axis or attention, a model has no tokens
    rep = json.loads(cli("report", ir, "--format", "json").out)["summary"]
    assert rep["tokens_per_inference"] is None and rep["modeled_tokens_per_s"] is None
    bad = cli("report", ir, "--seq-axis", "3")
    assert bad.rc == 2 and "--seq-axis 3 is not an axis of the first argument" in bad.err


def test_report_ends_with_its_summary_line(cli, lowered) -> None:
    """`mplower report M | tail -1` is the summary (docs/tune.md), after the kernel table."""
    res = cli("report", lowered, "--target", "h100")
    last = res.out.rstrip("\n").splitlines()[-1]
    assert re.match(r"\d+ ops, \d+ lowered; modeled [\d.]+ us on h100 \([\d.]+ inferences/s",
                    last), last


# ---- the numba cache ---------------------------------------------------------------------


def test_second_process_loads_compiled_kernels_from_the_cache(tmp_path, lowered) -> None:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "NUMBA_DEBUG_CACHE": "1"}
    cmd = [sys.executable, "-m", "mplower", "run", str(lowered), "--seed", "1"]
    logs = []
    for _ in range(2):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                              check=False)
        assert done.returncode == 0, done.stderr
        logs.append(done.stdout + done.stderr)
    assert "[cache] data saved" in logs[0]
    assert "[cache] data loaded" in logs[1]
    assert "[cache] data saved" not in logs[1]


def test_bisect_names_the_ops_to_keep_in_f32_and_the_report_validates(cli, lowered,
                                                                        tmp_path) -> None:
    import jsonschema

    schema = json.loads((Path(__file__).parent.parent / "mplower" / "report"
                         / "report.schema.json").read_text())
    args = ("run", lowered, "--inputs", EXAMPLES / "transformer_inputs.npz",
            "--guardrail", "max_rel_l2=0.002", "--bisect", "--report", tmp_path / "r.json")
    res = cli(*args)
    assert res.rc == 0, res.err
    report = json.loads((tmp_path / "r.json").read_text())
    jsonschema.validate(report, schema)
    b = report["bisect"]
    assert b["met"] is True and 0 < len(b["ops"]) <= len(report["quantization"])
    assert f"bisect: keep in f32: {', '.join(b['ops'])}" in res.out
    # The per-op quantization rows come worst first by the op's own loss.
    local = [q["local_sqnr_db"] for q in report["quantization"] if q["local_sqnr_db"] is not None]
    assert local == sorted(local)


def test_bisect_without_guardrails_is_a_usage_error(cli, model) -> None:
    res = cli("run", model, "--bisect")
    assert res.rc == 2 and "--bisect needs guardrails" in res.err
