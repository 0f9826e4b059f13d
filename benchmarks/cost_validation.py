"""The cost model against onnxruntime on this machine: modeled and measured latency, ranked.

For each (model, plan, batch), the plan is exported with `mplower export` and timed in
onnxruntime's CPU provider (1 intra-op thread, the calling one, spinning off; the median CPU
time of that thread over interleaved rounds, the plans of a model taking turns after one
warm-up call each, with the wall time beside it), and priced with
mplower.lowering.cost.plan_cost on the host target that `mplower target measure --runtime
onnxruntime` writes at the start of the run (or `--target FILE`). Reported: the Spearman rank
correlation of modeled against measured latency over every pair (goal >= 0.8), and per model
the modeled int8/fp32 speedup against the measured one (goal: within 30%).

Models: the production shapes of ir_examples/production.py (BERT-base layer and GPT-2-small
block at 8 x 128 tokens, ResNet-50 at batch 8) and four of the onnx wheel's light models plus
the ONNX BERT layer with seeded random weights, built by benchmarks/runtime.py, at batch 1.
Plans: fp32 (the model as imported or generated) and int8 (`assign-precision{policy=int8},
calibrate{data=...},quantize` on 2 seeded batches; the exporter writes QuantizeLinear,
MatMulInteger/ConvInteger and DequantizeLinear). Generated files go to
benchmarks/out/cost_validation/ (ignored by git). Run from the repository root:

    python benchmarks/cost_validation.py [--rounds 5] [--models a,b] [--target host.toml]
                                         [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out" / "cost_validation"
BEGIN, END = "<!-- cost_validation.py begin -->", "<!-- cost_validation.py end -->"
# key: (title, source, batch). Sources: production:NAME (ir_examples/production.py) and
# light:NAME / bert (benchmarks/runtime.py's ONNX models).
MODELS: dict[str, tuple[str, str, int]] = {
    "bert-base": ("BERT-base layer", "production:bert_base_layer", 8),
    "gpt2": ("GPT-2-small block", "production:gpt2_block", 8),
    "resnet50-b8": ("ResNet-50", "production:resnet50", 8),
    "resnet50": ("ResNet-50 (light)", "light:resnet50", 1),
    "inception": ("Inception v1 (light)", "light:inception_v1", 1),
    "squeezenet": ("SqueezeNet (light)", "light:squeezenet", 1),
    "shufflenet": ("ShuffleNet (light)", "light:shufflenet", 1),
    "bert-onnx": ("BERT layer (ONNX)", "bert", 1),
}
PLANS = ("fp32", "int8")
INT8 = "assign-precision{{policy=int8}},calibrate{{data={calib}}},quantize"


def _load_script(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks of `xs`, ties sharing the mean of the ranks they span."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation: the Pearson correlation of the ranks (ties averaged)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("spearman needs two sequences of the same length, at least 2")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    if not vx or not vy:
        raise ValueError("spearman is undefined for a constant sequence")
    return cov / (vx * vy) ** 0.5


# ---- models and plans -----------------------------------------------------------------------

def _mplower(*args: object) -> None:
    from mplower.cli.main import main

    rc = main([str(a) for a in args])
    if rc != 0:
        raise RuntimeError(f"mplower {' '.join(map(str, args))} exited {rc}")


def fp32_ir(source: str, batch: int) -> Path:
    """The fp32 IR of a model source (generated or imported on first use)."""
    if source.startswith("production:"):
        production = _load_script("production", ROOT / "ir_examples" / "production.py")
        return production.ensure(source.split(":", 1)[1])
    runtime = _load_script("runtime", ROOT / "benchmarks" / "runtime.py")
    name = source.split(":", 1)[-1]
    return runtime.mplower_ir(runtime.onnx_model(name, batch))


def calibration(ir: Path, count: int = 2) -> Path:
    """`count` seeded batches of the function's one argument, keyed by its name."""
    from mplower.ir.parser import parse_file

    f = parse_file(ir).function()
    (arg,) = f.args
    name, shape = f.data(arg)["name"].lstrip("%"), f.types(arg)[0].shape
    path = OUT / f"{ir.stem}_calib.npz"
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        np.savez(path, **{name: _input(shape, np.random.default_rng(2), count)})
    return path


def _input(shape: tuple[int, ...], rng: np.random.Generator, count: int | None = None):
    """Images in [0, 1) for 4-D inputs, N(0, 1) activations otherwise."""
    full = shape if count is None else (count, *shape)
    return (rng.random(full, np.float32) if len(shape) == 4
            else rng.standard_normal(full, np.float32))


def plan_ir(ir: Path, plan: str) -> Path:
    if plan == "fp32":
        return ir
    out = OUT / f"{ir.stem}_{plan}.ir"
    if not out.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        _mplower("opt", ir, f"--pass-pipeline={INT8.format(calib=calibration(ir))}", "-o", out)
    return out


def exported(ir: Path, plan: str) -> Path:
    out = OUT / f"{ir.stem}{'_fp32' if plan == 'fp32' else ''}.onnx"  # int8 stems end _int8
    if not out.exists():
        _mplower("export", ir, "--format", "onnx", "-o", out)
    return out


def modeled_s(ir: Path, target) -> float:
    from mplower.ir.parser import parse_file
    from mplower.lowering.cost import plan_cost

    return plan_cost(parse_file(ir).function(), target).time_s


def session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # as `mplower target measure --runtime onnxruntime` times
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


# ---- the run --------------------------------------------------------------------------------

def interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, tuple[float,
                                                                                       float]]:
    """Median (CPU seconds of the calling thread, wall seconds) per call of each function, the
    functions taking turns as benchmarks/runtime.py's `interleaved` does. onnxruntime on one
    intra-op thread runs in the calling thread, so its CPU time is the inference's cost, which
    the other processes of a shared machine do not inflate (they do inflate the wall time)."""
    for fn in fns.values():  # warm-up: allocation, first touch
        fn()
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each round rotated
            c0, w0 = time.thread_time(), time.perf_counter()
            fns[name]()
            times[name].append((time.thread_time() - c0, time.perf_counter() - w0))
    return {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v))
            for k, v in times.items()}


def measure_target(path: Path) -> Path:
    _mplower("target", "measure", "--runtime", "onnxruntime", "-o", path)
    return path


def run(models: list[str], rounds: int, target_path: Path) -> list[dict]:
    from mplower.lowering.target import load_target

    target = load_target(str(target_path))
    rows = []
    for key in models:
        title, source, batch = MODELS[key]
        base = fp32_ir(source, batch)
        fns: dict[str, Callable[[], object]] = {}
        irs = {}
        for plan in PLANS:
            irs[plan] = plan_ir(base, plan)
            s = session(exported(irs[plan], plan))
            meta = s.get_inputs()[0]
            feed = {meta.name: _input(tuple(meta.shape), np.random.default_rng(1))}
            fns[plan] = lambda s=s, feed=feed: s.run(None, feed)
        measured = interleaved(fns, rounds)
        for plan in PLANS:
            cpu, wall = measured[plan]
            rows.append({"key": key, "title": title, "batch": batch, "plan": plan,
                         "measured_s": cpu, "wall_s": wall,
                         "modeled_s": modeled_s(irs[plan], target)})
            print(f"{title} b{batch} {plan}: measured {cpu * 1e3:.2f} ms CPU ({wall * 1e3:.2f} "
                  f"ms wall), modeled {rows[-1]['modeled_s'] * 1e3:.2f} ms", flush=True)
    return rows


def report(rows: list[dict], target_path: Path, rounds: int) -> list[str]:
    rho = spearman([r["modeled_s"] for r in rows], [r["measured_s"] for r in rows])
    import numba
    import onnxruntime

    from mplower.backend.measure import machine
    from mplower.lowering.target import load_target

    host = load_target(str(target_path))
    lines = [f"Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`  ",
             (f"Machine: {machine()}, numba {numba.__version__}, onnxruntime "
              f"{onnxruntime.__version__} (1 intra-op thread)  "),
             (f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; load average "
              f"at the end {os.getloadavg()[0]:.2f} (other engineers share the cores)  "),
             (f"Target: `{target_path.name}` from `mplower target measure --runtime onnxruntime`"
              f"; measured: medians of {rounds} interleaved rounds, CPU time of the inference "
              "thread (wall time beside it). The sheet: f32 "
              f"{host.formats['f32'].dense / 1e9:.0f} GFLOP/s, i8 "
              f"{host.formats['i8'].dense / 1e9:.0f} GOP/s, bandwidth {host.bandwidth / 1e9:.0f} "
              f"GB/s, overhead {host.overhead_s * 1e6:.2f} us, fuse {sorted(host.fuse)}; "
              "kernel classes (G(FL)OP/s): " + "; ".join(
                  f"{cls} " + ", ".join(f"{fmt} {r / 1e9:.3g}" for fmt, r in by.items())
                  for cls, by in host.rates.items()) + "."), "",
             ("| model | batch | fp32 ms: measured (CPU) / wall / modeled | int8 ms: measured "
              "(CPU) / wall / modeled | int8/fp32 speedup: measured / modeled | modeled / "
              "measured |"),
             "|---|---|---|---|---|---|"]
    within = 0
    by = {(r["key"], r["plan"]): r for r in rows}
    keys = list(dict.fromkeys(r["key"] for r in rows))
    for key in keys:  # one row per model: the speedup is what the cost model must get right
        f32, i8 = by[(key, "fp32")], by[(key, "int8")]
        measured = f32["measured_s"] / i8["measured_s"]
        modeled = f32["modeled_s"] / i8["modeled_s"]
        ok = abs(modeled / measured - 1) <= 0.3
        within += ok
        times = " | ".join(f"{r['measured_s'] * 1e3:.2f} / {r['wall_s'] * 1e3:.2f} / "
                           f"{r['modeled_s'] * 1e3:.2f}" for r in (f32, i8))
        lines.append(f"| {f32['title']} | {f32['batch']} | {times} | {measured:.2f}x / "
                     f"{modeled:.2f}x | {modeled / measured:.2f}"
                     f"{'' if ok else ' (off by more than 30%)'} |")
    lines += ["", (f"Spearman rank correlation, modeled vs measured latency over {len(rows)} "
                  f"pairs: **{rho:.3f}** (goal >= 0.8).")]
    lines += ["", (f"Modeled int8/fp32 speedup within 30% of the measured one: {within} of "
                  f"{len(keys)} models.")]
    return lines


def write_section(path: Path, lines: list[str]) -> None:
    _load_script("runtime", ROOT / "benchmarks" / "runtime.py").replace_block(
        path, lines, BEGIN, END)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--target", type=Path, help="a measured host sheet to price with (default: "
                                               "measure one now)")
    p.add_argument("--write", type=Path, help="markdown file whose cost_validation section to "
                                              "replace")
    args = p.parse_args(argv)
    models = args.models.split(",")
    for m in models:
        if m not in MODELS:
            p.error(f"unknown model {m!r} (known: {', '.join(MODELS)})")
    OUT.mkdir(parents=True, exist_ok=True)
    target = args.target or measure_target(OUT / "host.toml")
    rows = run(models, args.rounds, target)
    lines = report(rows, target, args.rounds)
    print("\n".join(lines))
    if args.write:
        write_section(args.write, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
