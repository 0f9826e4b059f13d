"""Findings of a new-user pass over tune, train, target measure, import and export: each test
pins one promise of the docs that the first try broke."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "ir_examples" / "mlp.ir"


def _mlp(folder: Path) -> Path:
    for name in ("mlp.ir", "mlp.npz", "mlp_inputs.npz"):
        shutil.copy(ROOT / "ir_examples" / name, folder / name)
    return folder / "mlp.ir"


# ---- a sheet's diagnostic shows the sheet's line, not a line of the model ---------------------

def test_target_sheet_syntax_error_shows_the_sheet_line_under_its_location(cli, tmp_path):
    ir = _mlp(tmp_path)
    sheet = tmp_path / "t.toml"
    sheet.write_text('name = "x"\n[[[bad\n')
    r = cli("report", ir, "--target", sheet)
    assert r.rc == 1
    assert r.err == (f"{sheet}:2:3: error: invalid TOML: invalid initial character for a key "
                     f"part\n[[[bad\n  ^\n")


def test_tune_target_sheet_key_error_shows_the_sheet_line(cli, tmp_path):
    ir = _mlp(tmp_path)
    sheet = tmp_path / "t.toml"
    sheet.write_text('name = "x"\n')
    r = cli("tune", ir, "--target", sheet, "--data", tmp_path / "mlp_inputs.npz",
            "-o", tmp_path / "out")
    assert r.rc == 1
    assert r.err == f"{sheet}:1:1: error: unknown key 'name'\nname = \"x\"\n^\n"
    assert not (tmp_path / "out").exists()


def test_opt_policy_sheet_error_shows_the_sheet_line(cli, tmp_path):
    ir = _mlp(tmp_path)
    sheet = tmp_path / "p.toml"
    sheet.write_text('[policy]\ncompute = "bf17"\n')
    r = cli("opt", ir, f"--pass-pipeline=assign-precision{{policy={sheet}}}")
    assert r.rc == 1
    first, line, caret = r.err.splitlines()[:3]
    assert first.startswith(f"{sheet}:2:11: error: unknown format 'bf17'")
    assert (line, caret) == ('compute = "bf17"', "          ^")


# ---- train: refusals point into the model's file ---------------------------------------------

def test_train_data_of_the_wrong_shape_points_at_the_function_in_the_source(cli, tmp_path):
    for name in ("digits_cnn.ir", "digits_cnn.npz"):
        shutil.copy(ROOT / "ir_examples" / "training" / name, tmp_path / name)
    ir = tmp_path / "digits_cnn.ir"
    np.savez(tmp_path / "flat.npz", x=np.zeros((16, 64), np.float32), y=np.zeros(16, np.int64))
    r = cli("train", ir, "--data", tmp_path / "flat.npz", "--steps", 1, "-o", tmp_path / "t.ir")
    assert r.rc == 1
    assert r.err == (f"{ir}:5:3: error: input 'x' has shape [16, 64] but the function takes "
                     f"[16, 1, 8, 8]\n"
                     f"  func.func @main(%x: tensor<16x1x8x8xf32>) -> tensor<16x10xf32> {{\n"
                     f"  ^\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits_cnn.ir", "digits_cnn.npz",
                                                          "flat.npz"]


NO_WEIGHTS = """\
// a model with no weights
// and a second comment line
func.func @main(%x: tensor<4x3xf32>) -> tensor<4x3xf32> {
  %0 = mp.relu %x : (tensor<4x3xf32>) -> tensor<4x3xf32>
  return %0 : tensor<4x3xf32>
}
"""


def test_train_of_a_model_without_weights_points_at_its_function(cli, tmp_path):
    ir = tmp_path / "m.ir"
    ir.write_text(NO_WEIGHTS)
    np.savez(tmp_path / "d.npz", x=np.ones((8, 3), np.float32), y=np.zeros((8, 3), np.float32))
    r = cli("train", ir, "--data", tmp_path / "d.npz", "--loss", "mse", "--steps", 1,
            "-o", tmp_path / "t.ir")
    assert r.rc == 1
    assert r.err.splitlines()[:2] == [
        (f"{ir}:3:1: error: @main has nothing to train: no float constant of the weights file "
         "(mp.weights) and none marked mp.trainable"),
        "func.func @main(%x: tensor<4x3xf32>) -> tensor<4x3xf32> {"]


def test_grad_unknown_loss_is_a_usage_error_before_the_model_is_read(cli, tmp_path):
    r = cli("opt", tmp_path / "missing.ir", "--pass=grad{loss=hinge}")
    assert r.rc == 2
    assert r.err.splitlines()[-1] == ("mplower: error: grad: unknown loss 'hinge' (expected '', "
                                      "'cross_entropy', 'mse')")


# ---- outputs: all or none --------------------------------------------------------------------

def _digits_cnn(folder: Path) -> tuple[Path, Path]:
    for name in ("digits_cnn.ir", "digits_cnn.npz"):
        shutil.copy(ROOT / "ir_examples" / "training" / name, folder / name)
    rng = np.random.default_rng(0)
    np.savez(folder / "d.npz", x=rng.random((16, 1, 8, 8), np.float32),
             y=rng.integers(0, 10, 16))
    return folder / "digits_cnn.ir", folder / "d.npz"


def test_train_with_an_unwritable_plot_leaves_the_trained_module_unwritten(cli, tmp_path):
    ir, data = _digits_cnn(tmp_path)
    (tmp_path / "t.ir").write_text("old\n")
    bad = tmp_path / "missing" / "t.png"
    r = cli("train", ir, "--data", data, "--steps", 1, "-o", tmp_path / "t.ir",
            "--report", tmp_path / "t.json", "--plot", bad)
    assert (r.rc, r.err) == (1, f"{bad}: error: cannot write output: No such file or directory\n")
    assert (tmp_path / "t.ir").read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.npz", "digits_cnn.ir",
                                                          "digits_cnn.npz", "t.ir"]


def test_train_to_stdout_is_a_usage_error_not_a_file_named_dash_npz(cli, tmp_path,
                                                                    monkeypatch):
    ir, data = _digits_cnn(tmp_path)
    monkeypatch.chdir(tmp_path)
    r = cli("train", ir, "--data", data, "--steps", 1, "-o", "-")
    assert r.rc == 2 and r.out == ""
    assert r.err.splitlines()[-1] == ("mplower: error: train writes the module and its weights "
                                      "beside it: -o needs a file, not '-'")
    assert not (tmp_path / "-.npz").exists()


def test_run_with_an_unwritable_plot_writes_no_report(cli, tmp_path):
    ir = _mlp(tmp_path)
    bad = tmp_path / "missing" / "p.png"
    r = cli("run", ir, "--inputs", tmp_path / "mlp_inputs.npz", "--report",
            tmp_path / "r.json", "--save-outputs", tmp_path / "o.npz", "--plot", bad)
    assert (r.rc, r.err) == (1, f"{bad}: error: cannot write output: No such file or directory\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.ir", "mlp.npz", "mlp_inputs.npz"]


# ---- target measure --name -------------------------------------------------------------------

def test_measured_sheet_quotes_a_name_with_quotes_and_backslashes(monkeypatch):
    import datetime

    from mplower.backend import measure
    from mplower.backend.measure import HostMeasurements, Measurement
    from mplower.lowering.target import parse_target

    h = HostMeasurements(measure.QUICK, [
        Measurement("numpy", "copy", None, "copy", 0.5, 20e9),
        Measurement("mplower", "gemm", "f32", "matmul", 2.0, 100e9),
        Measurement("mplower", "overhead", None, "chain", 64e-6, measure.OVERHEAD_CHAIN)])
    when = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC)
    text = measure.sheet_text(h, "mplower", 'lab "B" \\ 2', when)
    assert 'name = "lab \\"B\\" \\\\ 2"' in text.splitlines()
    assert parse_target(text, "box.toml").name == 'lab "B" \\ 2'


def test_target_measure_name_on_two_lines_is_a_usage_error_before_measuring(cli, tmp_path,
                                                                            monkeypatch):
    from mplower.backend import measure

    monkeypatch.setattr(measure, "measure_host", lambda **k: pytest.fail("measured"))
    r = cli("target", "measure", "--quick", "--name", "a\nb", "-o", tmp_path / "h.toml")
    assert r.rc == 2
    assert r.err.splitlines()[-1] == ("mplower: error: --name must be one line of printable "
                                      "text, got 'a\\nb'")
    assert list(tmp_path.iterdir()) == []


# ---- run: an fp32 model with an attention mask has no quantization section -------------------

MASKED = """\
func.func @main(%x: tensor<2x4xf32>, %mask: tensor<2x4xi64>) -> tensor<2x4xf32> {
  %0 = mp.cast %mask : (tensor<2x4xi64>) -> tensor<2x4xf32>
  %1 = mp.cast %0 : (tensor<2x4xf32>) -> tensor<2x4xi1>
  %2 = mp.constant {value = dense<-3.4028235e+38> : tensor<f32>} : () -> tensor<f32>
  %3 = mp.where %1, %x, %2 : (tensor<2x4xi1>, tensor<2x4xf32>, tensor<f32>) -> tensor<2x4xf32>
  return %3 : tensor<2x4xf32>
}
"""


def test_fp32_run_of_a_mask_cast_from_float_reports_no_quantization_error(cli, tmp_path):
    import json

    ir = tmp_path / "m.ir"
    ir.write_text(MASKED)
    np.savez(tmp_path / "in.npz", x=np.ones((2, 4), np.float32),
             mask=np.array([[1, 1, 0, 0], [1, 0, 1, 0]], np.int64))
    r = cli("run", ir, "--inputs", tmp_path / "in.npz", "--report", tmp_path / "r.json")
    assert r.rc == 0
    assert "quantization error" not in r.out
    assert "quantization" not in json.loads((tmp_path / "r.json").read_text())


# ---- train: labels of the wrong shape are named as labels ------------------------------------

def test_train_mse_with_class_index_labels_names_the_labels_and_the_shape(cli, tmp_path):
    ir = _mlp(tmp_path)
    np.savez(tmp_path / "d.npz", x=np.ones((32, 64), np.float32), y=np.zeros(32, np.int64))
    r = cli("train", ir, "--data", tmp_path / "d.npz", "--loss", "mse", "--steps", 1,
            "-o", tmp_path / "t.ir")
    assert (r.rc, r.err) == (1, (f"{tmp_path / 'd.npz'}: error: labels 'y' hold [] per sample; "
                                "mse needs the output's [10] (class indices go with --loss "
                                "cross_entropy)\n"))
    assert not (tmp_path / "t.ir").exists()


def test_train_one_hot_labels_of_the_wrong_width_are_a_located_error(cli, tmp_path):
    ir = _mlp(tmp_path)
    np.savez(tmp_path / "d.npz", x=np.ones((32, 64), np.float32), y=np.ones((32, 7), np.float32))
    r = cli("train", ir, "--data", tmp_path / "d.npz", "--steps", 1, "-o", tmp_path / "t.ir")
    assert (r.rc, r.err) == (1, (f"{tmp_path / 'd.npz'}: error: labels 'y' hold [7] per sample; "
                                "cross_entropy needs the output's [10]\n"))


# ---- grad: the arguments it adds, the names it leaves --------------------------------------

NAMED = """\
func.func @main(%x: tensor<4x3xf32>, %y: tensor<4x3xf32>) -> tensor<4x3xf32> attributes {mp.output_names = ["out"]} {
  %w = mp.constant {value = dense<0.5> : tensor<3x3xf32>, mp.trainable} : () -> tensor<3x3xf32>
  %0 = mp.matmul %x, %w : (tensor<4x3xf32>, tensor<3x3xf32>) -> tensor<4x3xf32>
  return %0 : tensor<4x3xf32>
}
"""


@pytest.mark.parametrize("option, name", [("labels", "x"), ("labels", "w"), ("seed", "labels")])
def test_grad_argument_named_like_an_existing_value_is_a_located_error(cli, tmp_path, option,
                                                                       name):
    ir = tmp_path / "m.ir"
    ir.write_text(NAMED)
    r = cli("opt", ir, f"--pass=grad{{loss=mse wrt=args {option}={name}}}")
    assert r.rc == 1
    assert r.err.splitlines()[0] == (
        f"{ir}:1:1: error: grad: {option}={name} would add an argument %{name}, but @main "
        f"already has a value of that name; give {option}= another name")


def test_grad_drops_the_imported_output_names_of_the_model_output(cli, tmp_path):
    ir = tmp_path / "m.ir"
    ir.write_text(NAMED)
    r = cli("opt", ir, "--pass=grad{loss=mse wrt=x}")
    assert r.rc == 0
    assert "mp.output_names" not in r.out
    assert "-> (tensor<f32>, tensor<4x3xf32>) {" in r.out


# ---- tune --scheduler ------------------------------------------------------------------------

def test_tune_scheduler_without_a_port_is_a_located_error_and_leaves_no_folder(cli, tmp_path):
    ir = _mlp(tmp_path)
    out = tmp_path / "release"
    r = cli("tune", ir, "--target", "h100", "--data", tmp_path / "mlp_inputs.npz",
            "--scheduler", "nonsense", "-o", out)
    assert (r.rc, r.err) == (1, ("nonsense: error: cannot connect to the dask scheduler: missing "
                                "port number in address 'nonsense'\n"))
    assert not out.exists()


# ---- --seed ----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["run", "bench", "tune", "train"])
def test_negative_seed_is_a_usage_error_of_every_command(cli, tmp_path, command):
    ir = _mlp(tmp_path)
    extra = {"run": ["--random-inputs"], "bench": [],
             "tune": ["--target", "h100", "--data", tmp_path / "mlp_inputs.npz", "-o",
                      tmp_path / "out"],
             "train": ["--data", tmp_path / "mlp_inputs.npz", "-o", tmp_path / "t.ir"]}[command]
    r = cli(command, ir, *extra, "--seed", "-1")
    assert r.rc == 2
    assert r.err.splitlines()[-1] == (f"mplower {command}: error: argument --seed: must be 0 or "
                                      f"more, got -1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.ir", "mlp.npz", "mlp_inputs.npz"]


# ---- train --eval labels ---------------------------------------------------------------------

def test_train_eval_labels_out_of_range_are_a_located_error_at_the_eval_file(cli, tmp_path):
    ir, data = _digits_cnn(tmp_path)
    ev = tmp_path / "ev.npz"
    np.savez(ev, x=np.ones((4, 1, 8, 8), np.float32), y=np.array([0, 3, 11, 2]))
    r = cli("train", ir, "--data", data, "--eval", ev, "--steps", 1, "-o", tmp_path / "t.ir")
    assert (r.rc, r.err) == (1, f"{ev}: error: labels 'y' must be class indices in [0, 10)\n")
    assert not (tmp_path / "t.ir").exists()


def test_train_eval_one_hot_labels_give_the_accuracy_of_their_argmax(cli, tmp_path):
    import json

    ir, data = _digits_cnn(tmp_path)
    rng = np.random.default_rng(1)
    x, classes = rng.random((20, 1, 8, 8), np.float32), rng.integers(0, 10, 20)
    np.savez(tmp_path / "idx.npz", x=x, y=classes)
    np.savez(tmp_path / "hot.npz", x=x, y=np.eye(10, dtype=np.float32)[classes])
    got = []
    for name in ("idx", "hot"):
        r = cli("train", ir, "--data", data, "--eval", tmp_path / f"{name}.npz", "--steps", 1,
                "--report", tmp_path / f"{name}.json", "-o", tmp_path / f"{name}_trained.ir")
        assert r.rc == 0, r.err  # (-o {name}.ir would put its weights over --eval {name}.npz)
        got.append(json.loads((tmp_path / f"{name}.json").read_text())["summary"]["eval"])
    assert got[0] == got[1] and got[0]["samples"] == 20


# ---- run --plot: integer results are not "drift not finite" ---------------------------------

MASKED_OVERFLOW = """\
func.func @main(%x: tensor<2x4xf32>, %mask: tensor<2x4xi64>) -> tensor<2x4xf32> {
  %0 = mp.cast %mask : (tensor<2x4xi64>) -> tensor<2x4xf32>
  %1 = mp.cast %0 : (tensor<2x4xf32>) -> tensor<2x4xi1>
  %2 = mp.constant {value = dense<-3.4028235e+38> : tensor<f32>} : () -> tensor<f32>
  %4 = mp.mul %x, %2 {mp.precision = f16} : (tensor<2x4xf32>, tensor<f32>) -> tensor<2x4xf32>
  %3 = mp.where %1, %x, %4 : (tensor<2x4xi1>, tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
  return %3 : tensor<2x4xf32>
}
"""


def test_drift_plot_marks_only_non_finite_results_not_integer_ones(cli, tmp_path):
    import json

    from mplower.report.drift_plot import plot_drift

    ir = tmp_path / "m.ir"
    ir.write_text(MASKED_OVERFLOW)
    np.savez(tmp_path / "in.npz", x=np.ones((2, 4), np.float32),
             mask=np.array([[1, 1, 0, 0], [1, 0, 1, 0]], np.int64))
    r = cli("run", ir, "--inputs", tmp_path / "in.npz", "--report", tmp_path / "r.json")
    assert r.rc == 0, r.err
    report = json.loads((tmp_path / "r.json").read_text())
    plotted = plot_drift(report)
    ops = [o for o in report["ops"] if o["op"] != "mp.constant"]
    by_name = dict(zip(plotted.names, range(len(ops))))
    # the i1 cast has no drift figure (an integer); -3.4e38 in f16 is -inf, and so on after it
    assert [o["name"] for o in ops if o["rel_l2"] is None] == ["%1", "%2_f16", "%4", "%4_f32",
                                                               "%3"]
    assert plotted.not_finite == tuple(by_name[n] for n in ("%2_f16", "%4", "%4_f32", "%3"))
