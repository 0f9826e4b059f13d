"""mplower's executor against onnxruntime on real network shapes, one process, interleaved.

Models: four of the onnx wheel's light models (ResNet-50, Inception v1, SqueezeNet,
ShuffleNet), whose weights are constants, rebuilt with seeded random weights of the same shapes
(He-normal convolution and dense weights, near-identity batch norms) and the batch the table
asks for; and one BERT-base encoder layer (sequence 128, hidden 768, 12 heads, FFN 3072, GELU
in its exported erf form) built with onnx.helper. Each model is imported with mplower's
importer and lowered with the built-in sheets: bf16, fp16 and fp8 (`assign-precision`,
`insert-casts`) and static int8 (`assign-precision{policy=int8},calibrate,quantize` on
`--calib` seeded inputs), then `fuse` (fp32 too). onnxruntime (CPU, 2 intra-op threads) runs
the same ONNX model in fp32, and in int8 after `quantize_static` (QDQ, per channel, MinMax) on
the same samples.

Timed: `Program.run_lowered` on prepared inputs (what `mplower bench` times) and
`InferenceSession.run`, every configuration of a model once per round, in turns, after two
warm-up turns of every configuration; a configuration's round is the mean time of as many
back-to-back calls as fill MIN_ROUND seconds (one for the slow ones); the table gives medians
over the rounds, of the times, and of the ratios within each round (`paired`). Generated
models are cached under benchmarks/out/runtime/ (ignored by git). Run from the repository
root:

    python benchmarks/runtime.py [--models resnet50,bert] [--batches 1,8] [--rounds 5]
                                 [--quick] [--write docs/benchmarks.md]

`--quick` is one round of ResNet-50 at batch 1 without fp16; `--calibration N` instead times
static int8 calibration of ResNet-50 on N samples (minmax and percentile), mplower's
calibrate + quantize passes against onnxruntime's whole quantize_static, each in a fresh
process with its peak RSS; `--write` replaces the section between the markers in the given
markdown file. onnxruntime is needed here only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx.version_converter
from docblock import replace_block
from onnx import TensorProto, helper, numpy_helper

from mplower.backend.executor import Program, reference_runner
from mplower.ir.parser import parse_file
from mplower.ir.printer import print_module
from mplower.onnx.importer import import_model
from mplower.pass_manager import PassContext, PassManager, parse_pipeline

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out" / "runtime"
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
MODELS = ("resnet50", "inception_v1", "squeezenet", "shufflenet", "bert")
TITLES = {"resnet50": "ResNet-50", "inception_v1": "Inception v1", "squeezenet": "SqueezeNet",
          "shufflenet": "ShuffleNet", "bert": "BERT layer"}
SHEETS = ("bf16", "fp16", "fp8", "int8")
BEGIN, END = "<!-- runtime.py begin -->", "<!-- runtime.py end -->"


# ---- models ---------------------------------------------------------------------------------

def _random_weights(model: onnx.ModelProto, batch: int, rng: np.random.Generator) -> None:
    """Replace the light model's ConstantOfShape weights by seeded random initializers of the
    same shape, and make its batch `batch` (input, outputs, leading 1 of Reshape shapes)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    role: dict[str, tuple[str, int]] = {}
    for node in g.node:
        for i, name in enumerate(node.input):
            role.setdefault(name, (node.op_type, i))
    keep, made = [], []
    for node in g.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = tuple(int(d) for d in numpy_helper.to_array(inits[node.input[0]]))
            out = node.output[0]
            op, i = role.get(out, ("", 0))
            if len(shape) >= 2:  # conv / dense weight: He-normal
                v = rng.standard_normal(shape) * np.sqrt(2.0 / max(1, int(np.prod(shape[1:]))))
            elif op == "BatchNormalization":  # scale, bias, mean, var: near identity
                v = [rng.uniform(0.5, 1.0, shape), 0.1 * rng.standard_normal(shape),
                     0.1 * rng.standard_normal(shape), rng.uniform(0.5, 1.5, shape)][i - 1]
            else:  # biases
                v = 0.01 * rng.standard_normal(shape)
            made.append(numpy_helper.from_array(np.asarray(v, np.float32), out))
        else:
            keep.append(node)
    used = {n for node in keep for n in node.input}
    for t in list(g.initializer):
        if t.name not in used:
            g.initializer.remove(t)
        elif t.data_type == TensorProto.INT64 and role.get(t.name, ("",))[0] == "Reshape":
            shape = numpy_helper.to_array(t).copy()
            if shape.size and shape[0] == 1:
                shape[0] = batch
                t.CopyFrom(numpy_helper.from_array(shape, t.name))
    g.initializer.extend(made)
    del g.node[:]
    g.node.extend(keep)
    names = {t.name for t in g.initializer}
    for v in list(g.input):  # old models list initializers (and the unused) as inputs too
        if v.name in names or v.name not in used:
            g.input.remove(v)
    for v in list(g.input) + list(g.output):
        v.type.tensor_type.shape.dim[0].dim_value = batch
    del g.value_info[:]
    model.ir_version = max(model.ir_version, 4)  # initializers need not be graph inputs


def light_model(name: str, batch: int) -> onnx.ModelProto:
    model = onnx.load(str(LIGHT / f"light_{name}.onnx"))
    _random_weights(model, batch, np.random.default_rng(0))
    # Opset 13 for onnxruntime's per-channel QDQ (DequantizeLinear gained `axis` there).
    return onnx.version_converter.convert_version(model, 13)


def bert_layer(batch: int, seq: int = 128, hidden: int = 768, heads: int = 12,
               ffn: int = 3072) -> onnx.ModelProto:
    """One BERT-base encoder layer (post-norm), GELU as x * 0.5 * (1 + erf(x / sqrt 2))."""
    rng = np.random.default_rng(0)
    d = hidden // heads
    inits, nodes = [], []

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def dense(x: str, n_in: int, n_out: int, name: str) -> str:
        w = const(f"{name}.w", (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in))
                  .astype(np.float32))
        b = const(f"{name}.b", (0.02 * rng.standard_normal(n_out)).astype(np.float32))
        nodes.append(helper.make_node("MatMul", [x, w], [f"{name}.mm"]))
        nodes.append(helper.make_node("Add", [f"{name}.mm", b], [name]))
        return name

    def heads_of(x: str, perm: list[int]) -> str:
        nodes.append(helper.make_node("Reshape", [x, shape4], [f"{x}.4d"]))
        nodes.append(helper.make_node("Transpose", [f"{x}.4d"], [f"{x}.h"], perm=perm))
        return f"{x}.h"

    def layer_norm(x: str, name: str) -> str:
        g = const(f"{name}.g", rng.uniform(0.8, 1.2, hidden).astype(np.float32))
        b = const(f"{name}.b", (0.02 * rng.standard_normal(hidden)).astype(np.float32))
        nodes.append(helper.make_node("LayerNormalization", [x, g, b], [name], axis=-1,
                                      epsilon=1e-12))
        return name

    shape4 = const("shape4", np.array([batch, seq, heads, d], np.int64))
    shape3 = const("shape3", np.array([batch, seq, hidden], np.int64))
    q = heads_of(dense("x", hidden, hidden, "q"), [0, 2, 1, 3])
    k = heads_of(dense("x", hidden, hidden, "k"), [0, 2, 3, 1])
    v = heads_of(dense("x", hidden, hidden, "v"), [0, 2, 1, 3])
    scale = const("scale", np.array(1 / np.sqrt(d), np.float32))
    nodes += [helper.make_node("MatMul", [q, k], ["scores"]),
              helper.make_node("Mul", ["scores", scale], ["scaled"]),
              helper.make_node("Softmax", ["scaled"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", v], ["ctx.h"]),
              helper.make_node("Transpose", ["ctx.h"], ["ctx.t"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ctx.t", shape3], ["ctx"])]
    attn = dense("ctx", hidden, hidden, "o")
    nodes.append(helper.make_node("Add", [attn, "x"], ["res1"]))
    h = layer_norm("res1", "ln1")
    up = dense(h, hidden, ffn, "up")
    inv_sqrt2 = const("inv_sqrt2", np.array(1 / np.sqrt(2), np.float32))
    half, one = const("half", np.array(0.5, np.float32)), const("one", np.array(1, np.float32))
    nodes += [helper.make_node("Mul", [up, inv_sqrt2], ["g.s"]),
              helper.make_node("Erf", ["g.s"], ["g.erf"]),
              helper.make_node("Add", ["g.erf", one], ["g.1"]),
              helper.make_node("Mul", [up, half], ["g.h"]),
              helper.make_node("Mul", ["g.h", "g.1"], ["gelu"])]
    down = dense("gelu", ffn, hidden, "down")
    nodes.append(helper.make_node("Add", [down, h], ["res2"]))
    out = layer_norm("res2", "ln2")
    nodes.append(helper.make_node("Identity", [out], ["y"]))
    graph = helper.make_graph(
        nodes, "bert_layer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, hidden])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def onnx_model(name: str, batch: int) -> Path:
    path = OUT / f"{name}_b{batch}.onnx"
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        model = bert_layer(batch) if name == "bert" else light_model(name, batch)
        onnx.checker.check_model(model)
        onnx.save(model, str(path))
    return path


def samples(model: onnx.ModelProto, count: int, seed: int) -> list[np.ndarray]:
    """`count` seeded inputs of the model's one input shape (images in [0, 1), BERT N(0, 1))."""
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(seed)
    if len(shape) == 4:
        return [rng.random(shape, np.float32) for _ in range(count)]
    return [rng.standard_normal(shape, np.float32) for _ in range(count)]


# ---- mplower --------------------------------------------------------------------------------

def mplower_ir(path: Path) -> Path:
    ir = path.with_suffix(".ir")
    if not ir.exists():
        imported = import_model(onnx.load(str(path)), str(path))
        module = imported.module
        if imported.weights:
            np.savez(path.with_suffix(".npz"), **imported.weights)
            module.attrs["mp.weights"] = path.with_suffix(".npz").name
        ir.write_text(print_module(module))
    return ir


def lowered(ir: Path, sheet: str, calib: Path) -> Program:
    """The model lowered with `sheet` and fused (`fuse`: what run_lowered runs is what the
    pipeline printed)."""
    module = parse_file(ir)
    steps = "fuse"
    if sheet != "fp32":
        steps = (f"assign-precision{{policy=int8}},calibrate{{data={calib}}},quantize,fuse"
                 if sheet == "int8" else f"assign-precision{{policy={sheet}}},insert-casts,fuse")
    PassManager(parse_pipeline(steps)).run(module, PassContext(runner=reference_runner))
    return Program(module)


# ---- onnxruntime ----------------------------------------------------------------------------

def ort_session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.inter_op_num_threads = 1
    # Its pool would spin after each run and slow whatever runs next (measured: mplower's
    # fp32 plan, next in turn, at twice its time alone); mplower's workers block too.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def ort_int8(path: Path, calib: list[np.ndarray], method=None, out: Path | None = None) -> Path:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    q = out or path.with_name(path.stem + "_int8.onnx")
    if out is not None or not q.exists():
        name = onnx.load(str(path), load_external_data=False).graph.input[0].name

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self.items = iter([{name: x} for x in calib])

            def get_next(self):
                return next(self.items, None)

        extra = {} if method is None else {"calibrate_method": method}
        quantize_static(str(path), str(q), Reader(), quant_format=QuantFormat.QDQ,
                        per_channel=True, activation_type=QuantType.QInt8,
                        weight_type=QuantType.QInt8, **extra)
    return q


# ---- timing ---------------------------------------------------------------------------------

WARM_TURNS = 2
# A round of a configuration is as many back-to-back calls as fill this many seconds (one at
# least), timed together: a batch-1 call of a few milliseconds varied by +-30% from call to
# call on this shared VM, so a median of single calls moved the lowered/fp32 ratios by +-0.1
# between runs; the mean of a round's calls is what a server running them in turn gets.
MIN_ROUND = 0.1


def interleaved(fns: dict[str, Callable[[], object]], rounds: int,
                raw: dict[str, list[float]] | None = None) -> dict[str, float]:
    """Median seconds per call of each function, the functions taking turns; `raw` (a dict)
    gets every round's seconds per call too."""
    # Warm-up: compilation, caches, first touch. Two turns each: the configurations share one
    # heap, and until each has run after the others its first call still touches new pages
    # (ResNet-50 b8 fp32's first timed call took 0.9-1.0 s against 0.25-0.3 after one turn).
    last: dict[str, float] = {}
    for _ in range(WARM_TURNS):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            last[name] = time.perf_counter() - t0
    calls = {k: max(1, math.ceil(MIN_ROUND / max(t, 1e-6))) for k, t in last.items()}
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each round rotated
            fn, n = fns[name], calls[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - t0) / n)
            time.sleep(0.05)  # let the helper threads settle
    if raw is not None:
        raw.update(times)
    return {k: statistics.median(v) for k, v in times.items()}


def measure(name: str, batch: int, rounds: int, sheets: tuple[str, ...],
            calib_count: int, raw: dict[str, list[float]] | None = None) -> dict[str, float]:
    path = onnx_model(name, batch)
    model = onnx.load(str(path))
    x = samples(model, 1, seed=1)[0]
    calib = samples(model, calib_count, seed=2)
    calib_npz = path.with_name(f"{path.stem}_calib.npz")
    arg = import_model(model, str(path)).inputs[0]
    np.savez(calib_npz, **{_arg_key(arg): np.stack(calib)})
    ir = mplower_ir(path)
    fns: dict[str, Callable[[], object]] = {}
    for sheet in ("fp32",) + sheets:
        program = lowered(ir, sheet, calib_npz)
        prepared = program.prepare_inputs([x])
        fns[sheet] = lambda p=program, xs=prepared: p.run_lowered(xs)
    feed = {model.graph.input[0].name: x}
    for label, source in (("ort fp32", path), ("ort int8", ort_int8(path, calib))):
        session = ort_session(source)
        fns[label] = lambda s=session: s.run(None, feed)
    return interleaved(fns, rounds, raw)


CALIBRATE_CHILD = """
import json, resource, sys, time
sys.path.insert(0, {bench!r})
import runtime
tool, method, onnx_path, ir, npz = {args!r}
t0, c0 = time.perf_counter(), time.process_time()
if tool == "mplower":
    import mplower.dialect
    from mplower.backend.executor import reference_runner
    from mplower.ir.parser import parse_file
    from mplower.pass_manager import PassContext, PassManager, parse_pipeline
    module = parse_file(ir)
    steps = "assign-precision{{policy=int8}},calibrate{{data=%s method=%s}},quantize" % (npz, method)
    PassManager(parse_pipeline(steps)).run(module, PassContext(runner=reference_runner))
else:
    import numpy as np
    from onnxruntime.quantization import CalibrationMethod
    with np.load(npz) as z:
        calib = list(z[z.files[0]])
    method = {{"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile}}
    runtime.ort_int8(runtime.Path(onnx_path), calib, method[tool.split()[-1]],
                     runtime.Path(npz).with_suffix(".ort_%s.onnx" % tool.split()[-1]))
seconds = time.perf_counter() - t0
print(json.dumps([seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  time.process_time() - c0]))
"""


# Each calibrating child may map this much memory: onnxruntime's percentile calibrator keeps
# every activation of every sample (5.5 GB at 32 ResNet-50 samples), and on a shared machine
# its growth got the kernel's OOM killer going; over the cap it fails on its own instead.
CHILD_MEMORY = 12 << 30


def _memory_cap() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))


def calibration(count: int) -> list[str]:
    """Static int8 of ResNet-50 (batch 1) calibrated on `count` seeded samples, each tool in a
    fresh process (address space capped at CHILD_MEMORY): seconds for calibrate + quantize,
    and the process's peak RSS."""
    import json
    import subprocess

    path = onnx_model("resnet50", 1)
    model = onnx.load(str(path))
    npz = OUT / f"resnet50_b1_calib{count}.npz"
    if not npz.exists():
        arg = import_model(model, str(path)).inputs[0]
        np.savez(npz, **{_arg_key(arg): np.stack(samples(model, count, seed=3))})
    ir = mplower_ir(path)
    lines = [(f"Calibrating ResNet-50 (batch 1) on {count} samples, each tool in a fresh "
              f"process capped at {CHILD_MEMORY >> 30} GiB of address space (seconds for "
              "calibrate + quantize; peak RSS of the process, MiB):"), "",
             ("| method | mplower s | onnxruntime quantize_static s | mplower MiB | "
              "onnxruntime MiB |"), "|---|---|---|---|---|"]
    for method in ("minmax", "percentile"):
        got = {}
        for tool in ("mplower", f"ort {method}"):
            code = CALIBRATE_CHILD.format(bench=str(Path(__file__).parent),
                                          args=(tool, method, str(path), str(ir), str(npz)))
            run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=False, preexec_fn=_memory_cap)  # a failure is a result
            got[tool.split()[0]] = (json.loads(run.stdout.strip().splitlines()[-1])
                                    if run.returncode == 0 else None)
            if got[tool.split()[0]]:  # CPU seconds (all threads): what the load does not change
                wall, rss, cpu = got[tool.split()[0]]
                print(f"{tool.split()[0]} {method}: {wall:.1f} s, {cpu:.1f} s CPU, {rss:.0f} MiB",
                      flush=True)
        cells = [f"{v[0]:.1f}" if v else "failed" for v in (got["mplower"], got["ort"])]
        cells += [f"{v[1]:.0f}" if v else "-" for v in (got["mplower"], got["ort"])]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines += ["", (f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; load "
                   f"average at the end {os.getloadavg()[0]:.2f}.")]
    print(lines[-1])
    return lines


def _arg_key(onnx_name: str) -> str:
    """The calibration .npz key of the imported argument (its SSA name without the %)."""
    from mplower.onnx.importer import _ssa_name

    return _ssa_name(onnx_name).lstrip("%")


def paired(rounds: dict[str, list[float]], a: str, b: str) -> float:
    """The median over the rounds of a's time over b's in the same round. The configurations
    of a round run within about a second of each other, while this VM's speed drifted by up
    to 2x over a model's rounds (ShuffleNet b8 fp32 45-92 ms in one run): a ratio of the two
    medians could compare a fast round of one with a slow round of the other."""
    return statistics.median(x / y for x, y in zip(rounds[a], rounds[b], strict=True))


def table(rows: list[tuple[str, int, dict[str, float], dict[str, list[float]]]],
          sheets: tuple[str, ...]) -> list[str]:
    head = (["model", "batch", "mplower fp32 ms", "ORT fp32 ms", "mplower fp32 / ORT fp32"]
            + [f"{s} / mplower fp32" for s in sheets] + ["ORT int8 / ORT fp32"])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, batch, t, r in rows:
        cells = [TITLES[name], str(batch), f"{t['fp32'] * 1e3:.1f}", f"{t['ort fp32'] * 1e3:.1f}",
                 f"{paired(r, 'fp32', 'ort fp32'):.2f}"]
        cells += [f"{paired(r, s, 'fp32'):.2f}" for s in sheets]
        cells.append(f"{paired(r, 'ort int8', 'ort fp32'):.2f}")
        out.append("| " + " | ".join(cells) + " |")
    return out


def write_section(path: Path, lines: list[str], part: str = "table") -> None:
    replace_block(path, lines, BEGIN.replace("runtime.py", f"runtime.py {part}"),
                  END.replace("runtime.py", f"runtime.py {part}"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calib", type=int, default=4, help="calibration samples (batches)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--calibration", type=int, default=0, metavar="N",
                   help="instead: time static int8 calibration of ResNet-50 on N samples")
    p.add_argument("--write", type=Path, help="markdown file whose runtime.py section to replace")
    p.add_argument("--raw", type=Path, help="JSON file for every round's seconds per model")
    args = p.parse_args(argv)
    models = tuple(args.models.split(","))
    batches = tuple(int(b) for b in args.batches.split(","))
    sheets, rounds = SHEETS, args.rounds
    if args.quick:
        models, batches, sheets, rounds = ("resnet50",), (1,), ("bf16", "fp8", "int8"), 1
    for m in models:
        if m not in MODELS:
            p.error(f"unknown model {m!r} (known: {', '.join(MODELS)})")
    if args.calibration:
        lines = calibration(args.calibration)
        if args.write:
            write_section(args.write, lines, "calibration")
        return 0
    rows, raw = [], {}
    for name in models:
        for batch in batches:
            raw[f"{name} b{batch}"] = {}
            t = measure(name, batch, rounds, sheets, args.calib, raw[f"{name} b{batch}"])
            rows.append((name, batch, t, raw[f"{name} b{batch}"]))
            if args.raw:
                args.raw.write_text(json.dumps(raw, indent=1))
            print(f"{name} b{batch}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()),
                  flush=True)
    import numba
    import onnxruntime

    lines = [f"Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`  ",
             (f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"Python {platform.python_version()}, numba {numba.__version__}, onnxruntime "
              f"{onnxruntime.__version__} (2 intra-op threads)  "),
             (f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; load "
              f"average at the end {os.getloadavg()[0]:.2f}  "),
             (f"Medians of {rounds} interleaved round(s) after {WARM_TURNS} warm-up calls "
              f"each; a round of a configuration is the mean of as many back-to-back calls as "
              f"fill {MIN_ROUND} s. Times are medians over the rounds; a ratio is the median "
              f"over the rounds of the ratio within each round."), ""]
    lines += table(rows, sheets)
    print("\n".join(lines))
    if args.write:
        write_section(args.write, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
