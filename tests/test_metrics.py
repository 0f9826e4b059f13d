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
from mplower.numerics.metrics import allclose_ratio, channel_sqnr_db, drift, sqnr_db
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


SUMMARY = {"output_rel_l2": 0.5, "sqnr_db": 12.0, "overflow": 3, "overflow_rate": 0.25,
           "top1_agreement": 0.75, "allclose_ratio": 0.125, "metric": -2.0,
           "metric_drop": 0.375, "metric_drop_rel": 0.0625}


def test_every_guardrail_limits_the_summary_figure_it_names():
    limits = dict.fromkeys(GUARDRAILS, 1.0)
    got = {k: g["value"] for k, g in evaluate_guardrails(limits, SUMMARY).items()}
    # rtol and atol are one check, reported as max_allclose_ratio
    assert got == {"max_rel_l2": 0.5, "min_sqnr_db": 12.0, "max_overflow": 3,
                   "max_overflow_rate": 0.25, "min_top1_agreement": 0.75,
                   "max_allclose_ratio": 0.125, "min_metric": -2.0, "max_metric": -2.0,
                   "max_metric_drop": 0.375, "max_metric_drop_rel": 0.0625}


def test_report_schema_allows_exactly_the_reported_guardrail_keys():
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    guardrails = schema["properties"]["summary"]["properties"]["guardrails"]
    # With NaN or inf where the reference is finite, the non-finite check is reported too.
    reported = evaluate_guardrails(dict.fromkeys(GUARDRAILS, 1.0),
                                   {**SUMMARY, "nonfinite_mismatch": 2})
    assert tuple(guardrails["propertyNames"]["enum"]) == tuple(reported)


@pytest.mark.parametrize("limits,entry", [
    ({"rtol": 0.01, "atol": 0.001},
     {"limit": 1.0, "value": 0.125, "ok": True, "rtol": 0.01, "atol": 0.001}),
    ({"rtol": 0.01}, {"limit": 1.0, "value": 0.125, "ok": True, "rtol": 0.01, "atol": 0.0}),
    ({"atol": 0.5}, {"limit": 1.0, "value": 0.125, "ok": True, "rtol": 0.0, "atol": 0.5}),
])
def test_rtol_and_atol_are_one_allclose_guardrail_the_missing_one_zero(limits, entry):
    assert evaluate_guardrails(limits, SUMMARY) == {"max_allclose_ratio": entry}
    failing = evaluate_guardrails(limits, {**SUMMARY, "allclose_ratio": 1.5})
    assert failing["max_allclose_ratio"]["ok"] is False


@pytest.mark.parametrize("rtol,atol", [(0.01, 0.001), (1e-3, 0.0), (0.0, 1e-4), (0.05, 1e-6)])
def test_allclose_ratio_is_the_scale_at_which_numpy_allclose_starts_to_hold(rtol, atol):
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((7, 9)) * np.logspace(-3, 2, 9)
    y = ref * (1 + rng.standard_normal(ref.shape) * 1e-3) + rng.standard_normal(ref.shape) * 1e-5
    v = allclose_ratio(y, ref, rtol, atol)
    want = np.max(np.abs(y - ref) / (atol + rtol * np.abs(ref)))  # written out, float64
    assert v == want
    assert np.allclose(y, ref, rtol * v * (1 + 1e-9), atol * v * (1 + 1e-9))
    assert not np.allclose(y, ref, rtol * v * (1 - 1e-9), atol * v * (1 - 1e-9))
    assert (v <= 1) == np.allclose(y, ref, rtol, atol)


@pytest.mark.parametrize("y,ref,rtol,atol,want", [
    ([np.inf, -np.inf, 1.0], [np.inf, -np.inf, 1.0], 0.01, 0.0, 0.0),  # same infinities: exact
    ([np.inf], [-np.inf], 0.01, 0.001, math.inf),
    ([np.inf], [1.0], 0.01, 0.001, math.inf),
    ([1.0], [np.inf], 0.01, 0.001, math.inf),
    ([np.nan], [np.nan], 0.01, 0.001, math.inf),  # numpy.allclose: NaN is never close
    ([0.0, 2.0], [0.0, 2.0], 0.0, 0.0, 0.0),  # zero tolerance: exact passes
    ([1e-30], [0.0], 0.01, 0.0, math.inf),  # zero tolerance at ref 0: any difference fails
    (np.float32(1.5), np.float32(1.0), 0.25, 0.25, 1.0),  # 0-d arrays, exactly at the limit
])
def test_allclose_ratio_of_special_values_agrees_with_numpy_allclose(y, ref, rtol, atol, want):
    v = allclose_ratio(np.asarray(y), np.asarray(ref), rtol, atol)
    assert v == want
    assert (v <= 1) == bool(np.allclose(np.asarray(y, np.float64), np.asarray(ref, np.float64),
                                        rtol, atol))


def test_table_aligns_text_and_escapes_markdown_cells():
    rows = [["%a", "x|y"], ["%long_name", "-"]]
    assert table(["name", "v"], rows, "table", rule=True) == [
        "name        v", "----------  ---", "%a          x|y", "%long_name  -"]
    assert table(["name", "v"], rows, "markdown") == [
        "| name | v |", "|---|---|", "| %a | x\\|y |", "| %long_name | - |"]
    assert table(["name", "v"], [], "table") == ["name  v"]
