"""tune's table and verdicts (issue 33, sections 1 and 2): every row says why it failed (guardrail,
slice, value) or that it lowers nothing; the footer names the best passing uniform sheet and what
the chosen plan buys over it; exit 3 shows the closest and the fastest rejected plans and why the
passing fp32 row does not count; `--min-gain` releases the more accurate plan when a faster one
gains too little; tokens/s where the model has a sequence axis.

The expectations are recomputed here from each plan's own guardrail figures in tune.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mlp(folder: Path) -> tuple[Path, Path]:
    for name in ("mlp.ir", "mlp.npz", "mlp_inputs.npz"):
        shutil.copy(ROOT / "ir_examples" / name, folder / name)
    return folder / "mlp.ir", folder / "mlp_inputs.npz"


def _tune(cli, tmp_path: Path, *extra: str):
    ir, data = _mlp(tmp_path)
    out = tmp_path / "out"
    r = cli("tune", ir, "--target", "h100", "--data", data, *extra, "-o", out)
    return r, json.loads((out / "tune.json").read_text())


def _row(out: str, label: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(label))


def _excess(key: str, g: dict) -> float:
    if g["ok"]:
        return 0.0
    over = g["value"] - g["limit"] if key.startswith("max_") else g["limit"] - g["value"]
    return over / abs(g["limit"])


def test_each_failing_row_names_its_guardrail_and_value(cli, tmp_path):
    r, packet = _tune(cli, tmp_path, "--guardrail", "max_rel_l2=0.001")
    assert r.rc == 0
    failing = [u for u in packet["uniform"] if u["verdict"] == "fail"]
    assert failing
    for u in failing:
        g = u["guardrails"]["max_rel_l2"]
        assert u["why"] == f"max_rel_l2 {g['value']:.4g} vs limit {g['limit']:.4g}"
        assert g["value"] > 0.001
        assert _row(r.out, u["label"] + " ").rstrip().endswith(u["why"])


def test_footer_names_the_best_passing_uniform_sheet_and_the_gain(cli, tmp_path):
    r, packet = _tune(cli, tmp_path, "--guardrail", "max_rel_l2=0.01", "--min-gain", "0")
    chosen = packet["chosen"]
    passing = [u for u in packet["uniform"] if u["verdict"] == "pass" and u["lowered_ops"]]
    best = max(passing, key=lambda u: u["modeled"]["inferences_per_s"])
    assert chosen["best_uniform"] == best["plan"]["sheet"]
    gain = best["modeled"]["time_s"] / chosen["modeled"]["time_s"] - 1
    assert chosen["speedup_vs_best_uniform"] - 1 == pytest.approx(gain)
    footer = _row(r.out, "best passing uniform sheet:")
    assert f"best passing uniform sheet: {best['plan']['sheet']} " in footer
    if not chosen["is_best_uniform_plan"]:
        assert f"buys {gain:+.2%} modeled inferences/s" in footer


def test_uniform_sheets_that_lower_nothing_say_so_and_why(cli, tmp_path):
    r, packet = _tune(cli, tmp_path, "--guardrail", "max_rel_l2=0.01")
    empty = [u for u in packet["uniform"] if u["lowered_ops"] == 0]
    assert empty, "fp8 and int8 keep the MLP's only GEMMs (first and last) in f32"
    for u in empty:
        assert u["quality"]["output_rel_l2"] == 0
        assert u["why"].startswith(f"0 ops lowered: the {u['plan']['sheet']} sheet leaves "
                                   f"every op of this model f32 (")
        assert "keep-first-last 2" in u["why"]
        assert _row(r.out, u["label"] + " ").rstrip().endswith(u["why"])
    lowering = [u for u in packet["uniform"] if u["lowered_ops"] and u["verdict"] == "pass"]
    assert all(u["why"] is None for u in lowering)


def test_unreachable_guardrail_shows_closest_and_fastest_rejected_and_why_fp32_does_not_count(
        cli, tmp_path):
    r, packet = _tune(cli, tmp_path, "--guardrail", "max_rel_l2=1e-7")
    assert r.rc == 3 and packet["chosen"] is None
    # fp32 meets the guardrail (rel-L2 0) but is not a release: its row and the footer say so.
    assert packet["baseline"]["verdict"] == "pass"
    assert "does not count as a release" in packet["baseline"]["why"]
    assert "fp32 meets them, but it lowers nothing" in r.out
    failed = [c for c in packet["candidates"] if "formats" in c["plan"]
              and c["plan"]["formats"] and c["verdict"] == "fail"]
    closest = min(_excess("max_rel_l2", c["guardrails"]["max_rel_l2"]) for c in failed)
    fastest = max(c["modeled"]["inferences_per_s"] for c in failed)
    rej, fast = packet["best_rejected"], packet["fastest_rejected"]
    assert _excess("max_rel_l2", rej["guardrails"]["max_rel_l2"]) == pytest.approx(closest)
    assert fast["modeled"]["inferences_per_s"] == fastest
    assert rej["quality"]["output_rel_l2"] <= fast["quality"]["output_rel_l2"]
    assert _row(r.out, "closest rejected: " + rej["label"])
    if fast["key"] != rej["key"]:
        assert _row(r.out, "fastest rejected: " + fast["label"])
    assert f"no plan meets the guardrails: {rej['why']}" in r.out


def test_min_gain_prefers_the_more_accurate_plan(cli, tmp_path):
    r0, fastest = _tune(cli, tmp_path, "--guardrail", "max_rel_l2=0.01", "--min-gain", "0")
    shutil.rmtree(tmp_path / "out")
    r, safe = _tune(cli, tmp_path, "--guardrail", "max_rel_l2=0.01", "--min-gain", "50")
    assert r0.rc == r.rc == 0
    a, b = fastest["chosen"], safe["chosen"]
    assert b["quality"]["output_rel_l2"] <= a["quality"]["output_rel_l2"]
    assert a["modeled"]["inferences_per_s"] <= b["modeled"]["inferences_per_s"] * 1.5
    # No passing per-op plan within 50% of the released one is more accurate than it.
    for c in safe["candidates"]:
        if c["verdict"] == "pass" and c["plan"].get("formats") and c["modeled"][
                "inferences_per_s"] * 1.5 >= a["modeled"]["inferences_per_s"]:
            assert c["quality"]["output_rel_l2"] >= b["quality"]["output_rel_l2"]
    if a["plan"] != b["plan"]:
        gain = a["modeled"]["inferences_per_s"] / b["modeled"]["inferences_per_s"] - 1
        assert b["min_gain_note"].endswith(f"at rel-L2 {a['quality']['output_rel_l2']:.4g}")
        assert f"gains only {gain * 100:.2g}%" in b["min_gain_note"]
        assert b["min_gain_note"] in r.out
    assert safe["min_gain"] == 0.5
    assert "nonfinite_mismatch" in b["quality"]


def test_min_gain_and_seq_axis_refuse_bad_values(cli, tmp_path):
    ir, data = _mlp(tmp_path)
    r = cli("tune", ir, "--target", "h100", "--data", data, "--min-gain", "-1", "-o",
            tmp_path / "o")
    assert r.rc == 2 and "--min-gain" in r.err
    r = cli("tune", ir, "--target", "h100", "--data", data, "--seq-axis", "5", "-o",
            tmp_path / "o")
    assert r.rc == 2 and "--seq-axis 5 is not an axis" in r.err
    assert not (tmp_path / "o").exists()


def test_tokens_per_s_with_a_sequence_axis(cli, tmp_path):
    r, packet = _tune(cli, tmp_path, "--guardrail", "max_rel_l2=0.01", "--seq-axis", "1")
    x = np.load(tmp_path / "mlp_inputs.npz")["x"]
    tokens = int(np.prod(x.shape[-2:]))  # one batch: (batch, features), axis 1 included
    for u in [packet["baseline"], *packet["uniform"]]:
        m = u["modeled"]
        assert m["tokens_per_s"] == pytest.approx(m["inferences_per_s"] * tokens)
        assert m["samples_per_s"] == pytest.approx(m["inferences_per_s"] * x.shape[-2])
    header = r.out.splitlines()[0].split()
    assert header[:4] == ["plan", "inferences/s", "samples/s", "tokens/s"]
    base = packet["baseline"]["modeled"]
    assert f"{base['tokens_per_s']:.4g}" in _row(r.out, "fp32 (baseline)")


def test_pareto_png_plots_every_plan_labelled_with_the_guardrail_line(cli, tmp_path,
                                                                      monkeypatch):
    from matplotlib.axes import Axes

    drawn: dict[str, list] = {"scatter": [], "vline": [], "text": []}
    scatter, axvline, annotate = Axes.scatter, Axes.axvline, Axes.annotate
    monkeypatch.setattr(Axes, "scatter", lambda ax, x, y, **k: drawn["scatter"].append(
        (k["label"], list(x), list(y))) or scatter(ax, x, y, **k))
    monkeypatch.setattr(Axes, "axvline", lambda ax, x, **k: drawn["vline"].append(x)
                        or axvline(ax, x, **k))
    monkeypatch.setattr(Axes, "annotate", lambda ax, text, xy, **k: drawn["text"].append(
        (text, xy)) or annotate(ax, text, xy, **k))
    r, packet = _tune(cli, tmp_path, "--guardrail", "max_rel_l2=0.01")
    assert r.rc == 0
    assert drawn["vline"] == [0.01]
    plotted = sorted((x, y) for _, xs, ys in drawn["scatter"] for x, y in zip(xs, ys))
    rels = [c["quality"]["output_rel_l2"] for c in packet["candidates"]]
    edge = min([v for v in rels if v] + [0.01]) / 10
    expected = sorted((c["quality"]["output_rel_l2"] or edge, c["modeled"]["inferences_per_s"])
                      for c in packet["candidates"])
    assert plotted == pytest.approx(expected)
    by_kind = {label: list(zip(xs, ys)) for label, xs, ys in drawn["scatter"]}
    chosen = packet["chosen"]
    assert by_kind["chosen (released)"] == [
        pytest.approx((chosen["quality"]["output_rel_l2"], chosen["modeled"]["inferences_per_s"]))]
    texts = " | ".join(t for t, _ in drawn["text"])
    for u in packet["uniform"]:  # every uniform sheet is labelled by name at its point
        sheet = u["plan"]["sheet"]
        at = (u["quality"]["output_rel_l2"] or edge, u["modeled"]["inferences_per_s"])
        assert any(sheet in t and xy == pytest.approx(at) for t, xy in drawn["text"]), sheet
    assert f"chosen: {chosen['label']}" in texts and "fp32" in texts
    numbered = [i for i, c in enumerate(packet["candidates"]) if c["plan"].get("formats")
                and c["key"] != chosen["key"]]
    assert all(f"#{i}" in texts for i in numbered)
    assert (tmp_path / "out/pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pareto_png_marks_the_closest_and_fastest_rejected_plans(cli, tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    texts: list = []
    annotate = Axes.annotate
    monkeypatch.setattr(Axes, "annotate", lambda ax, text, xy, **k: texts.append((text, xy))
                        or annotate(ax, text, xy, **k))
    r, packet = _tune(cli, tmp_path, "--guardrail", "max_rel_l2=1e-7")
    assert r.rc == 3
    index = {c["key"]: i for i, c in enumerate(packet["candidates"])}
    for field, word in (("best_rejected", "closest rejected"),
                        ("fastest_rejected", "fastest rejected")):
        plan = packet[field]
        at = (plan["quality"]["output_rel_l2"], plan["modeled"]["inferences_per_s"])
        assert any(f"#{index[plan['key']]} " in t and word in t and xy == pytest.approx(at)
                   for t, xy in texts), word
