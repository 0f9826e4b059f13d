"""`mplower run --plot`: per-op drift and overflow as a bar chart (issue 13, item 9)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mplower.report.drift_plot import plot_drift

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# relu is exact in f32; the f16 multiply by 1000 overflows for 100 and 200 (1e5 and 2e5 are
# beyond f16's 65504), so its drift and everything after it is not finite.
IR = """func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {
  %s = mp.constant {value = dense<1000.0> : tensor<f32>} : () -> tensor<f32>
  %r = mp.relu %x : (tensor<4xf32>) -> tensor<4xf32>
  %a = mp.mul %r, %s {mp.precision = f16} : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>
  %y = mp.add %a, %r : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
  return %y : tensor<4xf32>
}
"""


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "m.ir").write_text(IR)
    np.savez(tmp_path / "in.npz", x=np.array([100, 200, 0.3, -1], np.float32))
    return tmp_path / "m.ir"


def test_run_plot_writes_a_png_of_the_reports_drift_and_overflow(cli, model, tmp_path):
    from matplotlib.image import imread

    png, report_path = tmp_path / "drift.png", tmp_path / "r.json"
    res = cli("run", model, "--inputs", tmp_path / "in.npz", "--plot", png,
              "--report", report_path)
    assert res.rc == 0, res.err
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    # 10 inches wide, 1.6 + 0.3 per row (6 ops) high, at 100 dpi, RGBA
    assert imread(png).shape == (340, 1000, 4)
    report = json.loads(report_path.read_text())
    plotted = plot_drift(report, "@main")
    assert plotted.png == data  # the file is this drawing
    ops = {o["name"]: o for o in report["ops"] if o["op"] != "mp.constant"}
    # worst first: the results that are not finite (the f16 multiply overflowed) in program
    # order, then the f16 rounding of relu's output, then the exact ops
    assert plotted.names == ("%a", "%a_f32", "%y", "%r_f16", "%s_f16", "%r")
    assert plotted.not_finite == (0, 1, 2)
    assert plotted.overflow == tuple(ops[n]["overflow"] for n in plotted.names) == (
        2, 0, 0, 0, 0, 0)
    assert plotted.rel_l2 == tuple(ops[n]["rel_l2"] for n in plotted.names)
    # 1000 is exact in f16, so the scalar's cast has no drift (it read None while a rounded
    # scalar came back with shape (1,) instead of ()).
    assert plotted.rel_l2[:3] == (None, None, None) and plotted.rel_l2[4:] == (0.0, 0.0)
    # The f16 rounding of relu's output: rel_l2 of the f16 values of [100, 200, 0.3, 0].
    x = np.array([100, 200, 0.3, 0], np.float32)
    expected = np.linalg.norm(x.astype(np.float16).astype(np.float64) - x) / np.linalg.norm(x)
    assert plotted.rel_l2[3] == pytest.approx(expected, rel=1e-12)


def test_drift_plot_of_200_ops_shows_the_30_worst_readably() -> None:
    """A 200-op report: 30 rows (9.1 inches high), worst drift first, overflow on an integer
    axis even when every count is 0."""
    from matplotlib.image import imread

    rng = np.random.default_rng(0)
    drifts = rng.uniform(1e-6, 1e-1, 200)
    report = {"ops": [{"name": f"%op{i}", "op": "mp.add", "rel_l2": float(d), "overflow": 0,
                       "nonfinite_mismatch": False} for i, d in enumerate(drifts)],
              "summary": {"output_rel_l2": 0.01, "verdict": "pass", "overflow": 0}}
    plotted = plot_drift(report)
    want = np.argsort(-drifts, kind="stable")[:30]
    assert plotted.names == tuple(f"%op{i}" for i in want)
    assert plotted.rel_l2 == pytest.approx([float(drifts[i]) for i in want], rel=1e-12)
    assert plotted.overflow == (0,) * 30
    import io

    assert imread(io.BytesIO(plotted.png)).shape == (1060, 1000, 4)


def test_run_plot_of_a_failing_run_leaves_the_png_untouched(cli, model, tmp_path):
    png = tmp_path / "drift.png"
    png.write_bytes(b"previous")
    np.savez(tmp_path / "bad.npz", x=np.zeros(3, np.float32))  # the wrong shape
    res = cli("run", model, "--inputs", tmp_path / "bad.npz", "--plot", png)
    assert res.rc == 1
    # (after the note that run materialized the plan with insert-casts)
    first = next(line for line in res.err.splitlines() if ": note: " not in line)
    assert first.startswith(f"{model}:1:17: error: input 'x' in ")
    assert first.endswith("bad.npz has shape [3] but the function takes [4]")
    assert png.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz", "drift.png", "in.npz",
                                                          "m.ir"]
