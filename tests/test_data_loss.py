"""Outputs that must not disappear: weights beside `-o` never collide with another file, a failed
or terminated command changes no existing file, a killed one leaves the old set or the new set
(and its stage files go on the next run), `tune -o DIR` is swapped in whole, outputs are checked
before the work, and `-` means stdout for every output.

The kills are made deterministic by MPLOWER_TEST_PAUSE_BEFORE_COMMIT (mplower.io.atomic): the
run waits for a signal once every output is staged, so the test signals it at exactly that point.
"""

from __future__ import annotations

import io
import json
import os
import pty
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"


def _mlp(folder: Path) -> Path:
    for name in ("mlp.ir", "mlp.npz", "mlp_inputs.npz"):
        shutil.copy(ROOT / "ir_examples" / name, folder / name)
    return folder / "mlp.ir"


def _train_data(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    np.savez(folder / "train.npz", x=rng.standard_normal((64, 64)).astype(np.float32),
             y=rng.integers(0, 10, 64))
    return folder / "train.npz"


def _old_files(folder: Path, names: list[str]) -> dict[str, bytes]:
    for name in names:
        (folder / name).write_bytes(f"previous {name}\n".encode())
    return {name: (folder / name).read_bytes() for name in names}


def _contents(folder: Path, names: list[str]) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in names}


def _stage_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".mplower-" in p.name)


def _mplower(*args: object, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mplower", *map(str, args)],
                          check=False, capture_output=True, timeout=600, **kw)


def _paused(*args: object) -> subprocess.Popen:
    """The command, started and waiting before its commit with every output staged."""
    env = {**os.environ, "MPLOWER_TEST_PAUSE_BEFORE_COMMIT": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mplower", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in proc.stderr:  # the hook's line comes just before it waits for the signal
        if line == b"MPLOWER_TEST_PAUSE_BEFORE_COMMIT: paused\n":
            return proc
    pytest.fail(f"the run ended without pausing: {proc.communicate()}")


# ---- the weights beside -o never land on another file -----------------------------------------

def test_opt_with_a_weight_writing_pass_refuses_o_npz_and_keeps_that_file(cli, tmp_path):
    model = _mlp(tmp_path)
    out = tmp_path / "out.npz"
    out.write_bytes(b"user weights")
    r = cli("opt", model, "-p", "sparsify", "-o", out)
    assert r.rc == 2
    assert r.err.splitlines()[-1] == (f"mplower: error: -o {out}: the module's weights go to "
                                      f"<stem>.npz beside it, which is this file; name the IR "
                                      f"file out.ir")
    assert out.read_bytes() == b"user weights"


def test_train_and_import_refuse_o_npz(cli, tmp_path):
    model = _mlp(tmp_path)
    data = _train_data(tmp_path)
    r = cli("train", model, "--data", data, "--steps", 1, "-o", tmp_path / "t.npz")
    assert r.rc == 2 and "t.npz: the module's weights go to <stem>.npz" in r.err
    assert cli("export", model, "-o", tmp_path / "m.onnx").rc == 0
    r = cli("import", tmp_path / "m.onnx", "-o", tmp_path / "imported.npz")
    assert r.rc == 2 and "name the IR file imported.ir" in r.err
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "m.onnx", "mlp.ir", "mlp.npz", "mlp_inputs.npz", "train.npz"]


def test_train_refuses_a_report_on_its_weights_file_and_weights_on_its_data(cli, tmp_path):
    model = _mlp(tmp_path)
    data = _train_data(tmp_path)
    r = cli("train", model, "--data", data, "--steps", 1, "-o", tmp_path / "t.ir",
            "--report", tmp_path / "t.npz")
    assert r.rc == 2
    assert r.err.splitlines()[-1] == (f"mplower: error: the weights beside -o and --report are "
                                      f"the same file ({tmp_path / 't.npz'}); one would replace "
                                      f"the other")
    before = data.read_bytes()
    r = cli("train", model, "--data", data, "--steps", 1, "-o", tmp_path / "train.ir")
    assert r.rc == 2 and "is the input --data" in r.err
    assert data.read_bytes() == before


def test_opt_refuses_to_write_pruned_weights_over_the_weights_its_input_reads(cli, tmp_path):
    model = _mlp(tmp_path)
    # `-o mlp2.ir` puts the pruned weights in mlp2.npz, which this input reads its weights from
    text = model.read_text().replace('"mlp.npz"', '"mlp2.npz"')
    (tmp_path / "a.ir").write_text(text)
    shutil.copy(tmp_path / "mlp.npz", tmp_path / "mlp2.npz")
    before = (tmp_path / "mlp2.npz").read_bytes()
    r = cli("opt", tmp_path / "a.ir", "-p", "sparsify", "-o", tmp_path / "mlp2.ir")
    assert r.rc == 2
    assert r.err.splitlines()[-1] == (f"mplower: error: the output {tmp_path / 'mlp2.npz'} is "
                                      f"the weights file of the input module; mplower does not "
                                      f"write over an input of the command")
    assert (tmp_path / "mlp2.npz").read_bytes() == before
    assert not (tmp_path / "mlp2.ir").exists() and _stage_files(tmp_path) == []


def test_opt_in_place_replaces_the_module_and_its_weights_together(cli, tmp_path):
    model = _mlp(tmp_path)
    original = np.load(tmp_path / "mlp.npz")["fc1.weight"]
    assert cli("opt", model, "-p", "sparsify{pattern=1:2}", "-o", model).rc == 0
    pruned = np.load(tmp_path / "mlp.npz")["fc1.weight"]
    assert np.count_nonzero(pruned) == original.size // 2
    assert 'mp.weights = "mlp.npz"' in model.read_text()


# ---- a failed command changes no existing file ------------------------------------------------

def test_failed_opt_leaves_the_weights_an_earlier_pass_wrote_unwritten(cli, tmp_path):
    model = _mlp(tmp_path)
    old = _old_files(tmp_path, ["out.ir", "out.npz"])
    r = cli("opt", model, "-p", "sparsify", "-p", "assign-precision{policy=missing.toml}",
            "-o", tmp_path / "out.ir")
    assert r.rc == 1 and "missing.toml: error: no such policy file" in r.err
    assert _contents(tmp_path, list(old)) == old
    assert _stage_files(tmp_path) == []


def test_a_later_pass_reads_the_weights_an_earlier_pass_staged(cli, tmp_path):
    model = _mlp(tmp_path)
    _old_files(tmp_path, ["out.npz"])  # not a weights file: reading it would fail
    assert cli("opt", model, "-p", "sparsify", "-p", "sparsify", "-o", tmp_path / "out.ir"
               ).rc == 0
    assert cli("opt", model, "-p", "sparsify", "-o", tmp_path / "once.ir").rc == 0
    with np.load(tmp_path / "out.npz") as w, np.load(tmp_path / "once.npz") as once, \
            np.load(tmp_path / "mlp.npz") as w0:
        groups = w["fc1.weight"].T.reshape(-1, 4)  # 2:4 along the reduction axis (x @ W: 0)
        assert (np.count_nonzero(groups, axis=1) == 2).all()
        assert all(np.array_equal(w[k], once[k]) for k in w0)  # pruning 2:4 again keeps it
        assert np.array_equal(w["fc1.bias"], w0["fc1.bias"])


def test_failed_train_keeps_report_plot_and_weights_byte_identical(cli, tmp_path, monkeypatch):
    from mplower.train import trainer

    model = _mlp(tmp_path)
    data = _train_data(tmp_path)
    (tmp_path / "t.ir").mkdir()  # -o is a folder: the module cannot be written
    old = _old_files(tmp_path, ["t.npz", "r.json", "p.png"])
    monkeypatch.setattr(trainer, "fit", lambda *a: pytest.fail("trained before the check"))
    r = cli("train", model, "--data", data, "--steps", 1, "-o", tmp_path / "t.ir",
            "--report", tmp_path / "r.json", "--plot", tmp_path / "p.png")
    message = f"{tmp_path / 't.ir'}: error: cannot write output: Is a directory\n"
    assert (r.rc, r.err) == (1, message)
    assert _contents(tmp_path, list(old)) == old


def test_train_with_a_missing_output_folder_fails_before_any_step(cli, tmp_path, monkeypatch):
    from mplower.train import trainer

    model = _mlp(tmp_path)
    data = _train_data(tmp_path)
    monkeypatch.setattr(trainer, "fit", lambda *a: pytest.fail("trained before the check"))
    out = tmp_path / "missing" / "t.ir"
    r = cli("train", model, "--data", data, "--steps", 1, "-o", out)
    message = f"{out}: error: cannot write output: No such file or directory\n"
    assert (r.rc, r.err) == (1, message)


# ---- a terminated or killed command: the old set or the new set -------------------------------

def _train_args(tmp_path: Path) -> list[object]:
    return ["train", _mlp(tmp_path), "--data", _train_data(tmp_path), "--steps", 1,
            "-o", tmp_path / "t.ir", "--report", tmp_path / "r.json",
            "--plot", tmp_path / "p.png"]


TRAIN_OUTPUTS = ["t.ir", "t.npz", "r.json", "p.png"]


def test_sigterm_before_trains_commit_leaves_the_old_set_and_no_stage_file(tmp_path):
    args = _train_args(tmp_path)
    old = _old_files(tmp_path, TRAIN_OUTPUTS)
    proc = _paused(*args)
    assert len(_stage_files(tmp_path)) == 4
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and b"Traceback" not in err
    assert _contents(tmp_path, TRAIN_OUTPUTS) == old
    assert _stage_files(tmp_path) == []


def test_sigkill_before_trains_commit_leaves_the_old_set_and_the_next_run_cleans_up(cli,
                                                                                   tmp_path):
    args = _train_args(tmp_path)
    old = _old_files(tmp_path, TRAIN_OUTPUTS)
    proc = _paused(*args)
    proc.kill()
    proc.communicate(timeout=120)
    assert _contents(tmp_path, TRAIN_OUTPUTS) == old
    left = _stage_files(tmp_path)
    assert len(left) == 4 and all(n.startswith(".") and n.endswith(".tmp") for n in left)
    # Only the killed run needs a process of its own; the next one runs in this one.
    r = cli(*args)
    assert r.rc == 0, r.err
    new = _contents(tmp_path, TRAIN_OUTPUTS)
    assert all(new[n] != old[n] for n in TRAIN_OUTPUTS) and new["p.png"].startswith(PNG)
    assert _stage_files(tmp_path) == []


def _tune_args(tmp_path: Path, out: Path, *extra: str) -> list[object]:
    return ["tune", _mlp(tmp_path), "--target", "h100", "--data", tmp_path / "mlp_inputs.npz",
            "--formats", "bf16", *extra, "-o", out]


FAILING = ("--guardrail", "max_rel_l2=1e-9", "--budget", "3")  # no plan can meet it: exit 3


def _release(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_killed_tune_leaves_the_old_release_whole_and_the_next_run_swaps_in_a_new_one(cli,
                                                                                     tmp_path):
    out = tmp_path / "rel"
    args = _tune_args(tmp_path, out, "--budget", "5")
    # Only the killed runs need processes of their own; the others run in this one.
    first = cli(*args)
    assert first.rc == 0, first.err
    old = _release(out)
    assert sorted(old) == ["lowered.ir", "lowered.npz", "pareto.png", "policy.toml", "tune.json"]
    for kill in (lambda p: p.send_signal(signal.SIGTERM), lambda p: p.kill()):
        proc = _paused(*_tune_args(tmp_path, out, *FAILING))
        kill(proc)
        proc.communicate(timeout=120)
        assert _release(out) == old
    assert len(_stage_files(tmp_path)) == 1  # the SIGKILLed run's stage folder
    again = cli(*_tune_args(tmp_path, out, *FAILING))
    assert again.rc == 3, again.err
    assert _stage_files(tmp_path) == []
    assert sorted(_release(out)) == ["pareto.png", "tune.json"]


def test_tune_exit_3_replaces_the_release_and_leaves_no_earlier_plan_beside_it(cli, tmp_path):
    out = tmp_path / "rel"
    assert cli(*_tune_args(tmp_path, out, "--budget", "5")).rc == 0
    assert (out / "policy.toml").exists()
    r = cli(*_tune_args(tmp_path, out, *FAILING))
    assert r.rc == 3
    assert sorted(p.name for p in out.iterdir()) == ["pareto.png", "tune.json"]
    packet = json.loads((out / "tune.json").read_text())
    assert packet["chosen"] is None and packet["evaluations"]["budget"] == 3
    assert _stage_files(tmp_path) == []


def test_tune_refuses_a_folder_of_other_files_and_inputs_inside_its_folder(cli, tmp_path):
    model = _mlp(tmp_path)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    r = cli("tune", model, "--target", "h100", "--data", tmp_path / "mlp_inputs.npz",
            "-o", notes)
    assert r.rc == 2 and "holds files but no tune.json" in r.err
    assert (notes / "todo.txt").read_text() == "mine"
    release = tmp_path / "rel"  # an earlier release that holds the model to tune
    release.mkdir()
    (release / "tune.json").write_text("{}")
    for name in ("mlp.ir", "mlp.npz"):
        shutil.copy(tmp_path / name, release / name)
    r = cli("tune", release / "mlp.ir", "--target", "h100", "--data",
            tmp_path / "mlp_inputs.npz", "-o", release)
    assert r.rc == 2 and f"{release / 'mlp.ir'} is inside -o {release}, which tune replaces " \
                         f"whole" in r.err
    assert sorted(p.name for p in release.iterdir()) == ["mlp.ir", "mlp.npz", "tune.json"]


# ---- `-` is stdout for every output -----------------------------------------------------------

def test_dash_writes_binary_outputs_to_a_pipe_and_no_file_named_dash(tmp_path):
    model = _mlp(tmp_path)
    inputs = tmp_path / "mlp_inputs.npz"
    png = _mplower("run", model, "--inputs", inputs, "--plot", "-", cwd=tmp_path)
    assert png.returncode == 0, png.stderr
    assert png.stdout.startswith(PNG)  # the PNG alone: the report table gave stdout up
    outs = _mplower("run", model, "--inputs", inputs, "--save-outputs", "-", cwd=tmp_path)
    assert outs.returncode == 0, outs.stderr
    expected = np.load(ROOT / "ir_examples" / "mlp_expected.npz")
    with np.load(io.BytesIO(outs.stdout)) as got:
        assert sorted(got) == ["output_0"]
        np.testing.assert_allclose(got["output_0"], next(iter(expected.values())), rtol=1e-5,
                                   atol=1e-6)
    exported = _mplower("export", model, "-o", "-", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    graph = onnx.load_from_string(exported.stdout).graph
    assert [i.name for i in graph.input] == ["x"]
    assert not (tmp_path / "-").exists() and not (tmp_path / "-.npz").exists()


def test_dash_for_a_binary_output_on_a_terminal_is_a_usage_error(tmp_path):
    model = _mlp(tmp_path)
    main, tty = pty.openpty()
    try:
        r = subprocess.run([sys.executable, "-m", "mplower", "export", str(model), "-o", "-"],
                           check=False, stdout=tty, stderr=subprocess.PIPE, cwd=tmp_path,
                           timeout=600)
    finally:
        os.close(tty)
        os.close(main)
    assert r.returncode == 2
    assert r.stderr.decode().splitlines()[-1] == (
        "mplower: error: -o -: binary output goes to stdout only through a pipe or a "
        "redirection, not to a terminal")
    assert not (tmp_path / "-").exists()


def test_dash_is_stdout_for_one_output_at_a_time_and_never_a_folder(cli, tmp_path):
    model = _mlp(tmp_path)
    r = cli("run", model, "--report", "-", "--plot", "-")
    assert r.rc == 2 and r.out == ""
    assert r.err.splitlines()[-1] == ("mplower: error: --report and --plot both write to "
                                      "stdout ('-'); give all but one of them a file")
    assert cli("export", model, "-o", tmp_path / "m.onnx").rc == 0
    r = cli("import", tmp_path / "m.onnx", "-o", "-")
    assert r.rc == 2 and "-o needs a file, not '-'" in r.err
    r = cli("tune", model, "--target", "h100", "--data", tmp_path / "mlp_inputs.npz", "-o", "-")
    assert r.rc == 2 and "-o needs a folder, not '-'" in r.err
    r = cli("run", model, "--inputs", tmp_path / "mlp_inputs.npz", "--report", "-")
    assert r.rc == 0 and json.loads(r.out)["summary"]["ops"] > 0
    assert not (tmp_path / "-").exists()
