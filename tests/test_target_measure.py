"""`mplower target measure`: a target sheet measured on this machine (issue 13, item 3).

No timed assertions: the figures change from run to run. The tests pin that the written sheet is
one the loader reads, that it says what was measured where and when, that each figure in the
sheet is the figure its header reports, and that the output is atomic."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import pytest

from mplower.backend import measure
from mplower.backend.measure import OVERHEAD_CHAIN, QUICK, HostMeasurements, Measurement
from mplower.lowering.target import load_target, parse_target

ALL_FLOATS = {"f32", "bf16", "f16", "f8E4M3FN", "f8E5M2"}


def header_rate(text: str, label: str) -> float:
    """The rate the comment header gives for the measurement `label`."""
    line = next(x for x in text.splitlines() if x.startswith(f"#   {label}"))
    return float(re.search(r", ([0-9.e+-]+) (?:FLOP|OP|bytes)/s$", line).group(1))


def test_target_measure_quick_writes_a_sheet_of_mplowers_executor_the_loader_reads(cli, tmp_path):
    out = tmp_path / "host.toml"
    res = cli("target", "measure", "--quick", "-o", out)
    assert (res.rc, res.out, res.err) == (0, "", "")
    text = out.read_text()
    target = load_target(str(out))
    assert target.name == "host" and target.fuse == frozenset()  # the executor fuses nothing
    assert set(target.formats) == ALL_FLOATS | {"i8"}
    assert target.kernels("mp.matmul", "f8E4M3FN") == {"dense"}
    assert target.legalize("mp.matmul", "i8", "i32").fallback is False
    head = [x for x in text.splitlines() if x.startswith("#")]
    assert head[0] == ("# Measured on this machine by `mplower target measure --runtime "
                       f"mplower --name host --quick -o {out}`.")
    assert head[1].startswith("# machine: ") and head[2].startswith("# date: 20")
    assert head[4].startswith("# method: median of 3 timed calls")
    # Each format's dense rate is the GEMM figure of the header, to its 4 digits.
    m, k, n = QUICK.gemm
    for fmt in ALL_FLOATS | {"i8"}:
        label = f"mplower matmul {fmt} {m}x{k} @ {k}x{n}"
        assert target.formats[fmt].dense == header_rate(text, label)
    assert target.bandwidth == header_rate(text, "numpy copy of 1 MiB")
    # Each kernel class's rate is its one-op model's figure in the header.
    assert {c: set(r) for c, r in target.rates.items()} == {
        "conv_depthwise": {"f32", "i8"}, "conv_grouped": {"f32", "i8"},
        "max_pool": {"f32", "i8"}, "lrn": {"f32"}}
    assert target.rates["conv_depthwise"]["i8"] == header_rate(
        text, "mplower conv_depthwise (1x8x8x8 * 8x1x3x3, groups 8) i8")
    assert target.rates["conv_grouped"]["f32"] == header_rate(
        text, "mplower conv_grouped (1x8x8x8 * 8x2x1x1, groups 4) f32")
    assert target.rates["lrn"]["f32"] == header_rate(text, "mplower lrn (1x8x8x8, size 5) f32")


def test_target_measure_onnxruntime_sheet_has_its_int8_kernels_and_fusions(cli, tmp_path):
    pytest.importorskip("onnxruntime")
    out = tmp_path / "ort.toml"
    assert cli("target", "measure", "--quick", "--runtime", "onnxruntime", "-o", out).rc == 0
    target = load_target(str(out))
    text = out.read_text()
    assert set(target.formats) == {"f32", "i8"}
    # measure.ORT_FUSE says why (qdq-propagation: the int8 MaxPool of exported SqueezeNet).
    assert target.fuse == frozenset({"epilogue", "qdq-propagation"})
    m, k, n = QUICK.gemm
    assert target.formats["i8"].dense == header_rate(
        text, f"onnxruntime MatMulInteger {m}x{k} @ {k}x{n}")
    # Its CPU provider has no bf16 GEMM (the exporter computes bf16 in FLOAT).
    legal = target.legalize("mp.matmul", "bf16", "f32")
    assert (legal.compute, legal.reason) == ("f32", "no-bf16-kernel")
    # onnxruntime's class kernels: its float MaxPool is left to the roofline (CLASS_KERNELS).
    assert {c: set(r) for c, r in target.rates.items()} == {
        "conv_depthwise": {"f32", "i8"}, "conv_grouped": {"f32", "i8"}, "max_pool": {"i8"},
        "lrn": {"f32"}}
    assert target.rates["max_pool"]["i8"] == header_rate(
        text, "onnxruntime max_pool (1x8x8x8, 3x3 stride 2) i8")
    # mplower's own int8 kernel is timed beside it, for comparison.
    assert f"#   mplower matmul i8 {m}x{k} @ {k}x{n}: " in text


def test_sheet_text_gives_each_measured_figure_to_the_loader() -> None:
    h = HostMeasurements(QUICK, [
        Measurement("numpy", "copy", None, "copy", 0.5, 20e9),
        Measurement("onnxruntime", "gemm", "f32", "MatMul", 2.0, 100e9),
        Measurement("onnxruntime", "gemm", "i8", "MatMulInteger", 4.0, 100e9),
        Measurement("onnxruntime", "overhead", None, "chain", 64e-6, OVERHEAD_CHAIN),
        Measurement("onnxruntime", "lrn", "f32", "LRN", 0.25, 1e9),
        Measurement("onnxruntime", "conv_depthwise", "i8", "ConvInteger dw", 0.5, 1e9),
        Measurement("mplower", "lrn", "f32", "mplower LRN", 1.0, 1e9),
    ])
    when = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC)
    text = measure.sheet_text(h, "onnxruntime", "box", when)
    target = parse_target(text, "box.toml")
    assert (target.name, target.bandwidth, target.overhead_s) == ("box", 40e9, 1e-6)
    assert {f: p.dense for f, p in target.formats.items()} == {"f32": 50e9, "i8": 25e9}
    # Only the described runtime's class kernels become [rates] (mplower's is in the header).
    assert target.rates == {"lrn": {"f32": 4e9}, "conv_depthwise": {"i8": 2e9}}
    assert target.description == "this machine (onnxruntime), measured 2026-12-01"
    assert "# date: 2026-12-01 12:00 UTC" in text.splitlines()
    assert "#   chain: 1 us" in text.splitlines()


def test_target_measure_writes_nothing_when_the_sheet_would_not_load(cli, tmp_path,
                                                                        monkeypatch):
    out = tmp_path / "host.toml"
    out.write_text("previous\n")
    real = measure.sheet_text
    monkeypatch.setattr(measure, "sheet_text", lambda *a, **k: real(*a, **k).replace(
        "bandwidth = ", "bandwidth = -"))
    res = cli("target", "measure", "--quick", "-o", out)
    assert res.rc == 1
    assert "error: 'target.bandwidth' must be" in res.err
    assert out.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host.toml"]  # no temporary file


def test_target_measure_onnxruntime_without_the_package_is_a_usage_error(cli, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(measure, "onnxruntime_available", lambda: False)
    res = cli("target", "measure", "--quick", "--runtime", "onnxruntime", "-o",
              tmp_path / "x.toml")
    assert res.rc == 2
    assert res.err.endswith("mplower: error: --runtime onnxruntime needs the onnxruntime "
                            "package (pip install onnxruntime)\n")
    assert not Path(tmp_path / "x.toml").exists()
