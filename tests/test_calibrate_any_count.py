"""Calibration data of any sample count (issue 33, section 3): 42 samples for a batch-32 model
calibrate with the statistics of one batch of 42 (the padded rows of the last batch count
nowhere): extremes, histograms, percentiles and the MSE and entropy ranges; the extremes checked
against numpy over all samples at once. A model that mixes the rows of a batch is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mplower.backend.executor import reference_runner
from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.ir.parser import parse
from mplower.lowering.calibration import range_of
from mplower.pass_manager import PassContext, PassManager, parse_pipeline
from mplower.passes.calibrate import calibrate_function, split_batches, split_samples

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "ir_examples" / "mlp.ir"


def _mlp(batch: int):
    module = parse(MLP.read_text().replace("tensor<32x", f"tensor<{batch}x"), str(MLP))
    module.path = str(MLP)
    return module


def _samples(n: int) -> np.ndarray:
    return np.random.default_rng(33).uniform(0, 16, (n, 64)).astype(np.float32)


def _stats_tuple(s):
    return (s.count, s.min, s.max, s.hist.tolist(), s.side_exp, s.side_exponents.tolist(),
            None if s.channel_max is None else s.channel_max.tolist(),
            None if s.channel_min is None else s.channel_min.tolist(), s.nonfinite.tolist())


def test_42_samples_split_into_a_whole_and_a_padded_batch():
    f = _mlp(32).function()
    x = _samples(42)
    batches, rows = split_samples(f, {"x": x}, Location("c.npz", 0, 0))
    assert rows == 10 and len(batches) == 2
    assert np.array_equal(batches[0][0], x[:32])
    assert np.array_equal(batches[1][0][:10], x[32:])
    assert np.array_equal(batches[1][0][10:], np.repeat(x[-1:], 22, axis=0))
    # 64 samples are two whole batches; the evaluation data still wants whole batches.
    assert split_samples(f, {"x": _samples(64)}, Location("c.npz", 0, 0))[1] is None
    with pytest.raises(DiagnosticError) as e:
        split_batches(f, {"x": x}, Location("e.npz", 0, 0), "evaluation")
    assert e.value.diagnostics[0].message == (
        "evaluation data holds 42 samples, not a whole number of batches of 32; give a "
        "multiple of 32 samples, or retype the model with set-batch")


def test_statistics_of_42_samples_equal_one_batch_of_42_and_numpy():
    x = _samples(42)
    small = _mlp(32)
    batches, rows = split_samples(small.function(), {"x": x}, Location("c.npz", 0, 0))
    padded = calibrate_function(small, None, batches, reference_runner, None, 256,
                                last_rows=rows)
    big = _mlp(42)
    whole = calibrate_function(big, None, [[x]], reference_runner, None, 256)
    fs, fb = small.function(), big.function()
    names_b = {fb.value_name(v): s for v, s in whole.items()}
    assert len(padded) == len(whole)
    for v, s in padded.items():
        assert _stats_tuple(s) == _stats_tuple(names_b[fs.value_name(v)]), fs.value_name(v)
    # numpy over all 42 samples at once: the input's and the hidden layer's extremes.
    w = np.load(ROOT / "ir_examples/mlp.npz")
    stats = {fs.value_name(v): s for v, s in padded.items()}
    assert (stats["%x"].min, stats["%x"].max, stats["%x"].count) == (x.min(), x.max(), x.size)
    h = np.maximum(x.astype(np.float64) @ w["fc1.weight"] + w["fc1.bias"], 0)
    assert stats["%2"].max == pytest.approx(h.max(), rel=1e-5)
    assert stats["%2"].count == h.size
    assert np.array_equal(stats["%x"].channel_max, x.max(axis=0))
    assert np.array_equal(stats["%x"].channel_min, x.min(axis=0))


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy", "mse"])
def test_calibrate_pass_on_42_samples_records_the_ranges_of_one_batch_of_42(tmp_path, method):
    x = _samples(42)
    shutil.copy(ROOT / "ir_examples/mlp.npz", tmp_path / "mlp.npz")
    np.savez(tmp_path / "samples.npz", x=x)
    np.savez(tmp_path / "one.npz", x=x)

    def ranges(batch: int, data: str):
        module = _mlp(batch)
        PassManager(parse_pipeline(f"calibrate{{data={tmp_path / data} method={method}}}")).run(
            module, PassContext(runner=reference_runner))
        f = module.function()
        values = [(a, 0) for a in f.args] + [(n, 0) for n in f.ops() if f.data(n)["types"]]
        return {f.value_name(v): range_of(f, v) for v in values}

    got, want = ranges(32, "samples.npz"), ranges(42, "one.npz")
    assert got == want
    assert got["%x"] == (float(x.min()), float(x.max())) or method != "minmax"


def test_a_model_that_mixes_batch_rows_refuses_a_partial_batch(tmp_path):
    text = """func.func @main(%x: tensor<4x3xf32>) -> tensor<1x3xf32> {
  %0 = mp.reduce_mean %x {axes = [0], keepdims = true} : (tensor<4x3xf32>) -> tensor<1x3xf32>
  return %0 : tensor<1x3xf32>
}
"""
    module = parse(text, "mix.ir")
    data = tmp_path / "calib.npz"
    np.savez(data, x=np.ones((6, 3), np.float32))
    with pytest.raises(DiagnosticError) as e:
        PassManager(parse_pipeline(f"calibrate{{data={data}}}")).run(
            module, PassContext(runner=reference_runner))
    d = e.value.diagnostics[0]
    assert d.loc.file == str(data)
    assert d.message.startswith("calibration data does not fill its last batch, and this "
                                "model mixes the rows of a batch")


def test_tune_takes_calibration_data_of_42_samples(cli, tmp_path):
    for name in ("mlp.ir", "mlp.npz"):
        shutil.copy(ROOT / "ir_examples" / name, tmp_path / name)
    np.savez(tmp_path / "calib.npz", x=_samples(42))
    np.savez(tmp_path / "eval.npz", x=_samples(32))
    r = cli("tune", tmp_path / "mlp.ir", "--target", "h100", "--data", tmp_path / "calib.npz",
            "--eval", tmp_path / "eval.npz", "--formats", "i8", "--budget", "12",
            "-o", tmp_path / "out")
    assert r.rc in (0, 3), r.err
    packet = json.loads((tmp_path / "out/tune.json").read_text())
    int8 = [c for c in packet["candidates"] if "i8" in c["plan"].get("formats", {}).values()]
    assert int8 and all(c["verdict"] != "error" for c in int8)
