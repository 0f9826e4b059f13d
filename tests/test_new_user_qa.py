"""Findings of a new-user pass over tune, train, target measure, import and export: each test
pins one promise of the docs that the first try broke."""

from __future__ import annotations

import shutil
from pathlib import Path

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
