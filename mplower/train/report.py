"""The training report (train.json, docs/report.md "Training report") and its plot.

One row per step as `Trainer.step` returns it; the summary adds what a reader looks for first:
the final loss, how many steps were skipped, the total forward and backward incidence, and the
test accuracy when there was an evaluation set.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mplower.train.trainer import BACKWARD, FORWARD

KINDS = ("overflow", "underflow", "nan")


def training_report(config: dict[str, Any], rows: list[dict[str, Any]],
                    evaluation: dict[str, Any] | None) -> dict[str, Any]:
    total = {phase: {k: sum(r[phase][k] for r in rows) for k in KINDS}
             for phase in (FORWARD, BACKWARD)}
    summary: dict[str, Any] = {
        "steps": len(rows), "skipped": sum(r["skipped"] for r in rows),
        "final_loss": rows[-1]["loss"] if rows else None,
        "final_loss_scale": rows[-1]["loss_scale"] if rows else None, **total}
    if evaluation is not None:
        summary["eval"] = evaluation
    return {"config": config, "summary": summary, "steps": rows}


def plot_training(report: dict[str, Any], fh: Any) -> None:
    """Loss, loss scale, per-step overflow/underflow incidence (forward and backward) and, with
    an evaluation set, the accuracy after each epoch, over the steps, as PNG into the binary
    file `fh`. matplotlib is imported here, when asked for; no pyplot (no global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = report["steps"]
    steps = [r["step"] for r in rows]
    epochs = (report["summary"].get("eval") or {}).get("per_epoch") or []
    fig = Figure(figsize=(8, 10 if epochs else 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(4 if epochs else 3, 1, sharex=True)
    ax_loss, ax_scale, ax_inc = axes[:3]
    loss = [math.nan if r["loss"] is None else r["loss"] for r in rows]  # None: not finite
    ax_loss.plot(steps, loss, lw=1)
    skipped = [r["step"] for r in rows if r["skipped"]]
    if skipped:
        ax_loss.plot(skipped, [loss[s] for s in skipped], "rx", label="skipped")
        ax_loss.legend()
    ax_loss.set_ylabel("loss")
    ax_scale.plot(steps, [r["loss_scale"] for r in rows], lw=1)
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    for phase, style in ((FORWARD, "-"), (BACKWARD, "--")):
        for kind in ("overflow", "underflow"):
            ax_inc.plot(steps, [r[phase][kind] for r in rows], style, lw=1,
                        label=f"{phase} {kind}")
    if any(r[phase][kind] for r in rows for phase in (FORWARD, BACKWARD)
           for kind in ("overflow", "underflow")):
        ax_inc.set_yscale("symlog")
    else:  # nothing to show: counts, so integers from 0
        ax_inc.set_ylim(0, 1)
        ax_inc.yaxis.get_major_locator().set_params(integer=True)
    ax_inc.set_ylabel("values per step")
    ax_inc.legend(fontsize="small")
    if epochs:
        ax_eval = axes[3]
        ax_eval.plot([e["step"] for e in epochs], [e["accuracy"] for e in epochs], "o-", lw=1)
        for e in epochs:
            ax_eval.annotate(f"{e['accuracy']:.3f}", (e["step"], e["accuracy"]),
                             textcoords="offset points", xytext=(0, 6), ha="center",
                             fontsize="small")
        ax_eval.set_ylabel("eval accuracy")
        ax_eval.margins(y=0.2)  # room for the labels above the points
    axes[-1].set_xlabel("step")
    config = report["config"]
    # Two short lines: a long model path and plan no longer run off both sides.
    fig.suptitle(f"mplower train: {Path(str(config.get('model', ''))).name}\n"
                 f"{config.get('plan', '')}", fontsize=10)
    fig.savefig(fh, format="png", dpi=100)
