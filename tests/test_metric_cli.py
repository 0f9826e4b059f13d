"""`--metric` on the command line (issue 32, section 3): `run --check` with the metric
guardrails (exit 3), usage errors (exit 2), the user's function failing (exit 1, located, no
traceback), a sheet that names a metric refused, and `tune --metric` choosing a plan whose
packet records the metric per slice. The digits MLP's fp32 outputs and every expected metric
value are computed here with numpy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mlp(folder: Path) -> np.ndarray:
    """The digits MLP in `folder` and its fp32 probabilities on mlp_inputs.npz, in numpy."""
    for name in ("mlp.ir", "mlp.npz", "mlp_inputs.npz"):
        shutil.copy(ROOT / "ir_examples" / name, folder / name)
    return _reference(folder, np.load(folder / "mlp_inputs.npz")["x"])


def _reference(folder: Path, x: np.ndarray) -> np.ndarray:
    w = np.load(folder / "mlp.npz")
    h = np.maximum(x.astype(np.float64) @ w["fc1.weight"] + w["fc1.bias"], 0)
    z = h @ w["fc2.weight"] + w["fc2.bias"]
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _labels(probs: np.ndarray, wrong: int) -> np.ndarray:
    """The fp32 prediction, the first `wrong` rows given the second-best class instead."""
    labels = probs.argmax(1)
    labels[:wrong] = np.argsort(-probs[:wrong], axis=1)[:, 1]
    return labels


def _bf16(cli, folder: Path) -> Path:
    r = cli("opt", folder / "mlp.ir", "--pass=assign-precision{policy=bf16}", "-o",
            folder / "bf16.ir")
    assert r.rc == 0, r.err
    return folder / "bf16.ir"


def test_run_reports_the_metric_of_plan_and_reference(cli, tmp_path):
    probs = _mlp(tmp_path)
    labels = _labels(probs, 4)
    x = np.load(tmp_path / "mlp_inputs.npz")["x"]
    np.savez(tmp_path / "in.npz", x=x, labels=labels)
    ir = _bf16(cli, tmp_path)
    r = cli("run", ir, "--inputs", tmp_path / "in.npz", "--metric", "top1:labels",
            "--guardrail", "max_metric_drop=0.05", "--report", tmp_path / "r.json",
            "--save-outputs", tmp_path / "out.npz")
    assert r.rc == 0, r.err
    report = json.loads((tmp_path / "r.json").read_text())
    s = report["summary"]
    y = np.load(tmp_path / "out.npz")["output_0"]
    assert s["metric_reference"] == np.mean(probs.argmax(1) == labels) == 28 / 32
    assert s["metric"] == np.mean(y.argmax(1) == labels)
    assert s["metric_drop"] == s["metric_reference"] - s["metric"]
    assert s["guardrails"]["max_metric_drop"] == {"limit": 0.05, "value": s["metric_drop"],
                                                  "ok": True}
    assert report["metric"] == {"spec": "top1:labels", "direction": "max"}
    jsonschema = pytest.importorskip("jsonschema")
    from mplower.report.run import SCHEMA_PATH

    jsonschema.validate(report, json.loads(SCHEMA_PATH.read_text()))
    assert "metric top1:labels (max): 0.875, fp32 0.875" in cli(
        "run", ir, "--inputs", tmp_path / "in.npz", "--metric", "top1:labels").out


def test_run_check_exits_3_when_the_metric_guardrail_fails(cli, tmp_path):
    probs = _mlp(tmp_path)
    np.savez(tmp_path / "in.npz", x=np.load(tmp_path / "mlp_inputs.npz")["x"],
             labels=_labels(probs, 4))
    ir = _bf16(cli, tmp_path)
    r = cli("run", ir, "--inputs", tmp_path / "in.npz", "--metric", "top1:labels",
            "--guardrail", "min_metric=0.9", "--check")
    assert r.rc == 3 and "min_metric 0.875 >= 0.9 FAILED" in r.out, r.out
    r = cli("run", ir, "--inputs", tmp_path / "in.npz", "--metric", "perplexity:labels",
            "--guardrail", "max_metric_drop_rel=0.5", "--check")
    assert r.rc == 0, r.out


def test_class_accuracy_detail_and_a_user_file_metric(cli, tmp_path):
    probs = _mlp(tmp_path)
    labels = _labels(probs, 4)
    np.savez(tmp_path / "in.npz", x=np.load(tmp_path / "mlp_inputs.npz")["x"], labels=labels)
    r = cli("run", tmp_path / "mlp.ir", "--inputs", tmp_path / "in.npz", "--metric",
            "class_accuracy:labels", "--format", "json")
    assert r.rc == 0, r.err
    report = json.loads(r.out)
    per = {str(c): float(np.mean(probs.argmax(1)[labels == c] == c)) for c in np.unique(labels)}
    assert report["metric"]["metric_detail"] == per
    assert report["summary"]["metric"] == min(per.values())
    (tmp_path / "cer.py").write_text(
        "import numpy as np\n"
        "def error(outputs, eval):\n"
        "    return float(np.mean(outputs['output_0'].argmax(1) != eval['labels']))\n")
    r = cli("run", tmp_path / "mlp.ir", "--inputs", tmp_path / "in.npz", "--metric",
            f"{tmp_path / 'cer.py'}:error", "--metric-direction", "min", "--format", "json")
    assert r.rc == 0, r.err
    assert json.loads(r.out)["summary"]["metric"] == 4 / 32


@pytest.mark.parametrize(("args", "message"), [
    (["--guardrail", "min_metric=0.5"], "--guardrail min_metric needs a metric to measure"),
    (["--metric", "top1"], "--metric takes NAME:ARRAY"),
    (["--metric-direction", "min"], "--metric-direction needs --metric"),
    (["--metric", "perplexity:labels", "--metric-direction", "max"], "better when lower"),
])
def test_metric_usage_errors_exit_2(cli, tmp_path, args, message):
    _mlp(tmp_path)
    r = cli("run", tmp_path / "mlp.ir", "--inputs", tmp_path / "mlp_inputs.npz", *args)
    assert r.rc == 2 and message in r.err, r.err


def test_metric_without_inputs_is_a_usage_error(cli, tmp_path):
    _mlp(tmp_path)
    r = cli("run", tmp_path / "mlp.ir", "--metric", "top1:labels")
    assert r.rc == 2 and "--metric needs --inputs" in r.err


def test_a_failing_user_metric_is_located_exit_1_without_traceback(cli, tmp_path):
    _mlp(tmp_path)
    (tmp_path / "bad.py").write_text("def acc(outputs, eval):\n    return eval['labels'][0]\n")
    r = cli("run", tmp_path / "mlp.ir", "--inputs", tmp_path / "mlp_inputs.npz", "--metric",
            f"{tmp_path / 'bad.py'}:acc", "--report", tmp_path / "r.json")
    assert r.rc == 1
    assert f"{tmp_path / 'bad.py'}:2:1: error: metric " in r.err
    assert "acc() raised KeyError: 'labels'" in r.err and "Traceback" not in r.err
    assert "    return eval['labels'][0]" in r.err  # the user's line, not the model's
    assert not (tmp_path / "r.json").exists()


def test_missing_eval_array_is_reported_before_the_run(cli, tmp_path):
    _mlp(tmp_path)
    r = cli("run", tmp_path / "mlp.ir", "--inputs", tmp_path / "mlp_inputs.npz", "--metric",
            "top1:lables")
    assert r.rc == 1 and "has no array 'lables' (it has: x)" in r.err


def test_a_sheet_never_names_the_metric(cli, tmp_path):
    _mlp(tmp_path)
    (tmp_path / "p.toml").write_text('[policy]\ncompute = "bf16"\nallow = ["mp.matmul"]\n\n'
                                     '[guardrails]\nmetric = "evil.py:run"\n')
    r = cli("opt", tmp_path / "mlp.ir", f"--pass=assign-precision{{policy={tmp_path}/p.toml}}")
    assert r.rc == 1 and "p.toml:6:1" in r.err and "runs no code a file names" in r.err, r.err


def test_sheet_metric_limits_need_the_metric_under_check(cli, tmp_path):
    probs = _mlp(tmp_path)
    np.savez(tmp_path / "in.npz", x=np.load(tmp_path / "mlp_inputs.npz")["x"],
             labels=_labels(probs, 0))
    (tmp_path / "p.toml").write_text('[policy]\ncompute = "bf16"\nallow = ["mp.matmul"]\n\n'
                                     '[guardrails]\nmax_metric_drop = 0.0\n')
    r = cli("opt", tmp_path / "mlp.ir", f"--pass=assign-precision{{policy={tmp_path}/p.toml}}", "-o",
            tmp_path / "low.ir")
    assert r.rc == 0, r.err
    r = cli("run", tmp_path / "low.ir", "--inputs", tmp_path / "in.npz", "--check")
    assert r.rc == 2 and "guardrail max_metric_drop needs the metric" in r.err
    r = cli("run", tmp_path / "low.ir", "--inputs", tmp_path / "in.npz")
    assert r.rc == 0 and "max_metric_drop left out: no --metric" in r.err
    r = cli("run", tmp_path / "low.ir", "--inputs", tmp_path / "in.npz", "--metric",
            "top1:labels", "--check")
    assert r.rc == 0 and "max_metric_drop 0 <= 0 ok" in r.out, r.out


def test_tune_picks_a_plan_under_a_metric_guardrail_and_records_it_per_slice(cli, tmp_path):
    _mlp(tmp_path)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 32, 64)) * 4).astype(np.float32)
    probs = _reference(tmp_path, x.reshape(96, 64))
    labels = _labels(probs, 10)  # fp32 top-1 86 / 96
    np.savez(tmp_path / "calib.npz", x=x)
    np.savez(tmp_path / "eval.npz", x=x, labels=labels.reshape(3, 32))  # stacked like x
    ids = np.arange(96) % 3
    np.savez(tmp_path / "slices.npz", slice=ids)
    out = tmp_path / "release"
    r = cli("tune", tmp_path / "mlp.ir", "--target", "h100", "--data", tmp_path / "calib.npz",
            "--eval", tmp_path / "eval.npz", "--slices", tmp_path / "slices.npz",
            "--formats", "bf16,f8E4M3FN", "--budget", "16", "--metric", "top1:labels",
            "--guardrail", "max_metric_drop=0.0", "-o", out)
    assert r.rc == 0, r.err
    assert "metric (top1:labels)" in r.out
    packet = json.loads((out / "tune.json").read_text())
    assert packet["metric"] == {"spec": "top1:labels", "direction": "max"}
    assert packet["guardrails"] == {"max_metric_drop": 0.0}
    chosen = packet["chosen"]
    q = chosen["quality"]
    assert q["metric_reference"] == np.mean(probs.argmax(1) == labels) == 86 / 96
    assert chosen["lowered_ops"] > 0  # a plan that lowers, not fp32 kept for safety
    assert q["metric_drop"] <= 0.0 and chosen["guardrails"]["max_metric_drop"]["ok"]
    per_slice = chosen["validation"]["metric"]
    assert sorted(per_slice) == ["0", "1", "2"]
    for s, figures in per_slice.items():
        rows = ids == int(s)
        assert figures["metric_reference"] == np.mean(probs[rows].argmax(1) == labels[rows])
        assert figures["metric_drop"] <= 0.0
    assert chosen["validation"]["matrix"]["max_metric_drop"]["0"]["ok"]
    # Every plan whose metric dropped was rejected for it.
    for c in packet["candidates"]:
        if c["verdict"] != "error" and c["quality"]["metric_drop"] > 0:
            assert "max_metric_drop" in c["failed"]
    # The released module, run on the evaluation rows of slice 0's first batch, keeps it.
    policy = (out / "policy.toml").read_text()
    assert "max_metric_drop = 0.0" in policy and "--metric top1:labels" in policy


def test_bisect_measures_the_metric_guardrail(cli, tmp_path):
    probs = _mlp(tmp_path)
    np.savez(tmp_path / "in.npz", x=np.load(tmp_path / "mlp_inputs.npz")["x"],
             labels=_labels(probs, 0))
    ir = _bf16(cli, tmp_path)
    r = cli("run", ir, "--inputs", tmp_path / "in.npz", "--metric", "top1:labels",
            "--guardrail", "min_metric=1", "--bisect", "--format", "json")
    assert r.rc == 0, r.err
    report = json.loads(r.out)
    assert report["summary"]["metric"] == 1.0 and report["bisect"]["met"], report["bisect"]


def test_tune_calls_the_user_function_on_all_samples_stacked(cli, tmp_path):
    """The user's function sees every evaluation batch's outputs stacked along the samples
    and the labels flattened to match (docs/metrics.md); a min metric's drop is plan - fp32."""
    _mlp(tmp_path)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 32, 64)) * 4).astype(np.float32)
    probs = _reference(tmp_path, x.reshape(64, 64))
    labels = _labels(probs, 8)
    np.savez(tmp_path / "eval.npz", x=x, labels=labels.reshape(2, 32))
    (tmp_path / "err.py").write_text(
        "import numpy as np\n"
        "def error_rate(outputs, eval):\n"
        "    assert outputs['output_0'].shape == (64, 10), outputs['output_0'].shape\n"
        "    assert eval['labels'].shape == (64,), eval['labels'].shape\n"
        "    return float(np.mean(outputs['output_0'].argmax(1) != eval['labels']))\n")
    r = cli("tune", tmp_path / "mlp.ir", "--target", "h100", "--data", tmp_path / "eval.npz",
            "--formats", "bf16", "--budget", "6", "--metric", f"{tmp_path / 'err.py'}:error_rate",
            "--metric-direction", "min", "--guardrail", "max_metric=0.2", "-o", tmp_path / "o")
    assert r.rc == 0, r.err
    packet = json.loads((tmp_path / "o" / "tune.json").read_text())
    assert packet["metric"]["direction"] == "min"
    q = packet["chosen"]["quality"]
    assert q["metric_reference"] == 8 / 64
    assert q["metric_drop"] == q["metric"] - q["metric_reference"]
