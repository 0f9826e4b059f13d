"""Quantization-aware training: prepare-qat's grids, training through them, quantize after.

Expected grids are written out in numpy from the calibration data and the weights (symmetric
weights per output column: absmax / 127; a one-sided activation range [0, hi]: ui8, hi / 255).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mplower.backend.executor import Program, reference_runner
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.opdef import attr_array
from mplower.ir.parser import parse_file
from mplower.ir.printer import print_module
from mplower.pass_manager import PassContext, PassManager, parse_pipeline
from mplower.train.optim import SGD
from mplower.train.scaler import parse_loss_scale
from mplower.train.trainer import Trainer, fit

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "ir_examples" / "mlp.ir"
INPUTS = ROOT / "ir_examples" / "mlp_inputs.npz"


def lowered(path: Path, pipeline: str):
    module = parse_file(path)
    PassManager(parse_pipeline(pipeline)).run(module, PassContext(runner=reference_runner))
    return module


def by_op(module, op: str) -> list[dict]:
    f = module.function()
    return [f.data(n) for n in f.ops() if f.op(n) == op]


def test_prepare_qat_puts_quantizes_grids_on_weights_per_channel_and_activations():
    module = lowered(MLP, f"calibrate{{data={INPUTS}}},prepare-qat")
    fq = {d["name"]: d["attrs"] for d in by_op(module, "mp.fake_quant")}
    assert sorted(fq) == ["2_fq", "w1_fq", "w2_fq", "x_fq"]
    with np.load(ROOT / "ir_examples" / "mlp.npz") as w, np.load(INPUTS) as data:
        w1, x = w["fc1.weight"], data["x"]
    np.testing.assert_array_equal(attr_array(fq["w1_fq"]["scale"]).astype(np.float32),
                                  (np.abs(w1.astype(np.float64)).max(axis=0) / 127)
                                  .astype(np.float32))
    assert fq["w1_fq"]["axis"] == 1 and fq["w1_fq"]["dtype"].type == "i8"
    assert fq["x_fq"]["dtype"].type == "ui8"  # pixels: a one-sided range
    assert fq["x_fq"]["scale"] == float(np.float32(np.float64(x.max()) / 255))
    f = module.function()
    matmuls = [n for n in f.ops() if f.op(n) == "mp.matmul"]
    assert [[f.data(v[0])["name"] for v in f.operands(n)] for n in matmuls] == [
        ["x_fq", "w1_fq"], ["2_fq", "w2_fq"]]


def test_quantize_after_prepare_qat_is_quantize_of_the_calibrated_model_bit_for_bit():
    via_qat = lowered(MLP, f"calibrate{{data={INPUTS}}},prepare-qat,quantize")
    direct = lowered(MLP, f"calibrate{{data={INPUTS}}},quantize")
    assert by_op(via_qat, "mp.fake_quant") == []
    with np.load(INPUTS) as data:
        x = data["x"]
    a = Program(via_qat).run([x], reference=False).outputs[0]
    b = Program(direct).run([x], reference=False).outputs[0]
    assert a.tobytes() == b.tobytes()
    strip = lambda m: print_module(m).replace("_fq", "")
    assert strip(via_qat) == strip(direct)


def test_prepare_qat_without_calibration_is_a_located_error():
    with pytest.raises(DiagnosticError) as e:
        lowered(MLP, "prepare-qat")
    d = e.value.diagnostics[0]
    assert (d.loc.line, d.message) == (10, ("'mp.matmul' operand #0 %x has no calibrated range "
                                          "(mp.range); run calibrate{data=...} first"))


def test_quantize_after_training_keeps_the_frozen_trained_grid(tmp_path):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    qat = lowered(MLP, f"calibrate{{data={INPUTS}}},prepare-qat")
    frozen = attr_array(by_op(qat, "mp.fake_quant")[1]["attrs"]["scale"])  # fc1.weight's
    # The model takes raw pixels (0..16, its scaler folded into fc1): a small step size.
    trainer = Trainer(qat, "cross_entropy", "y", [], SGD(lr=0.002), parse_loss_scale("none"))
    rows = fit(trainer, {"x": x.astype(np.float32), "y": y}, 20, seed=0)
    assert all(np.isfinite(r["loss"]) for r in rows)
    # Fake-quantized values that round to 0 count as forward underflow; the weights moved.
    assert rows[0]["forward"]["underflow"] > 0
    w1 = trainer.params["fc1.weight"]
    retrained = (np.abs(w1.astype(np.float64)).max(axis=0) / 127).astype(np.float32)
    assert not np.array_equal(retrained, frozen.astype(np.float32))
    np.savez(tmp_path / "qat.npz", **trainer.params)
    qat.attrs["mp.weights"] = "qat.npz"
    (tmp_path / "qat.ir").write_text(print_module(qat))
    deployed = lowered(tmp_path / "qat.ir", "quantize")
    weight_q = [d for d in by_op(deployed, "mp.quantize") if d["name"] == "w1_q"]
    assert len(weight_q) == 1
    np.testing.assert_array_equal(attr_array(weight_q[0]["attrs"]["scale"]), frozen)
    assert by_op(deployed, "mp.fake_quant") == []
    assert {d["attrs"]["mp.precision"].type for d in by_op(deployed, "mp.matmul")} == {"i8"}


def test_prepare_qat_lsq_starts_on_the_calibrated_grid_bit_for_bit():
    lsq = lowered(MLP, f"calibrate{{data={INPUTS}}},prepare-qat{{scales=lsq}}")
    assert len(by_op(lsq, "mp.fake_quant_lsq")) == 4
    scales = [d for d in by_op(lsq, "mp.constant") if d["attrs"].get("mp.trainable") is True]
    assert sorted(d["name"] for d in scales) == ["2_scale", "w1_scale", "w2_scale", "x_scale"]
    with np.load(INPUTS) as data:
        x = data["x"]
    frozen = lowered(MLP, f"calibrate{{data={INPUTS}}},prepare-qat")
    a = Program(lsq).run([x], reference=False).outputs[0]
    b = Program(frozen).run([x], reference=False).outputs[0]
    assert a.tobytes() == b.tobytes()
    deployed = lowered(MLP, f"calibrate{{data={INPUTS}}},prepare-qat{{scales=lsq}},quantize")
    direct = lowered(MLP, f"calibrate{{data={INPUTS}}},quantize")
    assert print_module(deployed).replace("_fq", "") == print_module(direct)


def test_train_learns_lsq_scales_and_quantize_deploys_them(tmp_path, cli):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    np.savez(tmp_path / "train.npz", x=x.astype(np.float32), y=y)
    qat = tmp_path / "qat.ir"
    res = cli("opt", MLP, f"--pass-pipeline=calibrate{{data={INPUTS}}},prepare-qat{{scales=lsq}}",
              "-o", qat)
    assert res.rc == 0, res.err
    res = cli("train", qat, "--data", tmp_path / "train.npz", "--optimizer", "adam{lr=0.0005}",
              "--steps", 20, "-o", tmp_path / "trained.ir")
    assert res.rc == 0, res.err
    before = {d["name"]: attr_array(d["attrs"]["value"]) for d in by_op(parse_file(qat),
                                                                        "mp.constant")
              if d["attrs"].get("mp.trainable")}
    trained = parse_file(tmp_path / "trained.ir")
    after = {d["name"]: attr_array(d["attrs"]["value"]) for d in by_op(trained, "mp.constant")
             if d["attrs"].get("mp.trainable")}
    assert sorted(after) == sorted(before)
    assert all(not np.array_equal(before[k], after[k]) for k in before)  # every scale learned
    with np.load(tmp_path / "trained.npz") as w:
        assert sorted(w) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    deployed = lowered(tmp_path / "trained.ir", "quantize")
    assert by_op(deployed, "mp.fake_quant_lsq") == []
    w1_q = next(d for d in by_op(deployed, "mp.quantize") if d["name"] == "w1_q")
    np.testing.assert_array_equal(attr_array(w1_q["attrs"]["scale"]),
                                  np.abs(after["w1_scale"]).astype(np.float32))
