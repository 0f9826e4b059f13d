"""Runs the lit + FileCheck suite under tests/lit, one pytest case per lit file.

lit runs once for the whole folder (its workers run the files in parallel) and each case reads
its own file's result: one lit process per file cost a lit start-up per file and kept the
`mplower` processes of the RUN lines on one core.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

LIT_ROOT = Path(__file__).parent / "lit"
CASES = sorted(p for p in LIT_ROOT.rglob("*") if p.suffix in (".ir", ".mlir")
               and "Output" not in p.parts)


@pytest.fixture(scope="module")
def lit_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str | None], str]:
    """{file relative to tests/lit: None if it passed, else lit's report of it}, and lit's
    output (for a file lit did not report on)."""
    report = tmp_path_factory.mktemp("lit") / "lit.xml"
    proc = subprocess.run([sys.executable, "-c", "from lit.main import main; main()", "-v",
                           "--no-progress-bar", f"--xunit-xml-output={report}", str(LIT_ROOT)],
                          capture_output=True, text=True, timeout=1800, check=False)
    output = proc.stdout[-6000:] + proc.stderr[-2000:]
    results: dict[str, str | None] = {}
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            # lit names a case by its folder (dots for slashes, after the suite's name) and file.
            folder = case.get("classname", "").split(".", 1)[1:]
            rel = "/".join(folder[0].split(".") + [case.get("name", "")]) if folder \
                else case.get("name", "")
            failure = case.find("failure")
            results[rel] = None if failure is None and case.find("skipped") is None else (
                (failure.text or "failed") if failure is not None else "skipped")
    return results, output


@pytest.mark.parametrize("case", CASES, ids=lambda p: str(p.relative_to(LIT_ROOT)))
def test_lit(case: Path, lit_results: tuple[dict[str, str | None], str]) -> None:
    results, output = lit_results
    rel = case.relative_to(LIT_ROOT).as_posix()
    assert rel in results, f"lit did not report on {rel}:\n{output}"
    assert results[rel] is None, results[rel][-6000:]
