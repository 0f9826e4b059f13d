"""Speed of the numba backend against the issue-4 acceptance figures, all measured in one run.

1. 1024x1024x1024 matmul: numpy's fp32 `a @ b` against the executor's emulated paths, each a
   one-op module run through `Program.run_lowered` on inputs already in their format (so the
   time is the matmul step, output rounding included): bf16 x bf16 -> bf16 with an f32
   accumulator, f8E4M3FN x f8E4M3FN -> f32, i8 x i8 -> i32. A second figure per path starts
   from f32 inputs and includes the casts (quantize for i8) that bring them into the format.
2. Rounding kernels: `round_to(x, fmt)` against `x.astype(T).astype(np.float32)` with T the
   ml_dtypes type, on 16M standard-normal float32 (allocation included on both sides), plus
   `encode` against `x.astype(T)` and the cost of first touching a fresh result array, which
   both round trips pay and which bounds what the kernel's speed can show.
3. The transformer example under the bf16 plan against the fp32 plan, each put through the
   `fuse` pass: `Program.run_lowered`, what `mplower bench` times.
4. Start-up: wall time of a fresh `mplower run ir_examples/mlp.ir` process, after one run that
   warms the numba cache (median of 3).
5. The cost of determinism: mplower's fixed-order GEMM (mplower.numerics.gemm, what every f32
   matmul and conv of the executor and the fp32 reference runs) on f32 operands against
   numpy's BLAS `a @ b` at n^3 and batch 1 (1 x n @ n x n), and the conv2d reference semantics
   (im2col + that GEMM) against the same im2col followed by numpy's BLAS matmul.

Timings that are compared run interleaved (A B A B ...) so that load from other processes on
a shared machine hits both sides alike; each figure is the median of --repeat runs after a
warm-up. Prints a markdown report headed by the command, machine, BLAS and date (--out also
writes it to a file). Run from the repository root: `python benchmarks/backend.py`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numba
import numpy as np
from mplower.passes.insert_casts import materialize

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.backend.executor import Program
from mplower.ir.opdef import OPS, check_attrs
from mplower.ir.parser import parse
from mplower.numerics.gemm import matmul
from mplower.numerics.rounding import encode, round_to
from mplower.numerics.windows import conv_windows, pad_hw
from mplower.pass_manager import PassContext, load_passes

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "ir_examples"


def interleaved_ms(fns: dict[str, Callable[[], object]], repeat: int,
                   inner: int = 1) -> dict[str, float]:
    """Median milliseconds per call of each function, the functions taking turns."""
    for fn in fns.values():  # warm-up: compilation, caches, first touch
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - t0) / inner)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def program(text: str) -> Program:
    module = parse(text, "<benchmark>")
    module.path = str(ROOT / "<benchmark>")
    return Program(module)


def matmul_module(elem: str, out: str, n: int, with_casts: bool) -> str:
    t_in, t_out = f"tensor<{n}x{n}x{elem}>", f"tensor<{n}x{n}x{out}>"
    if not with_casts:
        return (f"func.func @main(%a: {t_in}, %b: {t_in}) -> {t_out} {{\n"
                f"  %y = mp.matmul %a, %b : ({t_in}, {t_in}) -> {t_out}\n"
                f"  return %y : {t_out}\n}}\n")
    t32 = f"tensor<{n}x{n}xf32>"
    if elem == "i8":
        conv = "mp.quantize %{v} {{scale = 0.03 : f32}}"
    else:
        conv = "mp.cast %{v}"
    lines = [f"func.func @main(%a: {t32}, %b: {t32}) -> {t_out} {{"]
    for v in "ab":
        lines.append(f"  %{v}q = {conv.format(v=v)} : ({t32}) -> {t_in}")
    lines.append(f"  %y = mp.matmul %aq, %bq : ({t_in}, {t_in}) -> {t_out}")
    lines.append(f"  return %y : {t_out}\n}}\n")
    return "\n".join(lines)


def matmuls(n: int, repeat: int) -> list[tuple[str, float, float, str, float]]:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    paths = {"bf16 (f32 accum) -> bf16": ("bf16", "bf16"),
             "f8E4M3FN (f32 accum) -> f32": ("f8E4M3FN", "f32"),
             "i8 x i8 -> i32": ("i8", "i32")}
    fns: dict[str, Callable[[], object]] = {"numpy": lambda: a @ b}
    for label, (elem, out) in paths.items():
        step = program(matmul_module(elem, out, n, with_casts=False))
        if elem == "i8":
            ins = [rng.integers(-128, 128, (n, n)).astype(np.int8) for _ in range(2)]
        else:
            ins = step.prepare_inputs([a, b])
        fns[label] = lambda p=step, x=ins: p.run_lowered(x)
        casts = program(matmul_module(elem, out, n, with_casts=True))
        casts_in = casts.prepare_inputs([a, b])
        fns[label + " +casts"] = lambda p=casts, x=casts_in: p.run_lowered(x)
    ms = interleaved_ms(fns, repeat)
    rows = []
    for label in paths:
        rows.append((f"matmul {n}^3 {label}, vs numpy fp32 `a @ b`", ms[label], ms["numpy"],
                     "<= 1.3x", ms[label] / ms["numpy"]))
        rows.append(("  ... including the input casts (f32 -> format)", ms[label + " +casts"],
                     ms["numpy"], "(info)", ms[label + " +casts"] / ms["numpy"]))
    return rows


def determinism(n: int, repeat: int) -> list[tuple[str, float, float, str, float]]:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    row = a[:1].copy()
    x = rng.standard_normal((8, 64, 56, 56)).astype(np.float32)
    w = rng.standard_normal((64, 64, 3, 3)).astype(np.float32)
    conv = OPS["mp.conv2d"]
    attrs = check_attrs(conv, {"padding": [1, 1, 1, 1]})

    def conv_blas() -> np.ndarray:  # the same im2col, summed by BLAS
        win = conv_windows(pad_hw(x, (1, 1, 1, 1)), (3, 3), (1, 1))
        cols = win.transpose(0, 2, 3, 1, 4, 5).reshape(8, 56 * 56, 64 * 9)
        return np.matmul(cols, w.reshape(64, -1).T).transpose(0, 2, 1).reshape(8, 64, 56, 56)

    ms = interleaved_ms({"gemm": lambda: matmul(a, b), "blas": lambda: a @ b,
                         "gemv": lambda: matmul(row, b), "blas_v": lambda: row @ b,
                         "conv": lambda: conv.reference([x, w], attrs, None),
                         "conv_blas": conv_blas}, repeat)
    return [
        (f"fixed-order f32 GEMM {n}^3 (`numerics.gemm.matmul`, f32 products) vs numpy `a @ b`",
         ms["gemm"], ms["blas"], "<= 1.3x", ms["gemm"] / ms["blas"]),
        (f"  ... batch 1: 1x{n} @ {n}x{n}", ms["gemv"], ms["blas_v"], "(info)",
         ms["gemv"] / ms["blas_v"]),
        ("conv2d reference 8x64x56x56 * 64x64x3x3: im2col + fixed-order GEMM vs im2col + BLAS",
         ms["conv"], ms["conv_blas"], "<= 1.3x", ms["conv"] / ms["conv_blas"]),
    ]


def rounding(size: int, repeat: int) -> list[tuple[str, float, float, str, float]]:
    x = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    rows = []
    for fmt, t, goal in (("bf16", ml_dtypes.bfloat16, 2.0),
                         ("f8E4M3FN", ml_dtypes.float8_e4m3fn, 10.0)):
        ms = interleaved_ms({"ours": lambda fmt=fmt: round_to(x, fmt),
                             "ref": lambda t=t: x.astype(t).astype(np.float32),
                             "enc": lambda fmt=fmt: encode(x, fmt),
                             "enc_ref": lambda t=t: x.astype(t)}, repeat)
        what = (f"`round_to(x, \"{fmt}\")` vs `x.astype({t.__name__}).astype(float32)`, "
                f"{size / 2**20:g}M")
        rows.append((what, ms["ours"], ms["ref"], f">= {goal:g}x faster", ms["ref"] / ms["ours"]))
        rows.append((f"  ... `encode(x, \"{fmt}\")` vs `x.astype({t.__name__})`",
                     ms["enc"], ms["enc_ref"], "(info)", ms["enc_ref"] / ms["enc"]))
    # Both sides of the round trips above write a fresh float32 array; its first touch (page
    # faults and zeroing) is part of either figure and is measured here on its own.
    touched = np.empty_like(x)
    ms = interleaved_ms({"fresh": lambda: np.empty_like(x).fill(1.0),
                         "touched": lambda: touched.fill(1.0)}, repeat)
    rows.append((f"  ... filling a fresh {x.nbytes >> 20} MB array vs an already touched one",
                 ms["fresh"], ms["touched"], "(info)", ms["fresh"] / ms["touched"]))
    return rows


def transformer(repeat: int, inner: int) -> list[tuple[str, float, float, str, float]]:
    with np.load(EXAMPLES / "transformer_inputs.npz") as data:
        x = data["x"]
    progs = {}
    for policy in ("fp32", "bf16"):
        path = EXAMPLES / "transformer.ir"
        module = parse(path.read_text(), str(path))
        module.path = str(path)
        load_passes()["assign-precision"](policy=policy).run(module, PassContext())
        materialize(module)  # the plan's casts, as `mplower bench` adds them
        load_passes()["fuse"]().run(module, PassContext())  # bench runs what fuse printed
        progs[policy] = Program(module)
    prepared = {k: p.prepare_inputs([x]) for k, p in progs.items()}
    fns = {k: lambda p=p, xs=prepared[k]: p.run_lowered(xs) for k, p in progs.items()}
    ms = interleaved_ms(fns, repeat, inner)
    return [("transformer example, executor time of the bf16 plan vs the fp32 plan",
             ms["bf16"], ms["fp32"], "<= 2x", ms["bf16"] / ms["fp32"])]


def startup() -> list[tuple[str, float, float, str, float]]:
    cmd = [sys.executable, "-m", "mplower", "run", str(EXAMPLES / "mlp.ir")]
    subprocess.run(cmd, check=True, capture_output=True)  # warms the numba cache
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        walls.append(time.perf_counter() - t0)
    s = statistics.median(walls)
    return [("second-process `mplower run ir_examples/mlp.ir`, wall (s, not ms)", s, 2.5,
             "< 2.5 s", s)]


def machine() -> list[str]:
    blas = "threadpoolctl not installed"
    try:
        import threadpoolctl

        blas = "; ".join(f"{i['internal_api']} {i.get('version')} ({i['num_threads']} threads"
                         f"{', ' + i['architecture'] if i.get('architecture') else ''})"
                         for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas")
    except ImportError:
        pass
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    cpu = (f"{platform.platform()}, {platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), numba "
           f"{numba.__version__} with {numba.get_num_threads()} threads "
           f"({numba.threading_layer()})")
    coretype = os.environ.get("OPENBLAS_CORETYPE", "(unset)")
    return [
        f"- command: `{shlex.join([os.path.basename(sys.executable)] + sys.argv)}`",
        f"- machine: {cpu}",
        f"- numpy {np.__version__}, BLAS: {blas}; OPENBLAS_CORETYPE={coretype}",
        f"- ml_dtypes {ml_dtypes.__version__}, Python {platform.python_version()}",
        f"- load average at start (1, 5, 15 min): {load}",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1024, help="matmul size n for n^3 (default 1024)")
    ap.add_argument("--size", type=int, default=1 << 24, help="rounding elements (default 2^24)")
    ap.add_argument("--repeat", type=int, default=7, help="timed runs per figure (median, >= 5)")
    ap.add_argument("--inner", type=int, default=50,
                    help="transformer runs per timed sample (default 50)")
    ap.add_argument("--out", help="also write the report to this file")
    args = ap.parse_args()
    lines = ["## Backend (issue 4 acceptance)", "", *machine(), "",
             "| figure | mplower ms | baseline ms | goal | ratio | verdict |",
             "|---|---:|---:|---|---:|---|"]
    rows = (matmuls(args.n, args.repeat) + determinism(args.n, args.repeat)
            + rounding(args.size, args.repeat) + transformer(args.repeat, args.inner) + startup())
    for what, ours, base, goal, ratio in rows:
        if goal.startswith(">="):
            ok = ratio >= float(goal.split()[1].rstrip("x"))
        elif goal.startswith("<="):
            ok = ratio <= float(goal.split()[1].rstrip("x"))
        elif goal.startswith("<"):
            ok = ratio < float(goal.split()[1])
        else:
            ok = None
        verdict = "-" if ok is None else ("pass" if ok else "FAIL")
        lines.append(f"| {what} | {ours:.3f} | {base:.3f} | {goal} | {ratio:.2f}x | {verdict} |")
    lines += ["", ("Ratios are mplower / baseline for times and baseline / mplower for "
                   "\"faster\"; the start-up row is seconds against the 2.5 s limit.")]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
