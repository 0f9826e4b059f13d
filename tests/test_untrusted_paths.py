"""Untrusted paths and values (issue 10, section 4).

- A module's `mp.policy` and `mp.target` are confined like `mp.weights`: relative to the IR
  file's folder, never outside it; a file named on the command line may be anywhere.
- `opt -o` into another folder leaves a module that runs there: the files it names are
  recorded from the output's folder, copied beside it when they are outside.
- Inputs: a finite value that the argument's type cannot hold is refused after the cast; NaN
  and inf as written run; drift leaves out matching infinities and counts mismatches.
- TOML sheets refuse NaN, inf and absurd numbers at their location; JSON output is strict.
- SIGTERM and SIGHUP while writing leave no temporary file and the previous output.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from mplower.ir.diagnostics import DiagnosticError
from mplower.lowering.policy import load_policy
from mplower.lowering.target import load_target

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "ir_examples"
BF16_SHEET = (ROOT / "mplower" / "policies" / "bf16.toml").read_text()
H100_SHEET = (ROOT / "mplower" / "targets" / "h100.toml").read_text()

MATMUL_IR = """module @m attributes {mp.weights = "w.npz"%s} {
  func.func @main(%%x: tensor<4x8xf32>) -> tensor<4x3xf32> {
    %%w = mp.constant {name = "w"} : () -> tensor<8x3xf32>
    %%y = mp.matmul %%x, %%w : (tensor<4x8xf32>, tensor<8x3xf32>) -> tensor<4x3xf32>
    return %%y : tensor<4x3xf32>
  }
}
"""
# What a TOML error would show of a file it read: a test checks it never reaches the user.
SECRET = "SECRET-LINE = ["


def matmul_model(folder: Path, attrs: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "m.ir").write_text(MATMUL_IR % attrs)
    rng = np.random.default_rng(0)
    np.savez(folder / "w.npz", w=rng.standard_normal((8, 3)).astype(np.float32))
    return folder / "m.ir"


def strict_json(text: str) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"bare {name} in JSON")

    return json.loads(text, parse_constant=refuse)


def unnamed_sheet(text: str, **replace: str) -> str:
    """A built-in sheet without its `name` line (so its name is its file stem), with some lines
    replaced by key."""
    lines = []
    for line in text.splitlines():
        key = line.split("=")[0].strip()
        if key == "name":
            continue
        lines.append(f"{key} = {replace[key]}" if key in replace else line)
    return "\n".join(lines) + "\n"


# ---- confinement -------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_mp_policy_outside_the_model_folder_is_refused_without_showing_the_file(
        cli, tmp_path, where) -> None:
    secret = tmp_path / "secret.toml"
    secret.write_text(SECRET + "\n")
    value = str(secret) if where == "absolute" else "../secret.toml"
    model = matmul_model(tmp_path / "models", f', mp.policy = "{value}"')
    res = cli("run", model)
    assert res.rc == 1
    col = model.read_text().index("mp.policy") + 1  # located at the attribute
    assert res.err.splitlines()[0] == (
        f"{model}:1:{col}: error: mp.policy '{value}' leaves the model's folder {model.parent}; "
        f"give its guardrails with --guardrail KEY=VALUE instead")
    assert "SECRET" not in res.err + res.out and "Traceback" not in res.err


def test_mp_target_outside_the_model_folder_is_refused(cli, tmp_path) -> None:
    (tmp_path / "t.toml").write_text(SECRET + "\n")
    model = matmul_model(tmp_path / "models", ', mp.target = "../t.toml"')
    col = model.read_text().index("mp.target") + 1  # located at the attribute
    for command in ("report", "bench"):
        res = cli(command, model)
        assert res.rc == 1
        assert res.err.splitlines()[0] == (
            f"{model}:1:{col}: error: mp.target '../t.toml' leaves the model's folder "
            f"{model.parent}; pass --target to use it deliberately")
        assert "SECRET" not in res.err + res.out
    # Named on the command line, a sheet may be anywhere.
    (tmp_path / "t.toml").write_text(unnamed_sheet(H100_SHEET))
    res = cli("report", model, "--target", tmp_path / "t.toml", "--format", "json")
    assert res.rc == 0 and json.loads(res.out)["target"] == "t"


def test_mp_target_resolves_against_the_ir_files_folder_not_the_current_one(
        cli, tmp_path, monkeypatch) -> None:
    model = matmul_model(tmp_path / "models", ', mp.target = "mine.toml"')
    (model.parent / "mine.toml").write_text(unnamed_sheet(H100_SHEET))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    res = cli("report", model, "--format", "json")
    assert res.rc == 0, res.err
    assert json.loads(res.out)["target"] == "mine"


def test_policy_named_on_the_command_line_may_be_anywhere(cli, tmp_path) -> None:
    sheet = tmp_path / "sheets" / "mine.toml"
    sheet.parent.mkdir()
    sheet.write_text(unnamed_sheet(BF16_SHEET))
    model = matmul_model(tmp_path / "models")
    res = cli("opt", model, f"--pass=assign-precision{{policy={sheet}}}")
    assert res.rc == 0, res.err
    # Printed, the module lives in its input's folder; the sheet is outside it, so the path is
    # absolute, which `mplower run` of that module would refuse (use -o to carry it along).
    assert f'mp.policy = "{sheet}"' in res.out


# ---- opt -o into another folder ----------------------------------------------------------


def test_lowered_module_with_a_policy_sheet_runs_from_another_folder(
        cli, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("mlp.ir", "mlp.npz"):
        (tmp_path / name).write_bytes((EXAMPLES / name).read_bytes())
    Path("mypol.toml").write_text(unnamed_sheet(BF16_SHEET, max_rel_l2="1e-9"))
    Path("sub").mkdir()
    assert cli("opt", "mlp.ir", "--pass=assign-precision{policy=mypol.toml}",
               "-o", "sub/lowered.ir").rc == 0
    text = Path("sub/lowered.ir").read_text()
    assert 'attributes {mp.weights = "lowered.npz", mp.policy = "lowered.policy.toml"}' in text
    assert Path("sub/lowered.npz").read_bytes() == Path("mlp.npz").read_bytes()
    copy = Path("sub/lowered.policy.toml").read_text()
    assert copy.replace('name = "mypol"\n', "") == Path("mypol.toml").read_text()
    # The sheet's guardrail (1e-9) is what fails the check: the run read the copied sheet.
    res = cli("run", "sub/lowered.ir", "--check", "--format", "json")
    assert res.rc == 3, res.err
    report = json.loads(res.out)
    assert report["policy"] == "lowered.policy.toml"
    assert report["summary"]["guardrails"]["max_rel_l2"]["limit"] == 1e-9
    # Moved elsewhere with its folder, it still runs.
    monkeypatch.chdir(tmp_path / "sub")
    assert cli("run", "lowered.ir", "--guardrail", "max_rel_l2=0.05", "--check").rc == 0


def test_opt_o_into_another_folder_keeps_the_weights_found(cli, tmp_path) -> None:
    model = matmul_model(tmp_path / "a")
    out = tmp_path / "b" / "m2.ir"
    out.parent.mkdir()
    assert cli("opt", model, "-o", out).rc == 0
    assert 'mp.weights = "m2.npz"' in out.read_text()
    assert cli("run", out).rc == 0
    # A file inside the output's folder is named from there, not copied.
    up = tmp_path / "m3.ir"
    assert cli("opt", model, "-o", up).rc == 0
    assert 'mp.weights = "a/w.npz"' in up.read_text()
    assert not (tmp_path / "m3.npz").exists()
    assert cli("run", up).rc == 0


def test_legalize_target_sheet_is_carried_to_the_output_folder(
        cli, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    matmul_model(tmp_path / "a")
    Path("mytarget.toml").write_text(unnamed_sheet(H100_SHEET))
    Path("b").mkdir()
    assert cli("opt", "a/m.ir", "--pass=assign-precision", "--pass=legalize{target=mytarget.toml}",
               "-o", "b/low.ir").rc == 0
    assert 'mp.target = "low.target.toml"' in Path("b/low.ir").read_text()
    monkeypatch.chdir(tmp_path / "a")
    res = cli("report", tmp_path / "b" / "low.ir", "--format", "json")
    assert res.rc == 0, res.err
    assert json.loads(res.out)["target"] == "mytarget"


def test_opt_does_not_copy_a_file_the_input_names_outside_its_folder(cli, tmp_path) -> None:
    (tmp_path / "secret.toml").write_text(SECRET + "\n")
    np.savez(tmp_path / "x.npz", w=np.zeros((8, 3), np.float32))
    model = matmul_model(tmp_path / "models", ', mp.policy = "../secret.toml"')
    model.write_text(model.read_text().replace('"w.npz"', '"../x.npz"'))
    out = tmp_path / "out" / "o.ir"
    out.parent.mkdir()
    assert cli("opt", model, "-o", out).rc == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["o.ir"]
    assert 'mp.weights = "../x.npz", mp.policy = "../secret.toml"' in out.read_text()
    res = cli("run", out)
    assert res.rc == 1 and "leaves the model's folder" in res.err


# ---- non-finite values -------------------------------------------------------------------


def test_input_beyond_a_narrow_arguments_range_is_refused_after_the_cast(cli, tmp_path) -> None:
    (tmp_path / "m.ir").write_text(textwrap.dedent("""\
        func.func @main(%x: tensor<2x2xf16>) -> tensor<2x2xf16> {
          %y = mp.relu %x : (tensor<2x2xf16>) -> tensor<2x2xf16>
          return %y : tensor<2x2xf16>
        }
        """))
    np.savez(tmp_path / "in.npz", x=np.array([[1.0, 70000.0], [-np.inf, 65504.0]], np.float32))
    res = cli("run", tmp_path / "m.ir", "--inputs", tmp_path / "in.npz")
    assert res.rc == 1
    assert res.err.splitlines()[0] == (
        f"{tmp_path / 'm.ir'}:1:17: error: input 'x' has 1 finite value that f16 cannot hold "
        f"(largest magnitude 70000, f16 ends at 65504); they would become inf or NaN")


MASK_IR = """module @attn attributes {mp.weights = "w.npz"} {
  func.func @main(%x: tensor<4x8xf32>, %mask: tensor<4x3xf32>) -> tensor<4x3xf32> {
    %w = mp.constant {name = "w"} : () -> tensor<8x3xf32>
    %s = mp.matmul %x, %w : (tensor<4x8xf32>, tensor<8x3xf32>) -> tensor<4x3xf32>
    %y = mp.add %s, %mask : (tensor<4x3xf32>, tensor<4x3xf32>) -> tensor<4x3xf32>
    return %y : tensor<4x3xf32>
  }
}
"""


def test_minus_inf_mask_input_runs_and_drift_covers_the_finite_positions(cli, tmp_path) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 3)).astype(np.float32)
    mask = np.zeros((4, 3), np.float32)
    mask[np.triu_indices(3, 1)] = -np.inf
    (tmp_path / "m.ir").write_text(MASK_IR)
    np.savez(tmp_path / "w.npz", w=w)
    np.savez(tmp_path / "in.npz", x=x, mask=mask)
    low = tmp_path / "low.ir"
    assert cli("opt", tmp_path / "m.ir", "--pass=assign-precision{policy=bf16}", "-o", low).rc == 0
    res = cli("run", low, "--inputs", tmp_path / "in.npz", "--format", "json",
              "--save-outputs", tmp_path / "out.npz")
    assert res.rc == 0, res.err
    summary = strict_json(res.out)["summary"]
    y = np.load(tmp_path / "out.npz")["output_0"].astype(np.float64)
    ref = x.astype(np.float64) @ w.astype(np.float64) + mask  # the reference, by numpy
    finite = np.isfinite(ref)
    assert np.array_equal(np.isinf(y), ~finite)  # the mask's -inf came through
    expected = np.linalg.norm(y[finite] - ref[finite]) / np.linalg.norm(ref[finite])
    assert summary["nonfinite_mismatch"] == 0
    assert summary["output_rel_l2"] == pytest.approx(expected, rel=1e-3)  # f32 vs f64 ref
    assert summary["output_rel_l2"] > 0


def test_drift_counts_nonfinite_mismatches_and_skips_matching_ones() -> None:
    from mplower.backend.executor import drift

    d = drift(np.array([1.5, -np.inf, np.nan, 2.0]), np.array([1.0, -np.inf, np.nan, 2.0]))
    assert (d.rel_l2, d.max_abs, d.nonfinite_mismatch) == (math.sqrt(0.25 / 5.0), 0.5, 0)
    d = drift(np.array([1.0, np.nan, np.inf, 2.0, -np.inf]),
              np.array([1.0, -np.inf, 3.0, np.nan, np.inf]))
    assert (d.rel_l2, d.sqnr_db, d.max_abs, d.nonfinite_mismatch) == (
        math.inf, -math.inf, math.inf, 4)


F16_OVERFLOW_IR = """func.func @main(%x: tensor<2x2xf32>) -> tensor<2x2xf32> {
  %h = mp.cast %x : (tensor<2x2xf32>) -> tensor<2x2xf16>
  %y = mp.cast %h : (tensor<2x2xf16>) -> tensor<2x2xf32>
  return %y : tensor<2x2xf32>
}
"""


def test_overflow_to_inf_is_a_counted_mismatch_and_the_report_is_strict_json(
        cli, tmp_path) -> None:
    (tmp_path / "m.ir").write_text(F16_OVERFLOW_IR)
    x = np.array([[1.0, 1e5], [-1e6, 2.0]], np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    report_path = tmp_path / "r.json"
    res = cli("run", tmp_path / "m.ir", "--inputs", tmp_path / "in.npz", "--format", "json",
              "--report", report_path, "--guardrail", "max_rel_l2=0.5")
    assert res.rc == 0, res.err
    for text in (res.out, report_path.read_text()):
        report = strict_json(text)
        s = report["summary"]
        assert s["nonfinite_mismatch"] == int(np.count_nonzero(np.abs(x) > 65504))
        assert (s["output_rel_l2"], s["sqnr_db"], s["output_max_abs"]) == (None, None, None)
        assert s["guardrails"]["max_rel_l2"] == {"limit": 0.5, "value": None, "ok": False}
        cast = next(o for o in report["ops"] if o["name"] == "%h")
        assert (cast["nonfinite_mismatch"], cast["rel_l2"]) == (2, None)


def test_weights_holding_nan_or_inf_are_listed_in_the_report(cli, tmp_path) -> None:
    model = matmul_model(tmp_path)
    w = np.ones((8, 3), np.float64)
    w[0, 0], w[1, 1], w[2, 2] = np.nan, -np.inf, 1e300  # 1e300 is inf as the f32 it declares
    np.savez(tmp_path / "w.npz", w=w)
    with warnings.catch_warnings():  # inf and NaN are reported, not warned about
        warnings.simplefilter("error", RuntimeWarning)
        res = cli("run", model, "--format", "json")
    assert res.rc == 0, res.err
    assert strict_json(res.out)["summary"]["nonfinite_weights"] == [
        {"name": "%w", "nan": 1, "inf": 2}]
    table = cli("run", model).out
    assert "weights holding NaN/inf: %w (1 NaN, 2 inf)" in table


@pytest.mark.parametrize("value", ["inf", "-inf", "1e400"])
def test_infinite_guardrail_flag_is_a_usage_error(cli, tmp_path, value) -> None:
    res = cli("run", matmul_model(tmp_path), "--guardrail", f"max_rel_l2={value}",
              "--format", "json")
    assert res.rc == 2
    assert res.err.splitlines()[-1] == (
        f"mplower: error: --guardrail max_rel_l2 must be a finite number, not "
        f"{float(value)}")


def test_precision_sheet_json_of_an_empty_function_is_strict(cli, tmp_path) -> None:
    (tmp_path / "e.ir").write_text(
        "func.func @main(%x: tensor<2xf32>) -> tensor<2xf32> {\n  return %x : tensor<2xf32>\n}\n")
    res = cli("report", tmp_path / "e.ir", "--format", "json")
    assert res.rc == 0, res.err
    assert strict_json(res.out)["summary"]["modeled_inferences_per_s"] is None


# ---- numbers in TOML sheets --------------------------------------------------------------


@pytest.mark.parametrize(("line", "message"), [
    ("max_rel_l2 = nan", "'guardrails.max_rel_l2' must be a finite number, not nan"),
    ("max_rel_l2 = inf", "'guardrails.max_rel_l2' must be a finite number, not inf"),
    ("max_overflow = 99999999999999999999",
     ("'guardrails.max_overflow' must be between 0 and 9.0072e+15 values, "
      "not 99999999999999999999")),
    ("max_overflow = 1" + "0" * 400,
     "'guardrails.max_overflow' must be between 0 and 9.0072e+15 values, not 1" + "0" * 36
     + "..."),  # cut to 40 characters, as the IR parser cuts a literal
    ("min_top1_agreement = 1.5",
     "'guardrails.min_top1_agreement' must be between 0 and 1, not 1.5"),
    ("min_sqnr_db = 1e9", "'guardrails.min_sqnr_db' must be between 0 and 1000 dB, not 1000000000.0"),
    ("rtol = -0.01", "'guardrails.rtol' must be between 0 and 1000, not -0.01"),
    ("atol = 1e39", "'guardrails.atol' must be between 0 and 3.40282e+38, not 1e+39"),
], ids=["nan", "inf", "int-beyond-2^53", "int-beyond-f64", "fraction-above-1", "sqnr-1e9",
        "negative-rtol", "atol-beyond-f32"])
def test_absurd_guardrail_in_a_policy_sheet_is_a_located_error(tmp_path, line, message) -> None:
    path = tmp_path / "p.toml"
    path.write_text(f'[policy]\ncompute = "bf16"\n\n[guardrails]\n{line}\n')
    with pytest.raises(DiagnosticError) as info:
        load_policy(str(path))
    d = info.value.diagnostics[0]
    assert (str(d.loc), d.message) == (f"{path}:5:1", message)


TARGET = """[target]
bandwidth = 1e9
overhead_s = 1e-6

[formats.f32]
dense = 1e9
"""


@pytest.mark.parametrize(("old", "new", "line", "message"), [
    ("dense = 1e9", "dense = nan", 6, "'formats.f32.dense' must be a finite number, not nan"),
    ("bandwidth = 1e9", "bandwidth = inf", 2,
     "'target.bandwidth' must be a finite number, not inf"),
    ("bandwidth = 1e9", "bandwidth = 1e30", 2,
     "'target.bandwidth' must be between 1 and 1e+18 bytes/s, not 1e+30"),
    ("overhead_s = 1e-6", "overhead_s = -inf", 3,
     "'target.overhead_s' must be a finite number, not -inf"),
    ("dense = 1e9", "dense = 5e-324", 6,
     "'formats.f32.dense' must be between 1 and 1e+21 FLOP/s, not 5e-324"),
], ids=["dense-nan", "bandwidth-inf", "bandwidth-1e30", "overhead-minus-inf", "dense-subnormal"])
def test_absurd_figure_in_a_target_sheet_is_a_located_error(tmp_path, old, new, line,
                                                           message) -> None:
    path = tmp_path / "t.toml"
    path.write_text(TARGET.replace(old, new) + '\n[default]\ndense = ["f32"]\n')
    with pytest.raises(DiagnosticError) as info:
        load_target(str(path))
    d = info.value.diagnostics[0]
    assert (str(d.loc), d.message) == (f"{path}:{line}:1", message)


# ---- termination while writing -----------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_termination_while_writing_leaves_no_temp_file_and_the_old_output(
        tmp_path, signum) -> None:
    model = matmul_model(tmp_path)
    out = tmp_path / "out.ir"
    out.write_text("previous output\n")
    env = {**os.environ, "MPLOWER_TEST_PAUSE_IN_OUTPUT": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mplower", "opt", str(model), "-o", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # The run pauses once its temporary file exists: wait for that file, not for a time.
        while not list(tmp_path.glob(".out.ir.*.tmp")):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)  # only to yield the CPU; the condition is the file
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, err
    assert b"Traceback" not in err
    assert out.read_text() == "previous output\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.ir", "out.ir", "w.npz"]
