"""mplower train: loss scaling, optimizers, mixed-precision training on digits, the report.

Expected loss-scale sequences are written out by hand from torch.amp.GradScaler's documented
rule; optimizer updates are the torch.optim formulas in float64 numpy; accuracies are measured
on the scikit-learn digits test split (the last 397 images), against the fp32 run with the same
seed and steps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numba
import numpy as np
import pytest
from sklearn.datasets import load_digits

from mplower.ir.parser import parse_file
from mplower.pass_manager import parse_pipeline
from mplower.train.optim import SGD, Adam, parse_optimizer
from mplower.train.scaler import parse_loss_scale
from mplower.train.trainer import Trainer, fit

ROOT = Path(__file__).resolve().parent.parent
F32 = np.float32
SPLIT = 1400  # digits has 1797 images: train on the first 1400, test on the other 397


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(F32), y


def mlp_init(folder: Path) -> Path:
    """ir_examples/mlp.ir with seeded untrained weights beside it (its own are trained)."""
    rng = np.random.default_rng(0)
    np.savez(folder / "mlp.npz", **{
        "fc1.weight": (rng.standard_normal((64, 64)) * 0.125).astype(F32),
        "fc1.bias": np.zeros(64, F32),
        "fc2.weight": (rng.standard_normal((64, 10)) * 0.125).astype(F32),
        "fc2.bias": np.zeros(10, F32)})
    path = folder / "mlp.ir"
    path.write_text((ROOT / "ir_examples" / "mlp.ir").read_text())
    return path


def plan(policy: str) -> list:
    return parse_pipeline(f"assign-precision{{policy={policy}}},insert-casts")


# ---- loss scaling ---------------------------------------------------------------------------

def test_dynamic_loss_scale_follows_grad_scaler_on_a_hand_written_sequence():
    scaler = parse_loss_scale("dynamic", init=8.0, interval=3)
    finite = [True, True, False, True, True, True, True, True, True, False]
    seen, skipped = [], []
    for ok in finite:
        seen.append(float(scaler.scale))
        skipped.append(scaler.update(found_inf=not ok))
    # Backoff halves and restarts the count; 3 consecutive finite steps double the scale.
    assert seen == [8, 8, 8, 4, 4, 4, 8, 8, 8, 16]
    assert skipped == [False, False, True, False, False, False, False, False, False, True]
    assert float(scaler.scale) == 8 and scaler.finite_steps == 0


def test_dynamic_loss_scale_has_grad_scalers_defaults_and_static_never_skips():
    s = parse_loss_scale("dynamic")
    assert (float(s.scale), s.growth, s.backoff, s.interval) == (65536.0, 2.0, 0.5, 2000)
    static = parse_loss_scale("static=1024")
    assert static.update(found_inf=True) is False and float(static.scale) == 1024
    assert float(parse_loss_scale("none").scale) == 1
    with pytest.raises(ValueError, match="static=S"):
        parse_loss_scale("static=-2")


def test_overflowing_scale_skips_steps_and_backs_off_until_gradients_are_finite(tmp_path, digits):
    x, y = digits
    trainer = Trainer(parse_file(mlp_init(tmp_path)), "cross_entropy", "y", plan("fp16"),
                      parse_optimizer("sgd{lr=0.1}"), parse_loss_scale("dynamic", init=2.0 ** 40))
    before = {k: v.copy() for k, v in trainer.params.items()}
    rows = fit(trainer, {"x": x[:SPLIT], "y": y[:SPLIT]}, 30, seed=0)
    skipped = [r["step"] for r in rows if r["skipped"]]
    # 2^40 * dloss overflows f16 (65504) in the backward pass; each skip halves the scale.
    assert skipped == list(range(len(skipped))) and len(skipped) >= 10
    assert [r["loss_scale"] for r in rows[:len(skipped) + 1]] == [
        2.0 ** (40 - i) for i in range(len(skipped) + 1)]
    assert all(r["backward"]["overflow"] + r["backward"]["nan"] > 0 for r in rows[:len(skipped)])
    assert rows[len(skipped)]["skipped"] is False
    if len(skipped) == len(rows):
        pytest.fail("the scale never came down far enough")
    # Skipped steps leave the weights alone: only the finite steps moved them.
    assert any(not np.array_equal(before[k], trainer.params[k]) for k in before)


# ---- optimizers -----------------------------------------------------------------------------

def test_sgd_with_momentum_and_adam_follow_the_torch_optim_formulas():
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(5).astype(F32)
    grads = [rng.standard_normal(5).astype(F32) for _ in range(3)]
    sgd, adam = SGD(lr=0.1, momentum=0.9), Adam(lr=0.01)
    ps, pa = {"w": w0.copy()}, {"w": w0.copy()}
    ws, wa = w0.astype(np.float64), w0.astype(np.float64)
    buf, m, v = None, 0.0, 0.0
    for t, g in enumerate(grads, start=1):
        sgd.step(ps, {"w": g})
        adam.step(pa, {"w": g})
        g64 = g.astype(np.float64)
        buf = g64 if buf is None else 0.9 * buf + g64
        ws = ws - 0.1 * buf
        m, v = 0.9 * m + 0.1 * g64, 0.999 * v + 0.001 * g64 * g64
        wa = wa - 0.01 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    assert ps["w"].dtype == F32 and pa["w"].dtype == F32
    np.testing.assert_allclose(ps["w"], ws, rtol=1e-6)
    np.testing.assert_allclose(pa["w"], wa, rtol=1e-6)


def test_optimizer_spec_errors_name_the_option():
    assert parse_optimizer("adam{lr=0.002 beta2=0.99}") == Adam(lr=0.002, beta2=0.99)
    with pytest.raises(ValueError, match="optimizer 'sgd' has no option 'momentun'; did you "
                                         "mean 'momentum'"):
        parse_optimizer("sgd{momentun=0.9}")
    with pytest.raises(ValueError, match="sgd"):
        parse_optimizer("rmsprop")


# ---- mixed-precision training on digits -----------------------------------------------------

def _train(model: Path, weights: Path | None, policy: str, scale: str, data, steps: int,
           optimizer: str):
    x, y = data
    trainer = Trainer(parse_file(model), "cross_entropy", "y",
                      plan(policy) if policy != "fp32" else [], parse_optimizer(optimizer),
                      parse_loss_scale(scale), weights_path=str(weights) if weights else None)
    rows = fit(trainer, {"x": x[:SPLIT], "y": y[:SPLIT]}, steps, seed=0)
    underflow = sum(r["backward"]["underflow"] for r in rows)
    return trainer.accuracy(x[SPLIT:], y[SPLIT:]), underflow, trainer


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_bf16_and_fp16_with_loss_scaling_train_to_fp32_accuracy_and_scaling_cuts_underflow(
        tmp_path, digits, model):
    x, y = digits
    if model == "mlp":
        path, weights, steps, opt = mlp_init(tmp_path), None, 440, "sgd{lr=0.05 momentum=0.9}"
    else:
        path, weights = ROOT / "ir_examples" / "training" / "digits_cnn.ir", None
        x, steps, opt = x.reshape(-1, 1, 8, 8), 600, "adam{lr=0.003}"
    runs = {(p, s): _train(path, weights, p, s, (x, y), steps, opt)
            for p, s in (("fp32", "none"), ("bf16", "none"), ("fp16", "dynamic"),
                         ("fp16", "none"))}
    fp32 = runs["fp32", "none"][0]
    assert fp32 > 0.9
    assert abs(runs["bf16", "none"][0] - fp32) <= 0.005
    assert abs(runs["fp16", "dynamic"][0] - fp32) <= 0.005
    # f16 flushes small gradients to zero; scaling the loss by 2^16 keeps most of them.
    unscaled, scaled = runs["fp16", "none"][1], runs["fp16", "dynamic"][1]
    assert unscaled > 0 and scaled < unscaled
    assert runs["fp32", "none"][1] == 0


@pytest.mark.determinism
def test_training_is_bit_identical_for_any_thread_count(tmp_path, digits):
    path = mlp_init(tmp_path)
    finals = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        try:
            _, _, trainer = _train(path, None, "bf16", "dynamic", digits, 40, "adam{lr=0.01}")
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        finals.append({k: v.tobytes() for k, v in trainer.params.items()})
    assert finals[0] == finals[1]


# ---- the command ----------------------------------------------------------------------------

def test_train_command_writes_module_weights_report_and_plot(tmp_path, digits, cli):
    x, y = digits
    model = mlp_init(tmp_path)
    np.savez(tmp_path / "train.npz", x=x[:SPLIT], y=y[:SPLIT])
    np.savez(tmp_path / "test.npz", x=x[SPLIT:], y=y[SPLIT:])
    res = cli("train", model, "--data", tmp_path / "train.npz", "--eval", tmp_path / "test.npz",
              "--policy", "fp16", "--loss-scale", "dynamic", "--optimizer",
              "sgd{lr=0.05 momentum=0.9}", "--steps", 50, "--report", tmp_path / "train.json",
              "--plot", tmp_path / "train.png", "-o", tmp_path / "out.ir")
    assert res.rc == 0, res.err
    text = (tmp_path / "out.ir").read_text()
    # The same module (comments aside), its weights now the trained ones beside it.
    assert text.replace('"out.npz"', '"mlp.npz"') == cli("opt", model).out
    with np.load(tmp_path / "out.npz") as w, np.load(tmp_path / "mlp.npz") as w0:
        assert sorted(w) == sorted(w0)
        assert not np.array_equal(w["fc1.weight"], w0["fc1.weight"])
    report = json.loads((tmp_path / "train.json").read_text())
    assert report["config"]["plan"] == "assign-precision{policy=fp16},insert-casts"
    assert len(report["steps"]) == 50 and report["summary"]["steps"] == 50
    row = report["steps"][0]
    assert set(row) == {"step", "loss", "loss_scale", "skipped", "grads_finite", "forward",
                        "backward", "ops"}
    assert row["loss_scale"] == 65536.0 and row["loss"] > 2.0
    assert report["summary"]["backward"]["underflow"] == sum(
        r["backward"]["underflow"] for r in report["steps"])
    assert report["summary"]["eval"]["samples"] == 397
    assert (tmp_path / "train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "50 steps" in res.err
    res = cli("train", model, "--data", tmp_path / "train.npz", "--epochs", 2, "-o",
              tmp_path / "out2.ir")
    assert res.rc == 0 and "86 steps" in res.err  # 2 x 1400 // 32: the last partial batch dropped


def test_train_report_dash_prints_the_report_on_stdout_and_writes_no_file(tmp_path, digits,
                                                                          cli, monkeypatch):
    x, y = digits
    model = mlp_init(tmp_path)
    np.savez(tmp_path / "train.npz", x=x[:SPLIT], y=y[:SPLIT])
    monkeypatch.chdir(tmp_path)
    res = cli("train", model, "--data", tmp_path / "train.npz", "--steps", 3, "--report", "-",
              "-o", tmp_path / "out.ir")
    assert res.rc == 0, res.err
    report = json.loads(res.out)
    assert report["summary"]["steps"] == 3 and len(report["steps"]) == 3
    assert not (tmp_path / "-").exists()


def test_train_reports_which_op_underflows_in_which_phase(tmp_path, digits):
    x, y = digits
    trainer = Trainer(parse_file(mlp_init(tmp_path)), "cross_entropy", "y", plan("fp16"),
                      parse_optimizer("sgd{lr=0.05 momentum=0.9}"), parse_loss_scale("none"))
    rows = fit(trainer, {"x": x[:SPLIT], "y": y[:SPLIT]}, 60, seed=0)
    ops = {(o["name"]) for r in rows for o in r["ops"] if o["backward"]["underflow"]}
    # The gradients of the logits (%4's backward) and of the hidden layer flush to zero in f16.
    assert ops and ops <= {"%0", "%1", "%2", "%3", "%4", "%cross_entropy",
                           "%cross_entropy_1", "%cross_entropy_2", "%cross_entropy_4",
                           "%loss_scale"}
    for r in rows:
        assert r["backward"]["underflow"] == sum(o["backward"]["underflow"] for o in r["ops"])


def test_train_usage_and_input_errors_leave_no_output(tmp_path, digits, cli):
    x, y = digits
    model = mlp_init(tmp_path)
    np.savez(tmp_path / "train.npz", x=x[:SPLIT], labels=y[:SPLIT])
    out = tmp_path / "out.ir"
    out.write_text("previous\n")
    res = cli("train", model, "--data", tmp_path / "train.npz", "--optimizer", "sgd{lr=-1}",
              "-o", out)
    assert (res.rc, res.err.splitlines()[-1]) == (
        2, "mplower: error: optimizer 'sgd': lr must be > 0, got -1.0")
    res = cli("train", model, "--data", tmp_path / "train.npz", "-o", out)
    assert (res.rc, res.err) == (1, (f"{tmp_path / 'train.npz'}: error: training data lacks 'y' "
                                    "(it has: labels, x)\n"))
    res = cli("train", model, "--data", tmp_path / "train.npz", "--pass-pipeline",
              "asign-precision", "-o", out)
    assert (res.rc, res.err.splitlines()[-1]) == (
        2, "mplower: error: unknown pass 'asign-precision'; did you mean 'assign-precision'?")
    assert out.read_text() == "previous\n"
    assert sorted(os.listdir(tmp_path)) == ["mlp.ir", "mlp.npz", "out.ir", "train.npz"]


# ---- --batch: set-batch on the model ----------------------------------------------------------

def mlp_at_batch(folder: Path, batch: int) -> Path:
    """The digits MLP as if written for `batch` (every 32x in its text), with mlp_init's weights."""
    folder.mkdir()
    path = mlp_init(folder)
    path.write_text(path.read_text().replace("32x", f"{batch}x"))
    return path


@pytest.mark.parametrize("batch", [16, 64])
def test_train_batch_trains_as_the_model_written_at_that_batch(tmp_path, digits, cli, batch):
    x, y = digits
    np.savez(tmp_path / "train.npz", x=x[:SPLIT], y=y[:SPLIT])
    model, written = mlp_init(tmp_path), mlp_at_batch(tmp_path / "written", batch)
    runs = {}
    for name, ir, extra in (("rebatched", model, ["--batch", batch]), ("written", written, [])):
        res = cli("train", ir, "--data", tmp_path / "train.npz", "--policy", "bf16", "--steps", 3,
                  *extra, "--report", tmp_path / f"{name}.json", "-o", tmp_path / f"{name}.ir")
        assert res.rc == 0, res.err
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert report["config"]["batch"] == batch
        runs[name] = (report["steps"], dict(np.load(tmp_path / f"{name}.npz")))
    assert runs["rebatched"][0] == runs["written"][0]
    for k, w in runs["written"][1].items():
        assert runs["rebatched"][1][k].tobytes() == w.tobytes(), k
    # The trained module is the model as written (batch 32), only its weights file is new.
    text = (tmp_path / "rebatched.ir").read_text()
    assert text.replace('"rebatched.npz"', '"mlp.npz"') == cli("opt", model).out


def test_train_batch_the_model_cannot_follow_is_a_located_error(tmp_path, digits, cli):
    x, y = digits
    np.savez(tmp_path / "train.npz", x=x[:SPLIT], y=y[:SPLIT])
    model = mlp_init(tmp_path)
    # The logits flattened across the batch and back: the row count is written into the reshape.
    text = model.read_text().replace(
        "    %5 = mp.softmax %4",
        "    %f = mp.reshape %4 : (tensor<32x10xf32>) -> tensor<320xf32>\n"
        "    %g = mp.reshape %f : (tensor<320xf32>) -> tensor<32x10xf32>\n"
        "    %5 = mp.softmax %g")
    model.write_text(text)
    out = tmp_path / "out.ir"
    res = cli("train", model, "--data", tmp_path / "train.npz", "--batch", 16, "-o", out)
    line = text.splitlines().index(
        "    %f = mp.reshape %4 : (tensor<32x10xf32>) -> tensor<320xf32>") + 1
    assert (res.rc, res.err) == (1, (
        f"{model}:{line}:5: error: set-batch: cannot change the batch from 32 to 16: reshape "
        "changes the element count: tensor<16x10xf32> has 160 elements, tensor<320xf32> has "
        "320\n"
        "    %f = mp.reshape %4 : (tensor<32x10xf32>) -> tensor<320xf32>\n"
        "    ^\n"))
    assert sorted(os.listdir(tmp_path)) == ["mlp.ir", "mlp.npz", "train.npz"]


def test_train_evaluates_after_each_epoch_and_plots_it(tmp_path, digits, cli):
    """--eval gives the accuracy after every whole epoch (at its last step); the last one is
    the final accuracy, and train.png gets a fourth panel for it."""
    from matplotlib.image import imread

    x, y = digits
    model = mlp_init(tmp_path)
    np.savez(tmp_path / "train.npz", x=x[:SPLIT], y=y[:SPLIT])
    np.savez(tmp_path / "test.npz", x=x[SPLIT:], y=y[SPLIT:])
    res = cli("train", model, "--data", tmp_path / "train.npz", "--eval", tmp_path / "test.npz",
              "--epochs", 2, "--optimizer", "sgd{lr=0.05 momentum=0.9}", "--report",
              tmp_path / "train.json", "--plot", tmp_path / "train.png", "-o", tmp_path / "o.ir")
    assert res.rc == 0, res.err
    ev = json.loads((tmp_path / "train.json").read_text())["summary"]["eval"]
    assert [(e["epoch"], e["step"]) for e in ev["per_epoch"]] == [(1, 42), (2, 85)]  # 1400 // 32
    assert ev["per_epoch"][-1]["accuracy"] == ev["accuracy"]
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in ev["per_epoch"])
    assert imread(tmp_path / "train.png").shape == (1000, 800, 4)  # 8 x 10 inches: 4 panels
