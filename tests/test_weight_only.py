"""Weight-only algorithms: GPTQ and AWQ against numpy transcriptions of their papers, the error
they leave against round-to-nearest, and the lowered module's exact emulation.

The transcriptions below are written from the papers' pseudo-code, not from mplower's code:
GPTQ is Algorithm 1 of Frantar et al. 2022 (arXiv 2210.17323) without the lazy batching (every
remaining column updated right after each column, which the paper shows is the same result),
with np.linalg's Cholesky and inverse; AWQ is section 3.2 of Lin et al. 2023 (arXiv
2306.00978) with its loss evaluated on the activations themselves (mplower evaluates it from
X^T X) and llm-awq's clipping search. Both share mplower's grid, which the test also writes
out (the algorithms do not fix the grid). The integers, scales and zero points agree exactly:
the two computations differ only in the order of floating-point sums (~1e-13 relative), which
moves a rounding decision only for a quotient that close to a half, which these seeded data do
not have.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mplower.backend.executor import Program, reference_runner
from mplower.dialect.plan import WEIGHT_ERROR, WEIGHT_QUANT
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.parser import parse_file
from mplower.ir.printer import print_module
from mplower.numerics.weight_only import (
    LayerStats,
    awq_quantize,
    dequantize_grouped,
    gptq_quantize,
    reconstruction_error,
    rtn_quantize,
)
from mplower.pass_manager import PassContext, PassManager, parse_pipeline
from mplower.report.quant import operand_sqnr

K, N, ROWS = 64, 24, 512


def correlated_inputs(rng: np.random.Generator, rows: int = ROWS) -> np.ndarray:
    """Rows of K features mixed by a random matrix, a few channels much larger (as after a
    norm): the inputs whose correlations GPTQ exploits and whose outliers AWQ protects."""
    mix = rng.standard_normal((K, K)) / np.sqrt(K) + np.eye(K)
    x = rng.standard_normal((rows, K)) @ mix
    x[:, [3, 17, 40]] *= 12.0
    return x.astype(np.float32)


def layer(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((K, N)).astype(np.float32) * 0.1, correlated_inputs(rng))


# ---- the grid, as the test writes it ---------------------------------------------------------


def grid_params(w: np.ndarray, bits: int, sym: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per column of w: float32 scale and integer zero point."""
    if sym:
        scale = (np.abs(w).max(axis=0) / (2 ** (bits - 1) - 1)).astype(np.float32)
        zero = np.zeros(w.shape[1])
    else:
        lo, hi = np.minimum(w.min(axis=0), 0), np.maximum(w.max(axis=0), 0)
        scale = ((hi - lo) / (2 ** bits - 1)).astype(np.float32)
        zero = None
    scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    if zero is None:
        zero = np.clip(np.rint(-lo / scale.astype(np.float64)) - 2 ** (bits - 1),
                       -2 ** (bits - 1), 2 ** (bits - 1) - 1)
    return scale, zero


def grid_round(w, scale, zero, bits):
    return np.clip(np.rint(w / scale.astype(np.float64)) + zero, -2 ** (bits - 1),
                   2 ** (bits - 1) - 1)


def grid_value(q, scale, zero):
    return ((q - zero).astype(np.float32) * scale.astype(np.float32)).astype(np.float64)


def rtn(w, bits, g, sym):
    out = np.empty(w.shape)
    for a in range(0, w.shape[0], g):
        s, z = grid_params(w[a:a + g], bits, sym)
        out[a:a + g] = grid_value(grid_round(w[a:a + g], s, z, bits), s, z)
    return out


# ---- GPTQ, Algorithm 1 -----------------------------------------------------------------------


def paper_gptq(w_kn, h, bits, g, sym, percdamp=0.01, act_order=False):
    """Returns q (K, N) and the per-group scale and zero (K/g, N)."""
    W = np.array(w_kn, np.float64).T  # d_row x d_col: the paper's orientation
    H = np.array(h, np.float64)
    d_col = W.shape[1]
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    if act_order:  # static groups: fixed on the unquantized weight
        fixed = [grid_params(W[:, a:a + g].T, bits, sym) for a in range(0, d_col, g)]
        perm = np.argsort(-np.diag(H), kind="stable")
    else:
        perm = np.arange(d_col)
    W, H = W[:, perm], H[perm][:, perm]
    H = H + percdamp * np.mean(np.diag(H)) * np.eye(d_col)
    Hinv = np.linalg.cholesky(np.linalg.inv(H)).T  # upper: the Cholesky form of H^-1
    Q = np.zeros(W.shape)
    scales, zeros = np.zeros((d_col // g, W.shape[0])), np.zeros((d_col // g, W.shape[0]))
    for j in range(d_col):
        col = perm[j]
        if act_order:
            scales[col // g], zeros[col // g] = fixed[col // g]
        elif col % g == 0:
            scales[col // g], zeros[col // g] = grid_params(W[:, j:j + g].T, bits, sym)
        s, z = scales[col // g], zeros[col // g]
        Q[:, col] = grid_round(W[:, j], s, z, bits)
        E = (W[:, j] - grid_value(Q[:, col], s, z)) / Hinv[j, j]
        W[:, j:] -= np.outer(E, Hinv[j, j:])
    return Q.T, scales, zeros


@pytest.mark.parametrize("sym,act_order", [(True, False), (False, False), (False, True)])
def test_gptq_matches_the_papers_algorithm(sym, act_order):
    w, x = layer()
    stats = LayerStats.zeros(K)
    stats.add(x)
    q, scale, zero = gptq_quantize(w, stats.hessian, bits=4, group=16, sym=sym, damp=0.01,
                                   act_order=act_order, block=32)
    ref_q, ref_s, ref_z = paper_gptq(w, 2 * x.astype(np.float64).T @ x, 4, 16, sym,
                                     act_order=act_order)
    np.testing.assert_array_equal(q, ref_q)
    np.testing.assert_array_equal(scale, ref_s.astype(np.float32))
    np.testing.assert_array_equal(zero, ref_z)


def test_gptq_lazy_blocks_give_the_same_integers():
    w, x = layer(1)
    stats = LayerStats.zeros(K)
    stats.add(x)
    outs = [gptq_quantize(w, stats.hessian, bits=4, group=16, sym=False, block=b)[0]
            for b in (16, 32, 128)]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_gptq_lowers_the_reconstruction_error_against_rtn():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((K, N)).astype(np.float32) * 0.1
    # Strongly correlated inputs (close to rank 16), where GPTQ's error feedback pays most.
    x = (rng.standard_normal((ROWS, 16)) @ rng.standard_normal((16, K))
         + 0.1 * rng.standard_normal((ROWS, K))).astype(np.float32)
    stats = LayerStats.zeros(K)
    stats.add(x)
    xw = x.astype(np.float64) @ w
    for sym in (True, False):
        r = rtn(w.astype(np.float64), 4, 16, sym)
        g = dequantize_grouped(*gptq_quantize(w, stats.hessian, bits=4, group=16, sym=sym))
        e_rtn = np.linalg.norm(xw - x @ r) / np.linalg.norm(xw)
        e_gptq = np.linalg.norm(xw - x @ g) / np.linalg.norm(xw)
        assert e_gptq < 0.5 * e_rtn, (sym, e_gptq, e_rtn)
        # The figure the report shows, from H alone, is the one on the rows themselves.
        assert reconstruction_error(w, g, stats.hessian) == pytest.approx(e_gptq, rel=1e-9)


def test_rtn_is_the_grid_rounded():
    w, _ = layer(3)
    for sym in (True, False):
        got = dequantize_grouped(*rtn_quantize(w, bits=4, group=16, sym=sym))
        np.testing.assert_array_equal(got, rtn(w.astype(np.float64), 4, 16, sym))


# ---- AWQ -------------------------------------------------------------------------------------


def paper_awq(w, x, bits, g, sym, n_grid=20):
    """Scale search on the activations, then llm-awq's clipping search. Returns q, s."""
    w, x = w.astype(np.float64), x.astype(np.float64)
    x_mean = np.abs(x).mean(axis=0)
    ref = x @ w
    best = (np.inf, None)
    for r in range(n_grid):
        s = np.maximum(x_mean, 1e-4) ** (r / n_grid)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32).astype(np.float64)
        loss = np.sum((ref - x @ (rtn(w * s[:, None], bits, g, sym) / s[:, None])) ** 2)
        if loss < best[0]:
            best = (loss, s)
    s = best[1]
    ws, xs = w * s[:, None], x / s
    q = np.zeros(w.shape)
    for a in range(0, w.shape[0], g):
        wg, xg = ws[a:a + g], xs[:, a:a + g]
        amax = np.abs(wg).max(axis=0)
        errs, qs = [], []
        for i in range(n_grid // 2):
            m = amax * (1 - i / n_grid)
            cur = np.clip(wg, -m, m)
            sc, z = grid_params(cur, bits, sym)
            qi = grid_round(cur, sc, z, bits)
            errs.append(np.sum((xg @ wg - xg @ grid_value(qi, sc, z)) ** 2, axis=0))
            qs.append(qi)
        pick = np.argmin(np.array(errs), axis=0)
        q[a:a + g] = np.array(qs)[pick, :, np.arange(w.shape[1])].T
    return q, s


@pytest.mark.parametrize("sym", [True, False])
def test_awq_matches_the_papers_search(sym):
    w, x = layer(4)
    stats = LayerStats.zeros(K)
    stats.add(x)
    q, scale, zero, s = awq_quantize(w, stats, bits=4, group=16, sym=sym)
    ref_q, ref_s = paper_awq(w, x, 4, 16, sym)
    np.testing.assert_array_equal(s, ref_s.astype(np.float32))
    np.testing.assert_array_equal(q, ref_q)
    # ... and it protects the outlier channels better than rounding alone.
    xw = x.astype(np.float64) @ w
    awq = (x / s) @ dequantize_grouped(q, scale, zero)
    assert np.linalg.norm(xw - awq) < 0.8 * np.linalg.norm(xw - x @ rtn(w, 4, 16, sym))


def test_layer_stats_merge_batch_by_batch_exactly():
    _, x = layer(5)
    whole = LayerStats.zeros(K)
    for part in np.split(x, 4):
        whole.add(part)
    merged = LayerStats.zeros(K)
    for part in np.split(x, 4):  # one shard per batch, merged in batch order
        shard = LayerStats.zeros(K)
        shard.add(part)
        merged.merge(shard)
    assert np.array_equal(whole.hessian, merged.hessian)
    assert np.array_equal(whole.abs_sum, merged.abs_sum) and whole.rows == merged.rows == ROWS
    np.testing.assert_allclose(whole.hessian, 2 * x.astype(np.float64).T @ x, rtol=1e-12)


# ---- the pass --------------------------------------------------------------------------------


def model(tmp_path: Path, seed: int = 6) -> tuple[Path, np.ndarray, np.ndarray]:
    w, x = layer(seed)
    np.savez(tmp_path / "w.npz", w=w)
    np.savez(tmp_path / "calib.npz", x=x)
    path = tmp_path / "m.ir"
    path.write_text(
        'module attributes {mp.weights = "w.npz"} {\n'
        f"  func.func @main(%x: tensor<64x{K}xf32>) -> tensor<64x{N}xf32> {{\n"
        f'    %w = mp.constant {{name = "w"}} : () -> tensor<{K}x{N}xf32>\n'
        f"    %0 = mp.matmul %x, %w : (tensor<64x{K}xf32>, tensor<{K}x{N}xf32>) -> "
        f"tensor<64x{N}xf32>\n"
        f"    return %0 : tensor<64x{N}xf32>\n  }}\n}}\n")
    return path, w, x


def lowered(path: Path, options: str):
    module = parse_file(path)
    PassManager(parse_pipeline(
        f"quantize{{scheme=w4a16 group=16 data={path.parent / 'calib.npz'} {options}}}")).run(
        module, PassContext(runner=reference_runner))
    return module


def weight_of(module) -> tuple[np.ndarray, np.ndarray | None]:
    """The dequantized weight the plan computes with, from the IR's integers and attributes,
    in numpy; and the input scaling (AWQ's mul), if any."""
    f = module.function(None)
    dq = next(n for n in f.ops() if f.op(n) == "mp.dequantize")
    a = f.attrs_of(dq)
    q = f.attrs_of(f.operands(dq)[0][0])["value"].array
    g = a["block_size"]
    s = np.repeat(a["scale"].array, g, axis=0)
    z = np.repeat(a["zero_point"].array, g, axis=0) if "zero_point" in a else 0
    mul = [n for n in f.ops() if f.op(n) == "mp.mul"]
    inv = f.attrs_of(f.operands(mul[0])[1][0])["value"].array if mul else None
    return (q - z).astype(np.float32) * s.astype(np.float32), inv


@pytest.mark.parametrize("options", ["method=gptq sym=false", "method=gptq act_order=true",
                                     "method=awq sym=false", "method=rtn sym=false"])
def test_lowered_module_runs_the_dequantized_weights_exactly(tmp_path, options):
    path, w, x = model(tmp_path)
    module = lowered(path, options)
    w_hat, inv = weight_of(module)
    xs = x[:64] if inv is None else x[:64] * inv
    got = Program(module).run([x[:64]]).outputs[0]
    np.testing.assert_allclose(got, xs.astype(np.float64) @ w_hat, rtol=1e-5, atol=1e-6)
    stats = LayerStats.zeros(K)
    stats.add(x)
    if "gptq" in options:  # the integers are the algorithm's
        sym = "sym=false" not in options
        q = gptq_quantize(w, stats.hessian, bits=4, group=16, sym=sym,
                          act_order="act_order" in options)[0]
        f = module.function(None)
        const = next(n for n in f.ops() if f.op(n) == "mp.constant")
        np.testing.assert_array_equal(f.attrs_of(const)["value"].array, q)
    # The error the pass recorded is the one on the calibration rows.
    f = module.function(None)
    mm = next(n for n in f.ops() if f.op(n) == "mp.matmul")
    xw = x.astype(np.float64) @ w
    xs_all = x.astype(np.float64) if inv is None else x.astype(np.float64) * inv
    want = np.linalg.norm(xw - xs_all @ w_hat) / np.linalg.norm(xw)
    assert f.attrs_of(mm)[WEIGHT_ERROR] == pytest.approx(want, rel=1e-6)


def test_report_shows_each_methods_reconstruction_error(tmp_path):
    path, _, x = model(tmp_path)
    errors = {}
    for method in ("rtn", "gptq", "awq"):
        module = lowered(path, f"method={method}")
        rows = operand_sqnr(Program(module), [x[:64]])
        (row,) = rows
        assert row["weight_quant"].endswith("" if method == "rtn" else method)
        errors[method] = row["weight_rel_error"]
        f = module.function(None)
        assert WEIGHT_QUANT in f.attrs_of(next(n for n in f.ops() if f.op(n) == "mp.matmul"))
    assert errors["gptq"] < errors["rtn"] and errors["awq"] < errors["rtn"]


@pytest.mark.parametrize("pipeline,message", [
    ("quantize{scheme=w4a16 method=gptq}", "needs calibration data"),
    ("quantize{scheme=w8a8 method=awq data=x.npz}", "quantizes weights only"),
    ("quantize{scheme=w4a8}", "w4a8 is not supported"),
    ("quantize{scheme=w4a16 method=hqq}", "unknown method 'hqq'"),
])
def test_bad_options_are_refused_with_a_reason(tmp_path, pipeline, message):
    path, _, _ = model(tmp_path)
    with pytest.raises(DiagnosticError, match=message):
        PassManager(parse_pipeline(pipeline)).run(parse_file(path),
                                                  PassContext(runner=reference_runner))


def test_awq_scale_folds_into_the_norm_both_layers_read(tmp_path):
    rng = np.random.default_rng(7)
    x = correlated_inputs(rng)
    w = {"w1": rng.standard_normal((K, N)).astype(np.float32) * 0.1,
         "w2": rng.standard_normal((K, 8)).astype(np.float32) * 0.1,
         "g": (1 + rng.random(K)).astype(np.float32), "b": rng.random(K).astype(np.float32)}
    np.savez(tmp_path / "w.npz", **w)
    np.savez(tmp_path / "calib.npz", x=x)
    t = f"tensor<64x{K}xf32>"
    path = tmp_path / "m.ir"
    path.write_text(
        'module attributes {mp.weights = "w.npz"} {\n'
        f"  func.func @main(%x: {t}) -> (tensor<64x{N}xf32>, tensor<64x8xf32>) {{\n"
        f'    %g = mp.constant {{name = "g"}} : () -> tensor<{K}xf32>\n'
        f'    %b = mp.constant {{name = "b"}} : () -> tensor<{K}xf32>\n'
        f'    %w1 = mp.constant {{name = "w1"}} : () -> tensor<{K}x{N}xf32>\n'
        f'    %w2 = mp.constant {{name = "w2"}} : () -> tensor<{K}x8xf32>\n'
        f"    %n = mp.layer_norm %x, %g, %b {{axis = -1, epsilon = 1.0e-05}} : "
        f"({t}, tensor<{K}xf32>, tensor<{K}xf32>) -> {t}\n"
        f"    %0 = mp.matmul %n, %w1 : ({t}, tensor<{K}x{N}xf32>) -> tensor<64x{N}xf32>\n"
        f"    %1 = mp.matmul %n, %w2 : ({t}, tensor<{K}x8xf32>) -> tensor<64x8xf32>\n"
        f"    return %0, %1 : tensor<64x{N}xf32>, tensor<64x8xf32>\n  }}\n}}\n")
    module = lowered(path, "method=awq sym=false")
    f = module.function(None)
    assert not any(f.op(n) == "mp.mul" for n in f.ops())  # folded, no explicit scaling
    norm = next(n for n in f.ops() if f.op(n) == "mp.layer_norm")
    g2, b2 = (f.attrs_of(v[0])["value"].array for v in f.operands(norm)[1:])
    inv = g2 / w["g"]  # the one scale both layers share
    np.testing.assert_allclose(b2, w["b"] * inv, rtol=1e-6)
    got = Program(module).run([x[:64]]).outputs
    y = x[:64].astype(np.float64)
    hat = (y - y.mean(-1, keepdims=True)) / np.sqrt(y.var(-1, keepdims=True) + 1e-5)
    for out, mm in zip(got, [n for n in f.ops() if f.op(n) == "mp.matmul"]):
        dq = f.operands(mm)[1][0]
        a = f.attrs_of(dq)
        q = f.attrs_of(f.operands(dq)[0][0])["value"].array
        z = np.repeat(a["zero_point"].array, 16, axis=0)
        w_hat = (q - z).astype(np.float32) * np.repeat(a["scale"].array, 16, axis=0)
        np.testing.assert_allclose(out, (hat * g2 + b2) @ w_hat, rtol=1e-4, atol=1e-4)


def test_ops_option_leaves_the_other_layers_alone():
    root = Path(__file__).resolve().parent.parent / "ir_examples"
    module = parse_file(root / "cnn.ir")
    PassManager(parse_pipeline("quantize{scheme=w4a16 ops=mp.matmul}")).run(
        module, PassContext(weights_path=str(root / "cnn.npz")))
    f = module.function(None)
    marked = {f.op(n) for n in f.ops() if WEIGHT_QUANT in f.attrs_of(n)}
    assert marked == {"mp.matmul"}


@pytest.mark.parametrize("options", ["method=rtn", "method=gptq sym=false"])
def test_weight_only_quantize_twice_changes_nothing_more(tmp_path, options):
    path, _, _ = model(tmp_path)
    once = lowered(path, options)
    text = print_module(once)
    PassManager(parse_pipeline(
        f"quantize{{scheme=w4a16 group=16 data={tmp_path / 'calib.npz'} {options}}}")).run(
        once, PassContext(runner=reference_runner))
    assert print_module(once) == text


def test_gptq_on_a_singular_hessian_without_damping_is_a_located_error(tmp_path):
    path, _, x = model(tmp_path)
    x[:, 1] = 2 * x[:, 0]  # two proportional input channels: H is singular
    np.savez(tmp_path / "calib.npz", x=x)
    with pytest.raises(DiagnosticError, match="not positive definite.*raise damp") as e:
        lowered(path, "method=gptq damp=0")
    assert "mp.matmul" in str(e.value)


def textbook_cholesky(a):
    """L L^T = a by the textbook loop: L[i, j] = (a[i, j] - sum_{k<j} L[i, k] L[j, k]) / L[j, j],
    each sum subtracted term by term in order of k, as mplower's kernel orders its updates."""
    n = a.shape[0]
    lo = np.zeros_like(a)
    for j in range(n):
        for i in range(j, n):
            s = a[i, j]
            for k in range(j):
                s -= lo[i, k] * lo[j, k]
            lo[i, j] = np.sqrt(s) if i == j else s / lo[j, j]
    return lo


@pytest.mark.determinism
def test_gptq_kernels_give_the_same_bits_on_any_thread_count():
    # The panel Cholesky and the parallel row kernels keep each element's order of sums: the
    # same bits as the sequential textbook loop, on one thread or all of them.
    import numba

    from mplower.numerics import weight_only_kernels as kernels
    x = np.random.default_rng(5).standard_normal((200, 70))
    h = x.T @ x + np.eye(70)  # 70: two full panels of 32 and a short one
    want = textbook_cholesky(h)
    w, xw = layer(2)
    outs = []
    try:
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            lo = kernels.cholesky_lower(h)
            np.testing.assert_array_equal(lo, want)
            stats = LayerStats.zeros(K)
            stats.add(xw)
            outs.append(gptq_quantize(w, stats.hessian, bits=4, group=16, sym=False))
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    for a, b in zip(outs[0], outs[1]):
        np.testing.assert_array_equal(a, b)
