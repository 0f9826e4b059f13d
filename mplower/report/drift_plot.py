"""`mplower run --plot`: the ops with the most drift, and their overflow, as a bar chart.

One row per op, worst first, at most `TOP` rows (constants left out, as in the report's table):
ops whose result is not finite where the reference is (overflow to inf, NaN) first, marked
with a red triangle, then by rel_l2 against the fp32 reference, then by overflow count. The
rows are horizontal so that names stay readable at any model size: the left panel is each op's
rel_l2 on a log axis (an exact op or an integer result has no bar), the right one its overflow
count on an integer axis. The title says how many of the model's ops are shown. matplotlib is
imported only here, and only when a plot is asked for; the figure is drawn without pyplot (no
global state, no display) and returned as PNG bytes, which the caller writes atomically.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DriftPlot:
    """What the chart shows, read back from its bars: per op its name, rel_l2 (None where the
    report has none) and overflow count, and the PNG."""

    names: tuple[str, ...]
    rel_l2: tuple[float | None, ...]
    overflow: tuple[int, ...]
    png: bytes
    not_finite: tuple[int, ...] = ()  # positions marked with the red triangle


TOP = 30  # rows: a 200-op model's chart stays readable


def _decade(x: float) -> int:
    """The power of ten at or below x > 0 (the exponent of its scientific notation)."""
    k = int(f"{x:e}".split("e")[1])
    return k - 1 if 10.0 ** k > x else k  # 9.9999996e-2 prints as 1.000000e-01


def _worst_first(ops: list[dict[str, Any]]) -> list[int]:
    def key(i: int) -> tuple:
        o = ops[i]
        bad = o["rel_l2"] is None and bool(o["nonfinite_mismatch"])
        return (not bad, -(o["rel_l2"] or 0.0), -o["overflow"], i)
    return sorted(range(len(ops)), key=key)


def plot_drift(report: dict[str, Any], title: str = "", top: int = TOP) -> DriftPlot:
    """The drift chart of a run report (mplower.report.run.build_report): its `top` worst
    ops, worst first (the order of the returned fields)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    every = [o for o in report["ops"] if o["op"] != "mp.constant"]
    ops = [every[i] for i in _worst_first(every)[:top]]
    names = [o["name"] for o in ops]
    y = list(range(len(ops)))
    fig = Figure(figsize=(10.0, 1.6 + 0.3 * max(len(ops), 1)), layout="constrained")
    FigureCanvasAgg(fig)
    drift_ax, over_ax = fig.subplots(1, 2, sharey=True, width_ratios=(3, 1))
    # An exact op (rel_l2 0) or one without a finite drift gets no bar: a log axis has no 0.
    widths = [o["rel_l2"] if o["rel_l2"] else 0.0 for o in ops]
    drift_bars = drift_ax.barh(y, widths, color="tab:blue")
    if any(widths):  # whole decades, so that a bar's length reads against the axis
        positive = [w for w in widths if w > 0]
        drift_ax.set_xscale("log")
        lo, hi = _decade(min(positive)), _decade(max(positive))
        drift_ax.set_xlim(10.0 ** lo, 10.0 ** (hi if max(positive) == 10.0 ** hi else hi + 1))
    drift_ax.set_xlabel("rel_l2 vs fp32 (log)")
    drift_ax.set_yticks(y, names, fontsize=8)
    drift_ax.invert_yaxis()  # worst on top
    # rel_l2 is also null for an integer result (an index, a mask, an i8 kernel), which has
    # no drift to draw; only a result that is not finite where the reference is gets marked.
    missing = [i for i, o in enumerate(ops) if o["rel_l2"] is None and o["nonfinite_mismatch"]]
    if missing:
        right = max((w for w in widths if w), default=1.0)
        drift_ax.plot([right] * len(missing), missing, "<", color="tab:red",
                      label="drift not finite (overflow, NaN)")
        drift_ax.legend(loc="lower right", fontsize=8)
    counts = [o["overflow"] for o in ops]
    over_bars = over_ax.barh(y, counts, color="tab:red")
    over_ax.set_xlabel("overflow count")
    over_ax.set_xlim(0, max(max(counts, default=0), 1) * 1.05)
    over_ax.xaxis.get_major_locator().set_params(integer=True)
    s = report["summary"]
    drift = "-" if s["output_rel_l2"] is None else f"{s['output_rel_l2']:.3g}"
    shown = f"{len(ops)} of {len(every)} ops, worst first"
    fig.suptitle(f"{title}{': ' if title else ''}verdict {s['verdict']}, output rel_l2 "
                 f"{drift}, overflow {s['overflow']} ({shown})", fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    drawn = [b.get_width() for b in drift_bars]
    return DriftPlot(
        names=tuple(names),
        rel_l2=tuple(None if o["rel_l2"] is None else drawn[i] for i, o in enumerate(ops)),
        overflow=tuple(int(b.get_width()) for b in over_bars),
        png=buf.getvalue(), not_finite=tuple(missing))
