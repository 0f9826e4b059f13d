"""What `mplower tune` hands over: the sheet, the lowered module, the release packet, the plot.

`policy.toml` is the chosen plan as a policy sheet (mplower.tune.evaluation.sheet_text) whose
header says how to reproduce `lowered.ir` from the input model with it. `tune.json` (the
release packet, docs/tune.md) holds the fp32 baseline, the chosen plan with its modeled
throughput (and tokens/s, energy where known), speedups against fp32 and the best uniform
built-in sheet, every guardrail with value and limit, overflow/underflow/NaN, the validation
matrix (guardrail x slice) and rollback triggers, every evaluated candidate and why it lost,
the evaluation counts and the provenance (versions, hashes, seed). Everything in it but the
`timing` table is a function of the inputs and the seed. `pareto.png` plots the modeled
objective of every evaluated plan against its output rel-L2, each labelled, the chosen plan
marked and the rel-L2 guardrail as a line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mplower.lowering.metrics import METRIC_FIGURES, Metric
from mplower.tune.evaluation import Candidate
from mplower.tune.search import OBJECTIVES, Outcome, failure, objective_value

_VERSIONED = ("mplower", "numpy", "numba", "onnx", "networkx", "lark", "dask", "distributed")


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in _VERSIONED:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def sha256_file(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def candidate_of(result: Mapping[str, Any]) -> Candidate:
    plan = result["plan"]
    return Candidate(tuple(plan["formats"].items()), plan.get("sparse", False))


def _figures(r: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """An evaluation as the packet shows it, its speedup against the fp32 plan `baseline`."""
    out = {"key": r["key"], "label": r["label"], "plan": r["plan"], "verdict": r["verdict"]}
    if r["verdict"] == "error":
        return {**out, "error": r["error"], "why": failure(r)}
    s = r["summary"]
    modeled = {**r["modeled"], "speedup_vs_fp32": _speedup(r, baseline)}
    return {**out, "lowered_ops": r["lowered_ops"], "modeled": modeled,
            "quality": {k: s[k] for k in ("output_rel_l2", "sqnr_db", "output_max_abs",
                                          "top1_agreement", "nonfinite_mismatch",
                                          *METRIC_FIGURES, "metric_detail")
                        if k in s},
            "overflow": s["overflow"], "underflow": s["underflow"], "nan": s["nan"],
            "overflow_rate": s["overflow_rate"], "guardrails": r["guardrails"],
            "failed": r["failed"], "why": why(r)}


def _baseline_why(baseline: Mapping[str, Any], chosen: Mapping[str, Any] | None) -> str | None:
    """The fp32 row's verdict beside the search's: a baseline that meets the guardrails is still
    no release (it lowers nothing), so it does not make a search that found nothing pass."""
    if baseline["verdict"] != "pass":
        return f"{failure(baseline)}: the guardrails fail even without lowering anything"
    if chosen is None:
        return "the reference, not a plan: it lowers nothing, so it does not count as a release"
    return None


def why(r: Mapping[str, Any]) -> str | None:
    """A row's reason in words: the guardrails it broke with their values, or that it lowers
    nothing and why (a plan equal to fp32 is no result); None for a passing plan that lowers
    something."""
    if r["verdict"] != "pass":
        return failure(r)
    if r.get("lowered_ops", 1) == 0 and r["plan"].get("sheet") is not None:
        kept = r.get("kept_f32", {})
        reasons = ", ".join(f"{reason} {n}" for reason, n in
                            sorted(kept.items(), key=lambda kv: (-kv[1], kv[0])))
        return (f"0 ops lowered: the {r['plan']['sheet']} sheet leaves every op of this model "
                f"f32" + (f" ({reasons})" if reasons else ""))
    return None


def _speedup(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> float | None:
    if a is None or b is None or "modeled" not in a or "modeled" not in b:
        return None
    return b["modeled"]["time_s"] / a["modeled"]["time_s"]


def validation(chosen: Mapping[str, Any]) -> dict[str, Any]:
    """The guardrail x slice matrix of the chosen plan, and the rollback triggers: per
    guardrail its limit, the worst value validated over all slices and its margin."""
    # By the checks as reported: `rtol` and `atol` are one, `max_allclose_ratio` (limit 1).
    checks = {k: g["limit"] for k, g in chosen["guardrails"].items()}
    matrix = {k: {s: chosen["slices"][s][k] for s in chosen["slices"]} for k in checks}
    triggers = []
    for k, limit in checks.items():
        cells = [(s, c["value"]) for s, c in matrix[k].items() if c["value"] is not None]
        if not cells:
            cells = [("all", chosen["guardrails"][k]["value"])]
        pick = max if k.startswith("max_") else min
        s, worst = pick(cells, key=lambda c: c[1] if c[1] is not None else 0.0)
        margin = None if worst is None else (limit - worst if k.startswith("max_")
                                             else worst - limit)
        crossed = ">" if k.startswith("max_") else "<"
        triggers.append({"guardrail": k, "limit": limit, "validated_worst": worst,
                         "worst_slice": s, "margin": margin,
                         "rollback_when": f"{k.split('_', 1)[1]} {crossed} {limit}"})
    return {"slices": sorted(chosen["slices"]), "matrix": matrix, "rollback_triggers": triggers}


def build_packet(outcome: Outcome, results: list[dict[str, Any]], *, objective: str,
                 guardrails: Mapping[str, float], provenance: dict[str, Any],
                 reproduce: dict[str, str] | None, evaluations: dict[str, int],
                 slices: bool, metric: Metric | None = None,
                 min_gain: float = 0.0) -> dict[str, Any]:
    chosen, baseline = outcome.chosen, outcome.baseline
    passing_uniform = [r for r in outcome.uniform if r["verdict"] == "pass"]
    best_uniform = max(passing_uniform, key=lambda r: objective_value(r, objective),
                       default=None)
    chosen_json = None
    if chosen is not None:
        released = {"formats": chosen["plan"]["formats"], "sparse": chosen["plan"]["sparse"]}
        chosen_json = {**_figures(chosen, baseline), "plan": released, "sheet": "policy.toml",
                       "best_uniform": best_uniform["plan"]["sheet"] if best_uniform else None,
                       "speedup_vs_best_uniform": _speedup(chosen, best_uniform),
                       "is_best_uniform_plan": chosen["key"] == outcome.uniform_plan_key,
                       "min_gain_note": outcome.note}
        if slices:
            chosen_json["validation"] = validation(chosen)
            if "slice_metric" in chosen:
                chosen_json["validation"]["metric"] = chosen["slice_metric"]
    rejected = fastest = None
    if outcome.best_rejected is not None:
        rejected = _figures(outcome.best_rejected, baseline)
    if outcome.fastest_rejected is not None:
        fastest = _figures(outcome.fastest_rejected, baseline)
    chosen_key = chosen["key"] if chosen else None
    candidates = []
    for r in results:
        entry = _figures(r, baseline)
        if r["key"] == chosen_key:
            entry["rejected"] = None
        elif r["verdict"] != "pass":
            entry["rejected"] = f"fails: {failure(r)}"
        elif "sheet" in r["plan"]:
            entry["rejected"] = "uniform comparator"
        elif outcome.note and objective_value(r, objective) > objective_value(chosen, objective):
            entry["rejected"] = "faster, but by less than --min-gain over a more accurate plan"
        else:
            entry["rejected"] = f"lower {OBJECTIVES[objective].replace('_', ' ')} than chosen"
        candidates.append(entry)
    return {
        "packet": "mplower-tune/1",
        "objective": objective,
        "guardrails": dict(guardrails),
        "min_gain": min_gain,
        "metric": metric.to_json() if metric is not None else None,
        "baseline": {**_figures(baseline, baseline), "why": _baseline_why(baseline, chosen)},
        "chosen": chosen_json,
        "best_rejected": rejected,
        "fastest_rejected": fastest,
        "uniform": [_figures(r, baseline) for r in outcome.uniform],
        "items": [it.to_json() for it in outcome.items],
        "candidates": candidates,
        "evaluations": evaluations,
        "reproduce": reproduce,
        "provenance": provenance,
    }


def pareto_points(candidates: list[dict[str, Any]], chosen_key: str | None,
                  objective: str, rejected: Mapping[str, str] | None = None
                  ) -> list[dict[str, Any]]:
    """What pareto.png plots, one entry per evaluated plan of tune.json's `candidates` with a
    modeled objective: `x` its
    output rel-L2 (None for an exact plan), `y` the objective in the table's unit, `kind`
    (`chosen`, `baseline`, `pass`, `fail`, `uniform pass`, `uniform fail`) and `label`: a
    uniform sheet's name, `fp32`, `chosen: ...`, or for another per-op plan `#i`, its index
    in tune.json's `candidates` (a plan's own label is too long for a crowded plot), with
    `rejected`'s word for it where given (`closest rejected`, `fastest rejected`)."""
    key = OBJECTIVES[objective]
    out = []
    for i, r in enumerate(candidates):
        if "modeled" not in r or r["modeled"][key] is None:
            continue
        verdict = "pass" if r["verdict"] == "pass" else "fail"
        sheet = r["plan"].get("sheet")
        if r["key"] == chosen_key:
            kind, label = "chosen", f"chosen: {r['label']}"
        elif sheet is not None:
            kind, label = f"uniform {verdict}", sheet + (" (0 ops)" if not r["lowered_ops"]
                                                        else "")
        elif not r["plan"].get("formats"):
            kind, label = "baseline", "fp32"
        else:
            kind, label = verdict, f"#{i}"
            if r["key"] in (rejected or {}):
                kind, label = "rejected", f"#{i} {rejected[r['key']]}"
        out.append({"x": r["quality"]["output_rel_l2"] or None, "y": r["modeled"][key],
                    "kind": kind, "label": label})
    return out


def pareto_png(path: Path, candidates: list[dict[str, Any]], chosen_key: str | None,
               objective: str, guardrails: Mapping[str, float] | None = None,
               rejected: Mapping[str, str] | None = None) -> None:
    """Modeled objective (the table's unit) against output rel-L2 of every evaluated plan
    (pareto_points), each labelled, the chosen one circled, the `max_rel_l2` guardrail as a
    line (matplotlib's Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = pareto_points(candidates, chosen_key, objective, rejected)
    limit = (guardrails or {}).get("max_rel_l2")
    nonzero = [p["x"] for p in points if p["x"]] + ([limit] if limit else [])
    # Exact plans (rel-L2 0: fp32, a sheet that lowers nothing) sit at the left edge.
    edge = min(nonzero) / 10 if nonzero else 1e-6
    fig, ax = plt.subplots(figsize=(12, 6.5), dpi=100)
    styles = {"pass": {"c": "tab:blue", "marker": "o", "label": "per-op plan, meets guardrails"},
              "fail": {"c": "tab:gray", "marker": "x", "label": "per-op plan, rejected"},
              "uniform pass": {"c": "tab:orange", "marker": "s",
                               "label": "uniform built-in sheet, meets guardrails"},
              "uniform fail": {"facecolors": "none", "edgecolors": "tab:orange", "marker": "s",
                               "label": "uniform built-in sheet, rejected"},
              "baseline": {"c": "black", "marker": "D", "label": "fp32 baseline"},
              "rejected": {"c": "tab:purple", "marker": "X", "s": 80,
                           "label": "closest / fastest rejected"},
              "chosen": {"c": "tab:red", "marker": "*", "s": 260, "zorder": 3,
                         "label": "chosen (released)"}}
    for kind, style in styles.items():
        pts = [p for p in points if p["kind"] == kind]
        if pts:
            ax.scatter([p["x"] or edge for p in pts], [p["y"] for p in pts], **style)
    # One label per spot: plans that land on the same point (fp32 and the sheets that lower
    # nothing, the chosen plan and the sheet it equals) share it; per-op plans by their index
    # in tune.json's candidates, smaller.
    spots: dict[tuple[float, float], list[dict[str, Any]]] = {}
    for p in points:
        spots.setdefault((p["x"] or edge, p["y"]), []).append(p)
    for (x, y), ps in spots.items():
        named = [p["label"] for p in ps if p["kind"] not in ("pass", "fail", "rejected")]
        numbered = [p["label"] for p in ps if p["kind"] in ("pass", "fail")]
        marked = [p["label"] for p in ps if p["kind"] == "rejected"]
        chosen = any(p["kind"] == "chosen" for p in ps)
        if named:
            ax.annotate(", ".join(dict.fromkeys(named)), (x, y), xytext=(7, 6),
                        textcoords="offset points", fontsize=8,
                        color="tab:red" if chosen else "black")
        if marked:  # below the point: a rejected plan often sits on a uniform sheet's
            ax.annotate(", ".join(marked), (x, y), xytext=(-10, -22), textcoords="offset points",
                        fontsize=8, color="tab:purple")
        if numbered:
            ax.annotate(" ".join(numbered), (x, y), xytext=(5, -10),
                        textcoords="offset points", fontsize=6, color="dimgray")
    if limit:
        ax.axvline(limit, color="tab:green", linestyle="--",
                   label=f"guardrail max_rel_l2 = {limit:g}")
    ax.set_xscale("log")
    ax.margins(x=0.15, y=0.1)  # room for the labels of the outermost points
    ax.set_xlabel("output rel_l2 against fp32 (log; exact plans at the left edge)")
    unit = "inferences/J" if objective == "energy" else "inferences/s"
    ax.set_ylabel(f"modeled {unit}")
    others = [f"{k} {v:g}" for k, v in (guardrails or {}).items() if k != "max_rel_l2"]
    ax.set_title("mplower tune: every evaluated plan (#i: tune.json candidates[i])" +
                 (f" (also held: {', '.join(others)})" if others else ""), fontsize=10)
    # Beside the axes, where it hides no point.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    from mplower.io.atomic import atomic_output

    with atomic_output(path, "wb") as fh:
        fh.write(buf.getvalue())
