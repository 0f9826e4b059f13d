"""smooth-quant: the factors, the rewrite, fp32 equivalence and the int8 gain on outliers.

The outlier model is built here: a matmul whose input has a few channels 50-100x larger than
the rest, which is what SmoothQuant (arXiv 2211.10438) was designed for. SQNR is measured on
samples that were not used for calibration.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mplower.passes.smooth_quant import smoothing_factors

from mplower.backend.executor import Program, reference_runner
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.parser import parse_file
from mplower.pass_manager import PassContext, PassManager, parse_pipeline

F32 = np.float32
OUTLIERS = {3: 80.0, 17: 50.0, 29: 100.0}


def t(*shape: int) -> str:
    return "tensor<" + "".join(f"{d}x" for d in shape) + "f32>"


def outlier_data(rng, batches: int, batch: int = 32, k: int = 32) -> np.ndarray:
    x = rng.standard_normal((batches, batch, k)).astype(F32)
    for ch, scale in OUTLIERS.items():
        x[..., ch] *= scale
    return x


def outlier_model(tmp_path: Path, two_users: bool = False) -> Path:
    rng = np.random.default_rng(0)
    w = {"w1": rng.standard_normal((32, 16)).astype(F32) * 0.2,
         "w2": rng.standard_normal((32, 8)).astype(F32) * 0.2}
    for ch, scale in OUTLIERS.items():  # as after a norm whose gamma made the outliers: the
        w["w1"][ch] /= scale / 10       # next weights are small where the inputs are large
        w["w2"][ch] /= scale / 10
    body = [f'    %w1 = mp.constant {{name = "w1"}} : () -> {t(32, 16)}',
            f"    %0 = mp.matmul %x, %w1 : ({t(32, 32)}, {t(32, 16)}) -> {t(32, 16)}"]
    result = t(32, 16)
    if two_users:
        body += [f'    %w2 = mp.constant {{name = "w2"}} : () -> {t(32, 8)}',
                 f"    %1 = mp.matmul %x, %w2 : ({t(32, 32)}, {t(32, 8)}) -> {t(32, 8)}",
                 f"    return %0, %1 : {t(32, 16)}, {t(32, 8)}"]
        result = f"({t(32, 16)}, {t(32, 8)})"
    else:
        body.append(f"    return %0 : {t(32, 16)}")
    np.savez(tmp_path / "w.npz", **w)
    path = tmp_path / "m.ir"
    path.write_text(f'module attributes {{mp.weights = "w.npz"}} {{\n'
                    f"  func.func @main(%x: {t(32, 32)}) -> {result} {{\n"
                    + "\n".join(body) + "\n  }\n}\n")
    return path


def lowered(path: Path, pipeline: str, calib: np.ndarray):
    np.savez(path.parent / "calib.npz", x=calib)
    module = parse_file(path)
    PassManager(parse_pipeline(pipeline.replace("CALIB", str(path.parent / "calib.npz")))).run(
        module, PassContext(runner=reference_runner))
    return module


def output_sqnr(module, xs: np.ndarray) -> float:
    signal = noise = 0.0
    program = Program(module)
    for x in xs:
        r = program.run([x])
        for y, ref in zip(r.outputs, r.reference):
            signal += float(np.sum(ref.astype(np.float64) ** 2))
            noise += float(np.sum((y.astype(np.float64) - ref) ** 2))
    return 10 * np.log10(signal / noise)


PLAIN = "calibrate{data=CALIB},quantize"
SMOOTH = "calibrate{data=CALIB},smooth-quant{alpha=0.5},calibrate{data=CALIB},quantize"


def test_smooth_quant_gains_at_least_6_db_on_outlier_channels_under_w8a8(tmp_path):
    path = outlier_model(tmp_path)
    rng = np.random.default_rng(1)
    calib, test = outlier_data(rng, 4), outlier_data(rng, 4)
    plain = output_sqnr(lowered(path, PLAIN, calib), test)
    smooth = output_sqnr(lowered(path, SMOOTH, calib), test)
    assert smooth - plain >= 6.0, (plain, smooth)


@pytest.mark.parametrize("pow2", [True, False])
def test_smooth_quant_leaves_the_fp32_result_unchanged(tmp_path, pow2):
    path = outlier_model(tmp_path, two_users=True)
    rng = np.random.default_rng(2)
    calib, test = outlier_data(rng, 2), outlier_data(rng, 2)
    original = Program(parse_file(path))
    smoothed = Program(lowered(path, f"calibrate{{data=CALIB}},smooth-quant{{pow2={pow2}}}",
                               calib))
    for x in test:
        for a, b in zip(original.run([x], reference=False).outputs,
                        smoothed.run([x], reference=False).outputs):
            if pow2:  # powers of two scale exactly: not a single bit changes
                assert np.array_equal(a, b)
            rel = np.linalg.norm(b.astype(np.float64) - a) / np.linalg.norm(a.astype(np.float64))
            assert rel <= 1e-5


def test_matmuls_reading_one_activation_share_its_smoothing(tmp_path):
    path = outlier_model(tmp_path, two_users=True)
    module = lowered(path, "calibrate{data=CALIB},smooth-quant",
                     outlier_data(np.random.default_rng(3), 2))
    f = module.function()
    muls = [n for n in f.ops() if f.op(n) == "mp.mul"]
    activation = [n for n in muls if f.operands(n)[0] == (f.args[0], 0)]
    assert len(activation) == 1 and len(muls) == 3  # one for x, one per weight
    users = {u for u, _ in f.uses((activation[0], 0))}
    assert {f.op(u) for u in users} == {"mp.matmul"} and len(users) == 2
    assert f.attrs_of(activation[0])["mp.calib"] == "smooth-quant"
    weights = np.load(tmp_path / "w.npz")
    x_absmax = np.abs(outlier_data(np.random.default_rng(3), 2)).max(axis=(0, 1))
    w_absmax = np.maximum(np.abs(weights["w1"]).max(axis=1), np.abs(weights["w2"]).max(axis=1))
    (inv,) = [u for u, _ in f.operands(activation[0])[1:]]
    expect = 1.0 / smoothing_factors(x_absmax, w_absmax, 0.5)
    np.testing.assert_array_equal(f.attrs_of(inv)["value"].array, expect.astype(F32))


def test_smoothing_factors_follow_the_paper_and_leave_empty_channels_alone():
    s = smoothing_factors(np.array([16.0, 0.0, 4.0]), np.array([0.25, 2.0, 1.0]), 0.5, pow2=False)
    np.testing.assert_allclose(s, [8.0, 1.0, 2.0])  # sqrt(16) / sqrt(0.25), -, sqrt(4) / 1
    assert smoothing_factors(np.array([3.0]), np.array([1.0]), 1.0, pow2=False)[0] == 3.0
    assert smoothing_factors(np.array([3.0]), np.array([1.0]), 0.5)[0] == 2.0  # 1.73 -> 2


def test_smooth_quant_needs_per_channel_calibration(tmp_path):
    path = outlier_model(tmp_path)
    with pytest.raises(DiagnosticError, match="no per-channel calibration"):
        PassManager(parse_pipeline("smooth-quant")).run(parse_file(path), PassContext(runner=reference_runner))
    with pytest.raises(DiagnosticError, match="alpha must be in"):
        PassManager(parse_pipeline("smooth-quant{alpha=1.5}")).run(parse_file(path),
                                                                  PassContext(runner=reference_runner))
