"""Calibration over finite values (issue 32, section 2): an attention mask's -inf is taken as it
is, ranges come from the finite values, a value that held inf or NaN is never quantized to an
integer format, and the int8 and bf16-int8 sheets run on transformer exports whose masks are
-inf. Expected outputs come from onnxruntime and numpy.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from mplower.lowering.calibration import TensorStats

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import test_onnx_transformers as tt  # the BERT/GPT-2 export patterns

ort = pytest.importorskip("onnxruntime")


def test_channel_statistics_leave_out_infinities_and_count_them():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 5)).astype(np.float32)
    x[0, 1, :] = -np.inf  # a whole channel row masked in one sample
    x[1, 2, 3] = np.inf
    x[1, 3, :] = -np.inf  # channel 3 has no finite value in sample 1
    stats = TensorStats(256)
    stats.add(x, channel_axis=1)
    finite = x[np.isfinite(x)]
    assert stats.nonfinite.tolist() == [10, 1, 0]
    assert (stats.min, stats.max, stats.count) == (float(finite.min()), float(finite.max()),
                                                   finite.size)
    want = [np.max(np.abs(x[:, c][np.isfinite(x[:, c])])) for c in range(4)]
    np.testing.assert_array_equal(stats.channel_absmax, np.array(want, np.float64))
    merged = TensorStats(256)
    for part in (x[:1], x[1:]):
        one = TensorStats(256)
        one.add(part, channel_axis=1)
        merged.merge(one)
    assert merged.nonfinite.tolist() == [10, 1, 0]
    assert np.array_equal(merged.pos, stats.pos) and np.array_equal(merged.neg, stats.neg)


def _export(name: str, folder: Path, monkeypatch: pytest.MonkeyPatch, cli
            ) -> onnx.ModelProto:
    """The export pattern of test_onnx_transformers with -inf masks (SDPA's and the dynamo
    exporter's fill) in place of float32's lowest value, imported by `mplower import`; four
    calibration batches and one input batch."""
    monkeypatch.setattr(tt, "LOWEST", -math.inf)
    model = tt.MODELS[name]()
    onnx.save(model, folder / f"{name}.onnx")
    shapes = [f"--input-shape={i.name}={'x'.join(map(str, tt.SHAPES[i.name]))}"
              for i in model.graph.input]
    r = cli("import", folder / f"{name}.onnx", "-o", folder / f"{name}.ir", *shapes)
    assert r.rc == 0, r.err
    batches = [tt.feeds(model, seed) for seed in range(4)]
    np.savez(folder / "calib.npz", **{k: np.stack([b[k] for b in batches]) for k in batches[0]})
    np.savez(folder / "in.npz", **batches[0])
    return model


@pytest.mark.parametrize("name", ["bert", "gpt2"])
@pytest.mark.parametrize("sheet", ["int8", "bf16-int8"])
def test_int8_sheets_run_transformers_with_minus_inf_masks(cli, tmp_path, monkeypatch, name,
                                                           sheet):
    model = _export(name, tmp_path, monkeypatch, cli)
    pipeline = (f"calibrate{{data={tmp_path / 'calib.npz'}}},assign-precision{{policy={sheet}}},"
                f"legalize{{target=generic}},quantize,insert-casts")
    r = cli("opt", tmp_path / f"{name}.ir", f"--pass-pipeline={pipeline}",
            "-o", tmp_path / "low.ir")
    assert r.rc == 0, r.err
    lowered = (tmp_path / "low.ir").read_text()
    assert "mp.quantize" in lowered  # the GEMMs are int8
    # Every value calibration saw holding -inf is kept out of integer formats.
    masked = [line for line in lowered.splitlines() if "mp.nonfinite" in line]
    assert masked and not any("mp.precision = i8" in line for line in masked)
    r = cli("run", tmp_path / "low.ir", "--inputs", tmp_path / "in.npz",
            "--save-outputs", tmp_path / "out.npz", "--report", tmp_path / "r.json")
    assert r.rc == 0, r.err
    y = np.load(tmp_path / "out.npz")["output_0"].astype(np.float64)
    feeds = dict(np.load(tmp_path / "in.npz"))
    want = tt.ort_run(model, feeds)[0].astype(np.float64)
    assert np.all(np.isfinite(y))
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < 0.05
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["summary"]["nonfinite_mismatch"] == 0


def test_quantize_keeps_a_matmul_whose_operand_held_minus_inf_out_of_int8(cli, tmp_path):
    (tmp_path / "m.ir").write_text(
        "func.func @main(%x: tensor<2x4xf32>) -> tensor<2x3xf32> {\n"
        "  %w = mp.constant {value = dense<0.5> : tensor<4x3xf32>} : () -> tensor<4x3xf32>\n"
        "  %y = mp.matmul %x, %w : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32>\n"
        "  return %y : tensor<2x3xf32>\n}\n")
    x = np.ones((2, 4), np.float32)
    x[0, 1] = -np.inf
    np.savez(tmp_path / "d.npz", x=x)
    r = cli("opt", tmp_path / "m.ir", f"--pass-pipeline=calibrate{{data={tmp_path / 'd.npz'}}},"
            "assign-precision{policy=bf16-int8},quantize")
    assert r.rc == 1
    assert "m.ir:3:3" in r.err and "held 1 -inf, 0 +inf and 0 NaN values" in r.err, r.err
    assert "run calibrate" not in r.err


def test_tune_reports_the_calibration_error_on_every_int8_row(cli, tmp_path):
    """A calibration that fails is the reason of every int8 plan, not `run calibrate first`
    (the half-calibrated module was cached and handed to the next int8 plan)."""
    for n in ("mlp.ir", "mlp.npz", "mlp_inputs.npz"):
        shutil.copy(ROOT / "ir_examples" / n, tmp_path / n)
    x = np.load(tmp_path / "mlp_inputs.npz")["x"]
    bad = x.copy()
    bad[0, 0] = np.nan
    np.savez(tmp_path / "calib.npz", x=bad)
    r = cli("tune", tmp_path / "mlp.ir", "--target", "h100", "--data", tmp_path / "calib.npz",
            "--eval", tmp_path / "mlp_inputs.npz", "--budget", "12", "-o", tmp_path / "out")
    assert r.rc in (0, 3), r.err
    packet = json.loads((tmp_path / "out" / "tune.json").read_text())
    rows = {u["label"]: u for u in packet["uniform"]}
    for label in ("uniform int8", "uniform bf16-int8"):
        assert rows[label]["verdict"] == "error"
        assert "values are NaN" in rows[label]["error"], rows[label]["error"]
