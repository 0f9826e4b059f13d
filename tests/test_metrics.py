"""One metric, one table renderer, one list of guardrail keys (issue 11, item 6).

The figures of mplower.numerics.metrics are checked against numpy written out here; the
source checks keep the SQNR formula and the text-table layout from being written a second
time outside their modules.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from mplower.lowering.policy import GUARDRAILS
from mplower.numerics.metrics import channel_sqnr_db, drift, sqnr_db
from mplower.report.run import SCHEMA_PATH, evaluate_guardrails
from mplower.report.table import table

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "mplower").rglob("*.py"), *(ROOT / "passes").rglob("*.py")])


def _grep(pattern: str, allowed: set[str]) -> list[str]:
    found = []
    for path in SOURCES:
        rel = path.relative_to(ROOT).as_posix()
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(pattern, line) and rel not in allowed:
                found.append(f"{rel}:{i}")
    return found


def test_sqnr_is_computed_only_in_numerics_metrics():
    assert _grep(r"log10\(", {"mplower/numerics/metrics.py"}) == []


def test_text_tables_are_laid_out_only_by_report_table():
    # docgen's markdown tables are documentation pages, not report output.
    assert _grep(r"\.ljust\(|\"\|---\|\"", {"mplower/report/table.py"}) == []


def test_sqnr_of_a_converted_value_matches_numpy_and_is_minus_inf_on_any_nonfinite():
    ref = np.array([1.0, -2.0, 3.0, 0.5], np.float32)
    y = np.array([1.1, -2.0, 2.9, 0.5], np.float32)
    r, d = ref.astype(np.float64), y.astype(np.float64) - ref.astype(np.float64)
    assert sqnr_db(y, ref) == pytest.approx(10 * np.log10(np.sum(r * r) / np.sum(d * d)),
                                            rel=1e-15)
    assert sqnr_db(ref, ref) == math.inf
    assert sqnr_db(np.ones(2), np.zeros(2)) == -math.inf  # no signal: nothing was kept
    # Unlike the run report's drift, a shared -inf (a mask) counts as lost here.
    masked = np.array([1.0, -np.inf])
    with np.errstate(invalid="ignore"):
        assert sqnr_db(masked, masked) == -math.inf
    assert drift(masked, masked).sqnr_db == math.inf
    assert sqnr_db(y, ref[:3]) is None and sqnr_db(None, ref) is None


def test_channel_sqnr_is_the_worst_channel_with_signal():
    ref = np.array([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]])  # channel 1 has no signal: skipped
    y = np.array([[1.0, 2.5], [0.1, 0.0], [3.0, 4.0]])
    want = 10 * np.log10((1.0 + 4.0) / 0.25)
    assert channel_sqnr_db(y, ref, 0) == pytest.approx(want, rel=1e-15)
    assert channel_sqnr_db(y, ref.T.copy(), 1) is None  # shapes differ
    assert channel_sqnr_db(np.zeros((2, 2)), np.zeros((2, 2)), 0) is None


def test_drift_matches_numpy_on_finite_values():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(100)
    y = ref + rng.standard_normal(100) * 1e-3
    d = drift(y, ref)
    assert d.rel_l2 == pytest.approx(np.linalg.norm(y - ref) / np.linalg.norm(ref), rel=1e-12)
    assert d.max_abs == np.max(np.abs(y - ref))
    assert d.sqnr_db == pytest.approx(-20 * np.log10(d.rel_l2), rel=1e-12)
    assert d.nonfinite_mismatch == 0


def test_every_guardrail_limits_the_summary_figure_it_names():
    summary = {"output_rel_l2": 0.5, "sqnr_db": 12.0, "overflow": 3, "overflow_rate": 0.25,
               "top1_agreement": 0.75}
    limits = dict.fromkeys(GUARDRAILS, 1.0)
    got = {k: g["value"] for k, g in evaluate_guardrails(limits, summary).items()}
    assert got == {"max_rel_l2": 0.5, "min_sqnr_db": 12.0, "max_overflow": 3,
                   "max_overflow_rate": 0.25, "min_top1_agreement": 0.75}


def test_report_schema_allows_exactly_the_guardrail_keys():
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    guardrails = schema["properties"]["summary"]["properties"]["guardrails"]
    assert tuple(guardrails["propertyNames"]["enum"]) == GUARDRAILS


def test_table_aligns_text_and_escapes_markdown_cells():
    rows = [["%a", "x|y"], ["%long_name", "-"]]
    assert table(["name", "v"], rows, "table", rule=True) == [
        "name        v", "----------  ---", "%a          x|y", "%long_name  -"]
    assert table(["name", "v"], rows, "markdown") == [
        "| name | v |", "|---|---|", "| %a | x\\|y |", "| %long_name | - |"]
    assert table(["name", "v"], [], "table") == ["name  v"]
