"""Speed of mplower's sparse CPU kernels against scipy.sparse and dense BLAS.

For x of shape (--rows, K) and a weight W (K, N) (2048 x 2048 by default, standard normal),
pruned by magnitude to each --sparsities level and to 2:4 along K:

- CSR SpMM: mplower's `spmm_csr_t` (CSR @ dense) against scipy's `csr_matrix @ ndarray` on the
  same matrices (the CSR of W^T, one row per output, and x^T), then mplower's `spmm_csr`
  (x @ W, the layout transposes included) against numpy's dense `x @ W` (BLAS);
- 2:4: `matmul_2_4` on the compressed weight (values plus 2-bit indices) against dense BLAS;
- the one-time conversion (`to_csr`, `compress_2_4`).

Each figure is the median of --repeat runs after one warm-up call (numba compilation excluded);
the contenders of one row run interleaved, so that load from other processes hits them alike.
The report ends with the acceptance checks: CSR within 2x of scipy at every sparsity, faster
than dense BLAS at 95%.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import numba
import numpy as np
import scipy.sparse

from mplower.backend.sparse import compress_2_4, matmul_2_4, spmm_csr, spmm_csr_t, to_csr
from mplower.lowering.sparsity import prune_magnitude, prune_structured


def interleaved_ms(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median milliseconds of each function, the functions taking turns in every round."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def csr_case(x: np.ndarray, w: np.ndarray, repeat: int) -> dict[str, float]:
    """Milliseconds of the CSR contenders on one pruned weight."""
    k, n = w.shape
    xt = np.ascontiguousarray(x.T)
    data, indices, indptr = to_csr(w)
    a = scipy.sparse.csr_matrix(w.T)
    assert np.array_equal(a.indptr, indptr) and np.array_equal(a.indices, indices)
    y = spmm_csr(x, data, indices, indptr, n)
    assert np.allclose(y, x @ w, rtol=1e-4, atol=1e-3 * np.sqrt(k))
    t = interleaved_ms({
        "ours_t": lambda: spmm_csr_t(data, indices, indptr, xt),
        "scipy": lambda: a @ xt,
        "ours": lambda: spmm_csr(x, data, indices, indptr, n),
        "dense": lambda: x @ w,
    }, repeat)
    t["convert"] = interleaved_ms({"c": lambda: to_csr(w)}, max(3, repeat // 2))["c"]
    return t


def two_four_case(x: np.ndarray, w: np.ndarray, repeat: int) -> dict[str, float]:
    """Milliseconds of the 2:4 kernel and dense BLAS on one 2:4 weight."""
    values, meta = compress_2_4(w)
    y = matmul_2_4(x, values, meta, w.shape)
    assert np.allclose(y, x @ w, rtol=1e-4, atol=1e-3 * np.sqrt(w.shape[0]))
    t = interleaved_ms({"ours": lambda: matmul_2_4(x, values, meta, w.shape),
                        "dense": lambda: x @ w}, repeat)
    t["convert"] = interleaved_ms({"c": lambda: compress_2_4(w)}, max(3, repeat // 2))["c"]
    return t


def run(rows: int, k: int, n: int, sparsities: list[float], repeat: int) -> tuple[str, dict]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w0 = rng.standard_normal((k, n)).astype(np.float32)
    lines = ["| weight | kernel | mplower ms | reference | reference ms | ratio | conversion ms |",
             "|---|---|---|---|---|---|---|"]
    checks = {}
    for s in sparsities:
        t = csr_case(x, prune_magnitude(w0, s), repeat)
        label = f"{k}x{n}, {s:.0%} zeros"
        lines.append(f"| {label} | CSR @ dense | {t['ours_t']:.2f} | scipy.sparse csr @ dense "
                     f"| {t['scipy']:.2f} | {t['ours_t'] / t['scipy']:.2f}x scipy's time | "
                     f"{t['convert']:.2f} |")
        lines.append(f"| {label} | x @ W (CSR) | {t['ours']:.2f} | numpy dense x @ W (BLAS) "
                     f"| {t['dense']:.2f} | {t['dense'] / t['ours']:.2f}x speedup | |")
        checks[s] = (t["ours_t"] / t["scipy"], t["dense"] / t["ours"])
    t = two_four_case(x, prune_structured(w0, "2:4", 0), repeat)
    lines.append(f"| {k}x{n}, 2:4 | x @ W (2:4) | {t['ours']:.2f} | numpy dense x @ W (BLAS) | "
                 f"{t['dense']:.2f} | {t['dense'] / t['ours']:.2f}x speedup | "
                 f"{t['convert']:.2f} |")
    checks["2:4"] = (None, t["dense"] / t["ours"])
    return "\n".join(lines), checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=512, help="rows of x (tokens in a batch)")
    ap.add_argument("--k", type=int, default=2048, help="reduction size of the weight")
    ap.add_argument("--n", type=int, default=2048, help="outputs of the weight")
    ap.add_argument("--sparsities", default="0.5,0.9,0.95,0.99")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None,
                    help="numba threads (default: numba's own default)")
    ap.add_argument("--out", help="also write the report to this file")
    args = ap.parse_args()
    if args.threads:
        numba.set_num_threads(args.threads)
    sparsities = [float(s) for s in args.sparsities.split(",")]
    table, checks = run(args.rows, args.k, args.n, sparsities, args.repeat)
    machine = (f"{platform.platform()}, {platform.processor() or platform.machine()}, "
               f"Python {platform.python_version()}, numpy {np.__version__}, "
               f"scipy {scipy.__version__}, numba {numba.__version__} "
               f"({numba.get_num_threads()} threads)")
    head = ["# Sparse kernels", "",
            f"- command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
            f"- machine: {machine}",
            f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
            f"- x: {args.rows}x{args.k} float32; medians of {args.repeat} interleaved runs", ""]
    verdicts = ["", "Acceptance:"]
    for s, (vs_scipy, vs_dense) in checks.items():
        if vs_scipy is not None:
            verdicts.append(f"- CSR at {s:.0%}: {vs_scipy:.2f}x scipy's time "
                            f"({'PASS' if vs_scipy <= 2 else 'FAIL'}: within 2x)")
        if s == 0.95:
            verdicts.append(f"- CSR at 95% vs dense BLAS: {vs_dense:.2f}x "
                            f"({'PASS' if vs_dense > 1 else 'FAIL'}: faster)")
    verdicts.append(f"- 2:4 vs dense BLAS: {checks['2:4'][1]:.2f}x (reported; on a CPU the "
                    f"2:4 layout saves half the multiply-adds but gathers its operands)")
    report = "\n".join(head) + "\n" + table + "\n" + "\n".join(verdicts) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(report)


if __name__ == "__main__":
    main()
