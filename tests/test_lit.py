"""Runs the lit + FileCheck suite under tests/lit, one pytest case per lit file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

LIT_ROOT = Path(__file__).parent / "lit"
CASES = sorted(p for p in LIT_ROOT.rglob("*") if p.suffix in (".ir", ".mlir")
               and "Output" not in p.parts)


@pytest.mark.parametrize("case", CASES, ids=lambda p: str(p.relative_to(LIT_ROOT)))
def test_lit(case: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", "from lit.main import main; main()", "-v",
                           "--no-progress-bar", str(case)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "Passed: 1" in proc.stdout or "Passed  : 1" in proc.stdout, proc.stdout
