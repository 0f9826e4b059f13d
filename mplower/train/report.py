"""The training report (train.json, docs/report.md "Training report") and its plot.

One row per step as `Trainer.step` returns it; the summary adds what a reader looks for first:
the final loss, how many steps were skipped, the total forward and backward incidence, and the
test accuracy when there was an evaluation set.
"""

from __future__ import annotations

import math
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
    """Loss, loss scale and per-step overflow/underflow incidence (forward and backward) over
    the steps, as PNG into the binary file `fh`. matplotlib is imported here, when asked for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["steps"]
    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_scale, ax_inc) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
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
    ax_inc.set_yscale("symlog")
    ax_inc.set_ylabel("values per step")
    ax_inc.set_xlabel("step")
    ax_inc.legend(fontsize="small")
    fig.suptitle(f"mplower train: {report['config'].get('model', '')} "
                 f"({report['config'].get('plan', '')})")
    fig.tight_layout()
    fig.savefig(fh, format="png", dpi=100)
    plt.close(fig)
