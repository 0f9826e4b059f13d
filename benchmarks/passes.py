"""Time the precision pipeline (assign-precision, legalize, insert-casts, canonicalize) per pass.

Generates transformer-like blocks of ops (matmul with a weight constant, bias add, gelu,
matmul, residual add, layer_norm, softmax) up to N ops, runs the four passes with the bf16
sheet on the h100 target, and reports each pass's wall time (median of --repeat runs, one
process) at 10k and 100k ops, with the per-1k-op cost to show linearity.

    python benchmarks/passes.py [--sizes 10000 100000] [--repeat 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import time

import mplower.dialect  # noqa: F401  (registers the mp ops the generated module uses)
from mplower.ir.parser import parse
from mplower.ir.verifier import verify
from mplower.pass_manager import Instrumentation, PassManager, parse_pipeline

PIPELINE = "assign-precision{policy=bf16},legalize{target=h100},insert-casts,canonicalize"
T = "tensor<16x64xf32>"


def module_text(n_ops: int) -> str:
    lines = [f"func.func @main(%x: {T}) -> {T} {{",
             '  %w = mp.constant {name = "w"} : () -> tensor<64x64xf32>',
             '  %b = mp.constant {name = "b"} : () -> tensor<64xf32>']
    prev, i = "%x", 0
    block = [
        "mp.matmul {a}, %w : ({T}, tensor<64x64xf32>) -> {T}",
        "mp.add {a}, %b : ({T}, tensor<64xf32>) -> {T}",
        "mp.gelu {a} : ({T}) -> {T}",
        "mp.matmul {a}, %w : ({T}, tensor<64x64xf32>) -> {T}",
        "mp.add {a}, {r} : ({T}, {T}) -> {T}",
        ("mp.layer_norm {a}, %b, %b {{axis = 1, epsilon = 1.0e-05}} : "
         "({T}, tensor<64xf32>, tensor<64xf32>) -> {T}"),
        "mp.softmax {a} {{axis = -1}} : ({T}) -> {T}",
    ]
    residual = prev
    while i < n_ops:
        for k, op in enumerate(block):
            if k == 0:
                residual = prev
            lines.append(f"  %v{i} = " + op.format(a=prev, r=residual, T=T))
            prev = f"%v{i}"
            i += 1
    lines.append(f"  return {prev} : {T}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def run(n_ops: int, repeat: int) -> dict[str, float]:
    text = module_text(n_ops)
    times: dict[str, list[float]] = {}
    for _ in range(repeat):
        module = parse(text)
        verify(module)
        pm = PassManager(parse_pipeline(PIPELINE), Instrumentation(verify_each=False))
        gc.collect()
        gc.disable()  # as `mplower opt` runs (mplower.cli.main.main): the IR holds no cycles
        t0 = time.perf_counter()
        pm.run(module)
        total = time.perf_counter() - t0
        gc.enable()
        for name, t in pm.timings:
            times.setdefault(name, []).append(t)
        times.setdefault("total", []).append(total)
        verify(module)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = [(n, run(n, args.repeat)) for n in args.sizes]
    names = [k for k in rows[0][1] if k != "total"] + ["total"]
    sizes = " ".join(map(str, args.sizes))
    out = [f"Command: `python benchmarks/passes.py --sizes {sizes} --repeat {args.repeat}`  ",
           (f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}; date {datetime.date.today()}  "),
           f"Pipeline: `{PIPELINE}`, medians of {args.repeat} runs, verification off.", "",
           "| ops | " + " | ".join(names) + " | total per 1k ops |",
           "|---:|" + "---:|" * (len(names) + 1)]
    for n, t in rows:
        cells = " | ".join(f"{t[k]:.3f} s" for k in names)
        out.append(f"| {n} | {cells} | {1000 * t['total'] / n * 1000:.1f} ms |")
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
