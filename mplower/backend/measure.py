"""A target sheet measured on this machine: what `mplower target measure` times and writes.

The cost model (mplower.lowering.cost) prices a plan from a target's peak rate per format, its
memory bandwidth and its per-kernel overhead. Datasheet figures say what a part could do; this
module times what a runtime on this host does, so that modeled and measured latencies can be
compared (benchmarks/cost_validation.py) and the measured sheet used like a built-in
(`--target host.toml`). It lives in the backend layer because it times the executor itself.

Two runtimes can be measured, and the sheet describes one of them:
- `mplower`: the executor as `mplower bench` runs a plan. Each format's GEMM rate is a
  one-matmul plan through `Program.run_lowered` (f32: mplower's fixed-order GEMM; bf16, f16,
  fp8: operands held in their format, the f32 product rounded back as the executor does; int8:
  the exact i8 x i8 -> i32 kernel), and the per-op overhead a chain of one-element relus.
  The executor fuses nothing, so the sheet's `fuse` is empty.
- `onnxruntime` (when installed): its CPU provider running what `mplower export` emits: MatMul
  and Conv in FLOAT, MatMulInteger and ConvInteger for int8, the overhead a chain of
  one-element Relu nodes with graph optimizations off (one kernel each). It has no bf16 or
  fp8 arithmetic (the exporter computes those in FLOAT), so the sheet lists f32 and i8 only.
  `fuse` lists what its graph optimizer does to exported plans (see `ORT_FUSE`).

numpy's BLAS matmul and the conv rates are measured too and recorded in the sheet's comment
header beside each figure. A format's `dense` rate is its GEMM rate: the sheet holds one rate
per format for matmul and dense conv alike. The kernel classes whose kernels run far from that
rate or from the memory bandwidth (`mplower.lowering.target.KERNEL_CLASSES`: depthwise and
grouped conv, max pool, LRN) are each timed as a one-op model and written as `[rates.CLASS]`,
in the op's FLOPs (its op definition's count) per second; `CLASS_KERNELS` says in which
formats. The bandwidth is a large copy (bytes read plus written per second). Every figure is
the median of several timed calls after a warm-up call. What runs on the calling thread alone
(onnxruntime on one intra-op thread, the copy) is timed in that thread's CPU time
(`time.thread_time`), which other processes on a shared machine do not inflate: on the 2-core VM under load the wall time of an onnxruntime ResNet-50 call swung from
69 to 93 ms while its CPU time stayed at 36-37 ms. The executor and numpy's BLAS use helper
threads, so they are timed by the wall clock.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mplower.backend.executor import Program
from mplower.dialect.mp import CONTRACTIONS, VALUE_PRESERVING
from mplower.dialect.plan import result_format
from mplower.ir.opdef import OPS, check_attrs
from mplower.ir.parser import parse
from mplower.ir.types import TensorType
from mplower.lowering.target import (
    CONV_DEPTHWISE,
    CONV_GROUPED,
    FUSE_EPILOGUE,
    FUSE_QDQ_PROPAGATION,
    KERNEL_CLASSES,
    LRN,
    MAX_POOL,
)
from mplower.lowering.tomlsheet import toml_string

RUNTIMES = ("mplower", "onnxruntime")
# The formats the executor's matmul runs, each as a plan computes it: (operand type, result
# type, accumulator). Float GEMMs accumulate in f32 and write what insert-casts gives them.
MPLOWER_GEMMS = {**{f: (f, result_format("mp.matmul", f, "f32"), "f32")
                    for f in ("f32", "bf16", "f16", "f8E4M3FN", "f8E5M2")},
                 "i8": ("i8", "i32", "i32")}
# What onnxruntime's graph optimizer fuses in the models `mplower export` writes: a float
# Conv or MatMul with the bias add and activation after it (Conv+Add+Relu into one Conv,
# MatMul+Add into Gemm: its "Graph Optimizations" page), the "epilogue" rule. Not "qdq": its QDQ
# fusions look for DequantizeLinear -> float op -> QuantizeLinear, while the exporter writes
# integer ops (QuantizeLinear -> MatMulInteger/ConvInteger -> DequantizeLinear -> Add), and the
# profiler shows each of those as a kernel of its own (24 DequantizeLinear and 24 Add kernels
# in the exported int8 SqueezeNet). Not "elementwise" or "cast": it has no general loop fusion.
# Its QDQ propagation does move a QuantizeLinear above the MaxPool it follows (the optimized
# int8 SqueezeNet runs its three MaxPools on int8), the "qdq-propagation" rule.
ORT_FUSE = (FUSE_EPILOGUE, FUSE_QDQ_PROPAGATION)
OVERHEAD_CHAIN = 64  # ops in the chain whose time per op is the per-op overhead
EVERY_REP = math.inf  # median_time's budget here: every rep runs, as the sheet's header says


@dataclass(frozen=True)
class Shapes:
    gemm: tuple[int, int, int]  # M, K, N
    conv: tuple[int, int, int, int]  # batch, channels in = out, height = width, kernel
    copy_bytes: int
    reps: int
    # The kernel classes' one-op models: (batch, channels, height = width) of the input.
    classes: tuple[int, int, int] = (1, 128, 28)


FULL = Shapes(gemm=(512, 768, 768), conv=(4, 64, 28, 3), copy_bytes=1 << 26, reps=7)
QUICK = Shapes(gemm=(32, 64, 64), conv=(1, 8, 8, 3), copy_bytes=1 << 20, reps=3,
               classes=(1, 8, 8))
GROUPS = 4  # the grouped conv's groups (ShuffleNet's 1x1 group convs)
LRN_SIZE = 5  # AlexNet's and GoogLeNet's LRN window


@dataclass(frozen=True)
class ClassKernel:
    """The one-op model that times a kernel class: the mp op, its attributes, its weight's shape
    (None without one) and the output shape, for an input of shape (batch, channels, hw, hw)."""

    op: str
    attrs: dict
    weight: tuple[int, ...] | None
    out: tuple[int, ...]

    def flops(self, x: tuple[int, ...]) -> int:
        """The op's FLOPs as its op definition counts them (what the cost model divides)."""
        ins = [TensorType(x, "f32")] + ([TensorType(self.weight, "f32")] if self.weight else [])
        return int(OPS[self.op].flops(ins, [TensorType(self.out, "f32")],
                                      check_attrs(OPS[self.op], self.attrs)))


def class_kernel(cls: str, x: tuple[int, int, int, int]) -> ClassKernel:
    """The one-op model of kernel class `cls` on input shape `x`: a 3x3 depthwise conv and a
    1x1 conv in GROUPS groups (same padding), a 3x3 stride-2 max pool, an LRN over LRN_SIZE
    channels."""
    n, c, h, w = x
    if cls in (CONV_DEPTHWISE, CONV_GROUPED):
        k, groups = (3, c) if cls == CONV_DEPTHWISE else (1, GROUPS)
        pad = k // 2
        return ClassKernel("mp.conv2d", {"strides": [1, 1], "padding": [pad] * 4,
                                         "dilations": [1, 1], "groups": groups},
                           (c, c // groups, k, k), x)
    if cls == MAX_POOL:
        return ClassKernel("mp.max_pool2d", {"kernel": [3, 3], "strides": [2, 2],
                                             "padding": [0, 0, 0, 0]},
                           None, (n, c, (h - 3) // 2 + 1, (w - 3) // 2 + 1))
    assert cls == LRN, cls
    return ClassKernel("mp.lrn", {"size": LRN_SIZE, "alpha": 1e-4, "beta": 0.75, "bias": 1.0},
                       None, x)


# The formats each runtime's sheet gives a class rate in. onnxruntime: ConvInteger and the int8
# MaxPool (after qdq-propagation) beside their float kernels, LRN in FLOAT only; not the float
# MaxPool, which in an exported plan follows a float Conv and so runs in onnxruntime's blocked
# NCHWc layout, a kernel a one-op model does not reach (it runs the plain NCHW one, several
# times slower): the sheet leaves it to the roofline. mplower: what the executor runs.
CLASS_KERNELS: dict[str, dict[str, tuple[str, ...]]] = {
    "onnxruntime": {CONV_DEPTHWISE: ("f32", "i8"), CONV_GROUPED: ("f32", "i8"),
                    MAX_POOL: ("i8",), LRN: ("f32",)},
    "mplower": {CONV_DEPTHWISE: ("f32", "i8"), CONV_GROUPED: ("f32", "i8"),
                MAX_POOL: ("f32", "i8"), LRN: ("f32",)},
}


@dataclass(frozen=True)
class Measurement:
    """One timed kernel: its runtime, what it computes (`kind`: gemm, conv, overhead, copy),
    its format, a label, its median seconds and the work it did (FLOPs, OPs or bytes)."""

    runtime: str  # "mplower", "onnxruntime", "numpy"
    kind: str
    fmt: str | None
    label: str
    seconds: float
    work: float

    @property
    def rate(self) -> float:
        return self.work / self.seconds

    @property
    def unit(self) -> str:
        return {"copy": "bytes/s", "overhead": "s"}.get(self.kind,
                                                         "OP/s" if self.fmt == "i8" else "FLOP/s")


@dataclass
class HostMeasurements:
    """Everything timed on this host, for every runtime that is installed."""

    shapes: Shapes
    items: list[Measurement] = field(default_factory=list)

    def get(self, runtime: str, kind: str, fmt: str | None = None) -> Measurement | None:
        return next((x for x in self.items
                     if (x.runtime, x.kind, x.fmt) == (runtime, kind, fmt)), None)

    def runtimes(self) -> list[str]:
        return [r for r in RUNTIMES if self.get(r, "overhead") is not None]

    def formats(self, runtime: str) -> dict[str, float]:
        """Each format's dense rate for `runtime`: its GEMM's."""
        return {x.fmt: x.rate for x in self.items
                if x.runtime == runtime and x.kind == "gemm" and x.fmt is not None}

    def class_rates(self, runtime: str) -> dict[str, dict[str, float]]:
        """Each kernel class's rate per format for `runtime`, as its one-op model ran."""
        out: dict[str, dict[str, float]] = {}
        for x in self.items:
            if x.runtime == runtime and x.kind in KERNEL_CLASSES and x.fmt is not None:
                out.setdefault(x.kind, {})[x.fmt] = x.rate
        return out

    def overhead_s(self, runtime: str) -> float:
        x = self.get(runtime, "overhead")
        assert x is not None, runtime
        return x.seconds / x.work

    @property
    def bandwidth(self) -> float:
        x = self.get("numpy", "copy")
        assert x is not None
        return x.rate


def median_time(fn: Callable[[], object], reps: int = 5, budget_s: float = 0.5,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time of `fn` on `clock` (the wall clock by default) after one warm-up call;
    fewer reps (at least 3) if they exceed `budget_s` of wall time."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return float(statistics.median(times))


def _ty(shape: tuple[int, ...], elem: str) -> str:
    return f"tensor<{'x'.join(map(str, shape))}x{elem}>"


def _program(text: str) -> Program:
    import mplower.dialect  # noqa: F401  (registers the mp ops)

    return Program(parse(text, "<measure>"))


def _random(shape: tuple[int, ...], elem: str, rng: np.random.Generator) -> np.ndarray:
    if elem == "i8":
        return rng.integers(-127, 128, shape, dtype=np.int64)
    return rng.standard_normal(shape).astype(np.float32)


def _timed_program(text: str, args: list[tuple[tuple[int, ...], str]], reps: int) -> float:
    program = _program(text)
    rng = np.random.default_rng(0)
    prepared = program.prepare_inputs([_random(s, e, rng) for s, e in args])
    return median_time(lambda: program.run_lowered(prepared), reps, EVERY_REP)


def mplower_gemm(fmt: str, m: int, k: int, n: int, reps: int) -> float:
    """Seconds of one (m, k) x (k, n) matmul in `fmt` as the executor runs it in a plan."""
    operand, out, accum = MPLOWER_GEMMS[fmt]
    a, b, y = _ty((m, k), operand), _ty((k, n), operand), _ty((m, n), out)
    text = (f"func.func @main(%a: {a}, %b: {b}) -> {y} {{\n"
            f"  %y = mp.matmul %a, %b {{mp.precision = {fmt}, mp.accum = {accum}}} : "
            f"({a}, {b}) -> {y}\n  return %y : {y}\n}}\n")
    return _timed_program(text, [((m, k), operand), ((k, n), operand)], reps)


def _conv_io(conv: tuple[int, int, int, int]) -> tuple[tuple[int, ...], ...]:
    batch, c, hw, kk = conv
    return (batch, c, hw, hw), (c, c, kk, kk), (batch, c, hw, hw)


def conv_flops(conv: tuple[int, int, int, int]) -> int:
    batch, c, hw, kk = conv
    return 2 * batch * c * hw * hw * c * kk * kk


def mplower_conv(fmt: str, conv: tuple[int, int, int, int], reps: int) -> float:
    """Seconds of one same-padded conv2d in `fmt` ("f32" or "i8") as the executor runs it."""
    operand, out, accum = MPLOWER_GEMMS[fmt]
    xs, ws, ys = _conv_io(conv)
    pad = conv[3] // 2
    x, w, y = _ty(xs, operand), _ty(ws, operand), _ty(ys, out)
    text = (f"func.func @main(%x: {x}, %w: {w}) -> {y} {{\n"
            f"  %y = mp.conv2d %x, %w {{strides = [1, 1], padding = [{pad}, {pad}, {pad}, "
            f"{pad}], dilations = [1, 1], groups = 1, mp.precision = {fmt}, mp.accum = "
            f"{accum}}} : ({x}, {w}) -> {y}\n  return %y : {y}\n}}\n")
    return _timed_program(text, [(xs, operand), (ws, operand)], reps)


def mplower_overhead(reps: int) -> float:
    """Seconds the executor takes for a chain of OVERHEAD_CHAIN one-element relus: its cost
    per op beyond the arithmetic, times the chain's length."""
    t = _ty((1,), "f32")
    body = "".join(f"  %{i + 1} = mp.relu %{i} : ({t}) -> {t}\n" for i in range(OVERHEAD_CHAIN))
    text = (f"func.func @main(%0: {t}) -> {t} {{\n{body}"
            f"  return %{OVERHEAD_CHAIN} : {t}\n}}\n")
    return _timed_program(text, [((1,), "f32")], reps)


def _attr_text(value: object) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(_attr_text, value)) + "]"
    return repr(value)


def mplower_class(cls: str, fmt: str, x: tuple[int, int, int, int], reps: int) -> float:
    """Seconds of kernel class `cls`'s one-op model in `fmt` as the executor runs it: a conv
    with operands in `fmt` (i8 x i8 -> i32), a pool or LRN on a tensor of `fmt`."""
    k = class_kernel(cls, x)
    if k.op == "mp.conv2d":
        operand, out, accum = MPLOWER_GEMMS[fmt]
        plan = [f"mp.precision = {fmt}", f"mp.accum = {accum}"]
    else:
        operand, out, plan = fmt, fmt, []
    args = [(x, operand)] + ([(k.weight, operand)] if k.weight else [])
    names = ["%x", "%w"][:len(args)]
    ins = ", ".join(_ty(shape, elem) for shape, elem in args)
    y = _ty(k.out, out)
    attrs = ", ".join([*(f"{key} = {_attr_text(v)}" for key, v in k.attrs.items()), *plan])
    text = (f"func.func @main({', '.join(f'{n}: {_ty(s, e)}' for n, (s, e) in zip(names, args))})"
            f" -> {y} {{\n  %y = {k.op} {', '.join(names)} {{{attrs}}} : ({ins}) -> {y}\n"
            f"  return %y : {y}\n}}\n")
    return _timed_program(text, args, reps)


def copy_seconds(nbytes: int, reps: int) -> float:
    """Seconds of a copy of `nbytes`, which streams them through memory twice (read, write)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return median_time(lambda: np.copyto(dst, src), reps, EVERY_REP, time.thread_time)


# ---- onnxruntime ----------------------------------------------------------------------------

def _ort_session(model, optimize: bool = True):
    import onnxruntime as ort

    options = ort.SessionOptions()
    # One thread, the calling one: a per-core figure, as the cpu-avx512 sheet gives, timed in
    # its CPU time; benchmarks/cost_validation.py times models the same way.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def _ort_time(nodes, inputs: dict[str, np.ndarray], output: tuple[str, int, tuple[int, ...]],
              reps: int, optimize: bool = True,
              initializers: dict[str, np.ndarray] | None = None) -> float:
    from onnx import helper, numpy_helper

    infos = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype),
                                           list(v.shape)) for k, v in inputs.items()]
    name, onnx_type, shape = output
    graph = helper.make_graph(nodes, "measure", infos,
                              [helper.make_tensor_value_info(name, onnx_type, list(shape))],
                              [numpy_helper.from_array(v, k)
                               for k, v in (initializers or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = _ort_session(model, optimize)
    return median_time(lambda: session.run(None, inputs), reps, EVERY_REP, time.thread_time)


def ort_gemm(fmt: str, m: int, k: int, n: int, reps: int) -> float:
    """Seconds of onnxruntime's MatMul (f32) or MatMulInteger (i8 x i8 -> i32)."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    if fmt == "i8":
        a = rng.integers(-127, 128, (m, k)).astype(np.int8)
        b = rng.integers(-127, 128, (k, n)).astype(np.int8)
        node = helper.make_node("MatMulInteger", ["a", "b"], ["y"])
        return _ort_time([node], {"a": a, "b": b}, ("y", TensorProto.INT32, (m, n)), reps)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    return _ort_time([node], {"a": a, "b": b}, ("y", TensorProto.FLOAT, (m, n)), reps)


def ort_conv(fmt: str, conv: tuple[int, int, int, int], reps: int) -> float:
    """Seconds of onnxruntime's Conv (f32) or ConvInteger (i8), same padding."""
    from onnx import TensorProto, helper

    xs, ws, ys = _conv_io(conv)
    rng = np.random.default_rng(0)
    pads = [conv[3] // 2] * 4
    if fmt == "i8":
        x = rng.integers(-127, 128, xs).astype(np.int8)
        w = rng.integers(-127, 128, ws).astype(np.int8)
        node = helper.make_node("ConvInteger", ["x", "w"], ["y"], pads=pads)
        return _ort_time([node], {"x": x, "w": w}, ("y", TensorProto.INT32, ys), reps)
    x = rng.standard_normal(xs).astype(np.float32)
    w = rng.standard_normal(ws).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=pads)
    return _ort_time([node], {"x": x, "w": w}, ("y", TensorProto.FLOAT, ys), reps)


def ort_class(cls: str, fmt: str, x: tuple[int, int, int, int], reps: int) -> float:
    """Seconds of kernel class `cls`'s one-op model in onnxruntime, as `mplower export` writes
    the op: Conv (f32) or ConvInteger (i8 x i8 -> i32) with the weight an initializer, MaxPool
    and LRN on a tensor of `fmt`."""
    from onnx import TensorProto, helper

    k = class_kernel(cls, x)
    rng = np.random.default_rng(0)
    i8 = fmt == "i8"
    dtype, onnx_type = (np.int8, TensorProto.INT8) if i8 else (np.float32, TensorProto.FLOAT)
    data = {"x": rng.integers(-127, 128, x).astype(dtype) if i8
            else rng.standard_normal(x).astype(dtype)}
    a = k.attrs
    if k.op == "mp.conv2d":
        w = k.weight
        weight = {"w": rng.integers(-127, 128, w).astype(dtype) if i8
                  else rng.standard_normal(w).astype(dtype)}
        node = helper.make_node("ConvInteger" if i8 else "Conv", ["x", "w"], ["y"],
                                group=a["groups"], pads=a["padding"], kernel_shape=list(w[2:]))
        out_type = TensorProto.INT32 if i8 else TensorProto.FLOAT
        return _ort_time([node], data, ("y", out_type, k.out), reps, initializers=weight)
    if k.op == "mp.max_pool2d":
        node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=a["kernel"],
                                strides=a["strides"], pads=a["padding"])
    else:
        node = helper.make_node("LRN", ["x"], ["y"], size=a["size"], alpha=a["alpha"],
                                beta=a["beta"], bias=a["bias"])
    return _ort_time([node], data, ("y", onnx_type, k.out), reps)


def ort_overhead(reps: int) -> float:
    """Seconds onnxruntime takes for a chain of OVERHEAD_CHAIN one-element Relu nodes with
    graph optimizations off (one kernel each): its cost per kernel, times the chain's length."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"]) for i in range(OVERHEAD_CHAIN)]
    x = {"v0": np.ones(1, np.float32)}
    return _ort_time(nodes, x, (f"v{OVERHEAD_CHAIN}", TensorProto.FLOAT, (1,)), reps,
                     optimize=False)


def onnxruntime_available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


# ---- the whole measurement ------------------------------------------------------------------

def measure_host(quick: bool = False) -> HostMeasurements:
    """Time this machine: GEMM per format and conv for each runtime that is installed, their
    per-op overheads, numpy's BLAS matmul and a large copy. `quick` uses tiny shapes (the
    rates are then far from peak; for tests)."""
    shapes = QUICK if quick else FULL
    out = HostMeasurements(shapes)
    m, k, n = shapes.gemm
    reps, gemm_flops, conv_work = shapes.reps, 2 * m * k * n, conv_flops(shapes.conv)
    gemm = f"{m}x{k} @ {k}x{n}"
    xs, ws, _ = _conv_io(shapes.conv)
    conv = f"{'x'.join(map(str, xs))} * {'x'.join(map(str, ws))}"
    chain = f"chain of {OVERHEAD_CHAIN} one-element relus, per op"

    def add(runtime: str, kind: str, fmt: str | None, label: str, seconds: float,
            work: float) -> None:
        out.items.append(Measurement(runtime, kind, fmt, label, seconds, work))

    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    add("numpy", "gemm", "f32", f"numpy BLAS matmul f32 {gemm}",
        median_time(lambda: a @ b, reps, EVERY_REP), gemm_flops)
    add("numpy", "copy", None, f"numpy copy of {shapes.copy_bytes >> 20} MiB (read + write)",
        copy_seconds(shapes.copy_bytes, reps), 2 * shapes.copy_bytes)
    for fmt in MPLOWER_GEMMS:
        add("mplower", "gemm", fmt, f"mplower matmul {fmt} {gemm}",
            mplower_gemm(fmt, m, k, n, reps), gemm_flops)
    for fmt in ("f32", "i8"):
        add("mplower", "conv", fmt, f"mplower conv2d {fmt} {conv}",
            mplower_conv(fmt, shapes.conv, reps), conv_work)
    add("mplower", "overhead", None, f"mplower {chain}", mplower_overhead(reps), OVERHEAD_CHAIN)
    x = (shapes.classes[0], shapes.classes[1], shapes.classes[2], shapes.classes[2])
    timers = {"mplower": mplower_class, "onnxruntime": ort_class}
    for runtime in ("mplower", "onnxruntime") if onnxruntime_available() else ("mplower",):
        for cls, fmts in CLASS_KERNELS[runtime].items():
            one_op = class_kernel(cls, x)
            what = f"{cls} ({_describe(one_op, x)})"
            for fmt in fmts:
                add(runtime, cls, fmt, f"{runtime} {what} {fmt}",
                    timers[runtime](cls, fmt, x, reps), one_op.flops(x))
    if onnxruntime_available():
        for fmt, op in (("f32", "MatMul"), ("i8", "MatMulInteger")):
            add("onnxruntime", "gemm", fmt, f"onnxruntime {op} {gemm}",
                ort_gemm(fmt, m, k, n, reps), gemm_flops)
        for fmt, op in (("f32", "Conv"), ("i8", "ConvInteger")):
            add("onnxruntime", "conv", fmt, f"onnxruntime {op} {conv}",
                ort_conv(fmt, shapes.conv, reps), conv_work)
        add("onnxruntime", "overhead", None, f"onnxruntime {chain}",
            ort_overhead(reps), OVERHEAD_CHAIN)
    return out


def _describe(k: ClassKernel, x: tuple[int, ...]) -> str:
    shape = "x".join(map(str, x))
    if k.op == "mp.conv2d":
        return f"{shape} * {'x'.join(map(str, k.weight))}, groups {k.attrs['groups']}"
    if k.op == "mp.max_pool2d":
        return f"{shape}, 3x3 stride 2"
    return f"{shape}, size {k.attrs['size']}"


def machine() -> str:
    """The CPU model and core count, as /proc/cpuinfo and os report them."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, " \
           f"Python {platform.python_version()}"


def _number(x: float) -> str:
    return f"{x:.4g}".replace("e+", "e")


def sheet_text(h: HostMeasurements, runtime: str, name: str = "host",
               now: datetime.datetime | None = None,
               command: str = "mplower target measure") -> str:
    """The target sheet (docs/targets.md) of `runtime` on the measured host, with a comment
    header that says where, when and how each figure was measured."""
    now = now or datetime.datetime.now(datetime.UTC)
    rates = h.formats(runtime)
    fmts = ", ".join(f'"{f}"' for f in rates)
    m, k, n = h.shapes.gemm
    fusion = ("onnxruntime runs on 1 intra-op thread." if runtime == "onnxruntime"
              else "The executor fuses nothing: fuse = [].")
    lines = [
        f"# Measured on this machine by `{command}`.",
        f"# machine: {machine()}",
        f"# date: {now:%Y-%m-%d %H:%M} UTC",
        f"# runtime: {runtime} ({_versions(h.runtimes())})",
        (f"# method: median of {h.shapes.reps} timed calls after one warm-up call each. A "
         "format's dense rate is its"),
        (f"#   {m}x{k} @ {k}x{n} GEMM (one rate per format serves matmul and conv); bandwidth: "
         "a large copy;"),
        f"#   overhead_s: per op of a chain of one-element ops. {fusion}",
        ("#   [rates.CLASS]: a one-op model of each kernel class, in the op's FLOPs (OPs) per "
         "second."),
        ("#   onnxruntime and the copy are timed in the calling thread's CPU time, the "
         "executor and BLAS by the wall clock."),
        "# figures (the other runtimes' for comparison):",
        *(f"#   {x.label}: " + (f"{x.seconds / x.work * 1e6:.4g} us" if x.kind == "overhead"
                                else f"{x.seconds * 1e3:.4g} ms, {_number(x.rate)} {x.unit}")
          for x in h.items),
        "",
        "[target]",
        f"name = {toml_string(name)}",
        f'description = "this machine ({runtime}), measured {now:%Y-%m-%d}"',
        f"bandwidth = {_number(h.bandwidth)}",
        f"overhead_s = {_number(h.overhead_s(runtime))}",
        "fuse = [" + ", ".join(f'"{r}"' for r in (ORT_FUSE if runtime == "onnxruntime"
                                                   else ())) + "]",
        "",
    ]
    for fmt, rate in rates.items():
        lines += [f"[formats.{fmt}]", f"dense = {_number(rate)}", ""]
    for cls, by_format in h.class_rates(runtime).items():
        lines += [f"[rates.{cls}]", *(f"{fmt} = {_number(r)}" for fmt, r in by_format.items()),
                  ""]
    lines += ["[[kernels]]", "ops = [" + ", ".join(f'"{o}"' for o in sorted(CONTRACTIONS)) + "]",
              f"dense = [{fmts}]", ""]
    if runtime == "onnxruntime":
        # Its integer kernels beyond the GEMMs move int8 values; other ops compute in FLOAT.
        lines += ["[[kernels]]",
                  "ops = [" + ", ".join(f'"{o}"' for o in sorted(VALUE_PRESERVING)) + "]",
                  f"dense = [{fmts}]", "", "[default]", 'dense = ["f32"]', ""]
    else:
        # The executor runs every op in every format: it computes in f32 and rounds.
        lines += ["[default]", f"dense = [{fmts}]", ""]
    return "\n".join(lines)


def _versions(runtimes: list[str]) -> str:
    import numba

    found = [f"numpy {np.__version__}", f"numba {numba.__version__}"]
    if "onnxruntime" in runtimes:
        import onnxruntime

        found.append(f"onnxruntime {onnxruntime.__version__}")
    return ", ".join(found)
