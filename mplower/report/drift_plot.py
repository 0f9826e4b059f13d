"""`mplower run --plot`: the run report's per-op drift and overflow as a bar chart.

One bar per executed op (constants left out, as in the report's table), in program order, so the
op where drift jumps or values overflow stands out: the top panel is each op's rel_l2 against
the fp32 reference on a log scale (an exact op or an integer result has no bar; an op whose
drift is not finite, say because it overflowed to inf, is marked with a red triangle at the
top), the bottom panel its
overflow count. matplotlib is imported only here, and only when a plot is asked for; the figure
is drawn without pyplot (no global state, no display) and returned as PNG bytes, which the
caller writes atomically.
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


def plot_drift(report: dict[str, Any], title: str = "") -> DriftPlot:
    """The drift chart of a run report (mplower.report.run.build_report)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ops = [o for o in report["ops"] if o["op"] != "mp.constant"]
    names = [o["name"] for o in ops]
    x = list(range(len(ops)))
    width = max(6.0, min(40.0, 0.25 * len(ops) + 2))
    fig = Figure(figsize=(width, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    drift_ax, over_ax = fig.subplots(2, 1, sharex=True)
    # An exact op (rel_l2 0) or one without a finite drift gets no bar: a log axis has no 0.
    heights = [o["rel_l2"] if o["rel_l2"] else 0.0 for o in ops]
    drift_bars = drift_ax.bar(x, heights, color="tab:blue")
    if any(heights):
        drift_ax.set_yscale("log")
    drift_ax.set_ylabel("rel_l2 vs fp32")
    # rel_l2 is also null for an integer result (an index, a mask, an i8 kernel), which has
    # no drift to draw; only a result that is not finite where the reference is gets marked.
    missing = [i for i, o in enumerate(ops) if o["rel_l2"] is None and o["nonfinite_mismatch"]]
    if missing:
        drift_ax.plot(missing, [1.0] * len(missing), "v", color="tab:red",
                      label="drift not finite (overflow, NaN)")
        drift_ax.legend(loc="upper left")
    over_bars = over_ax.bar(x, [o["overflow"] for o in ops], color="tab:red")
    over_ax.set_ylabel("overflow count")
    over_ax.set_ylim(bottom=0)
    over_ax.yaxis.get_major_locator().set_params(integer=True)
    over_ax.set_xticks(x, names, rotation=90, fontsize=7)
    s = report["summary"]
    drift = "-" if s["output_rel_l2"] is None else f"{s['output_rel_l2']:.3g}"
    fig.suptitle(f"{title}{': ' if title else ''}verdict {s['verdict']}, output rel_l2 "
                 f"{drift}, overflow {s['overflow']}", fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    drawn = [b.get_height() for b in drift_bars]
    return DriftPlot(
        names=tuple(names),
        rel_l2=tuple(None if o["rel_l2"] is None else drawn[i] for i, o in enumerate(ops)),
        overflow=tuple(int(b.get_height()) for b in over_bars),
        png=buf.getvalue(), not_finite=tuple(missing))
