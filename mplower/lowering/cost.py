"""The fusion- and shape-aware cost model: which kernels a function launches and what each costs.

A target's compiler does not launch one kernel per op. This module groups a function's ops into
the fused kernels the target says its compiler builds (`Target.fuse`, docs/targets.md) and
prices each group with the roofline of `Target.op_time`: max(FLOPs / peak, bytes / bandwidth)
plus one launch, where the bytes are those crossing the group's boundary only, a GEMM's peak
is scaled by `Target.gemm_efficiency` (tile and wave quantization) and by the sustained share of
its format's peak the sheet measured (`gemm_fraction`), and an op of a kernel class
the target has a measured rate for (`Target.class_rate`: depthwise conv, max pool, ...) runs at
that rate instead of its format's peak.

How ops are grouped:
- With `qdq-propagation`, an 8-bit quantize that is the only use of a max_pool2d's result moves
  above the pool when the pool is its operand's only use (on a copy of the function); the pool
  then runs in i8.
- Ops whose operands are all constants (weight quantizes, casts and reshapes of weights) are
  folded when the model is deployed: free per inference. A kernel reading such a weight reads
  it in the narrowest format along that chain (an i8 weight stays i8 in memory).
- A conversion (mp.cast, or mp.quantize / mp.dequantize) the target fuses costs no kernel:
  one that narrows is the store of the kernel that produces its operand, when that value has
  no other use; otherwise it is the load of each kernel that consumes it (duplicated into
  every consumer, as XLA duplicates cheap producers), which then reads its operand.
- An op joins the group of an operand's producer when every value that group hands outside
  goes to this op (so a group is never split by an outside use, and groups form no cycle) and
  the rules allow: an elementwise op after a matmul/conv is its epilogue; elementwise ops merge
  with each other and with one normalization/reduction/data-movement op; two anchors (matmul,
  conv, softmax, layer_norm, ...) never share a group, but for attention under `attention`
  (a product of activations, softmax, the product by V: one kernel, as FlashAttention runs
  it). Under `slice-concat`, slices and concats fuse as elementwise ops. Reshapes and
  flattens are views: they join any group and alone cost nothing; so is a transpose that moves
  only axes of size 1.

A deploy-time weight is read with its quantization parameters: the scales (and zero points) of
the mp.quantize that stores it, as stored (f32 attributes), beside its narrow elements (an i4
weight is half a byte).

Serving (`cache`, the arguments that hold a KV cache: mplower.lowering.serving): a runtime keeps
the cache in place, so an mp.concat that appends new positions to a cache argument reads and
writes only the new positions (the past stays where it is), and a transpose whose result only
reaches contractions (through views) is the GEMM's operand layout, read with strides, not a
kernel (attention reads K as K^T).

The fp32 baseline of a plan prices the same function as if every op computed in f32 on dense
kernels and every conversion were absent (what assign-precision{policy=fp32} leaves), with the
same model, so a speedup compares like with like.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.dialect.mp import CONTRACTIONS, CONVERSIONS
from mplower.dialect.plan import Plan
from mplower.ir.graph import ARG, RETURN, Function, Value
from mplower.ir.opdef import OPS, check_attrs
from mplower.ir.types import DenseAttr, TensorType
from mplower.lowering.sparsity import reduction_axis, storage
from mplower.lowering.target import (
    DENSE,
    FUSE_ATTENTION,
    FUSE_CAST,
    FUSE_ELEMENTWISE,
    FUSE_EPILOGUE,
    FUSE_QDQ,
    FUSE_QDQ_PROPAGATION,
    FUSE_SLICE_CONCAT,
    KERNEL_FOR_ENCODING,
    Target,
    kernel_class,
)
from mplower.numerics.formats import FORMATS

# Ops that only reinterpret the shape of contiguous data: a compiler emits no kernel for them.
VIEWS = frozenset({"mp.reshape", "mp.flatten"})
SLICE_CONCAT = frozenset({"mp.slice", "mp.concat"})  # loop-fusible under `slice-concat`
COMPUTE, MEMORY, LAUNCH = "compute", "memory", "launch"  # what bounds a group's time


@dataclass(frozen=True)
class Group:
    """One fused kernel: its anchor (the matmul/conv/normalization it is built around, else its
    first op), its member ops by result name in program order, and its roofline."""

    id: int
    anchor: str
    op: str
    members: tuple[str, ...]
    compute: str
    flops: int
    bytes_read: int
    bytes_written: int
    bound: str
    time_s: float
    weight_bytes: int = 0  # of bytes_read: deploy-time constants (weights, their scales)


@dataclass(frozen=True)
class Cost:
    """A function's groups, the group of every op that belongs to one (folded conversions and
    deploy-time constants belong to none), and the totals of the plan and its fp32 baseline."""

    groups: tuple[Group, ...]
    group_of: Mapping[str, int]
    time_s: float
    fp32_time_s: float

    @property
    def speedup_vs_fp32(self) -> float:
        return self.fp32_time_s / self.time_s if self.time_s else 1.0


def compute_format(f: Function, n: int) -> str:
    """The format op `n` computes in: its `mp.precision`, else its first operand's (first
    result's) element type."""
    precision = Plan.at(f, n).precision
    if precision is not None:
        return precision
    ins = f.operand_types(n)
    return ins[0].elem if ins else f.types(n)[0].elem


def _fusion_rule(op: str) -> str:
    return FUSE_CAST if op == "mp.cast" else FUSE_QDQ


def _wide(t: TensorType) -> TensorType:
    """`t` in the fp32 plan: floats and quantized integers (i8, u8, their i32 accumulators)
    in f32, dense."""
    fmt = FORMATS[t.elem]
    if fmt.is_float or (fmt.is_int and fmt.bits in (8, 32)):
        return TensorType(t.shape, "f32", None)
    return t.with_encoding(None) if t.encoding is not None else t


class _Model:
    def __init__(self, f: Function, target: Target, fp32: bool,
                 cache: frozenset[int] = frozenset()):
        self.f, self.target, self.fp32, self.cache = f, target, fp32, cache
        self.order = [n for n in f.ops() if f.op(n) != RETURN]
        self.pos = {n: i for i, n in enumerate(self.order)}
        self.static = self._static()
        self.folded: set[int] = set()  # conversions that became their consumers' loads
        self._fold_conversions()
        # Uses of each value after folding: the consumer nodes (the return included).
        self.users: dict[Value, set[int]] = {}
        for n in [*self.order, f.return_node]:
            if n in self.static or n in self.folded:
                continue
            for v in f.operands(n):
                self.users.setdefault(self.resolve(v), set()).add(n)

    def _static(self) -> set[int]:
        f, static = self.f, set()
        for n in self.order:
            operands = f.operands(n)
            if f.op(n) == "mp.constant" or (
                    operands and f.op(n) in OPS and OPS[f.op(n)].pure
                    and all(u in static for u, _ in operands)):
                static.add(n)
        return static

    def _fold_conversions(self) -> None:
        f = self.f
        for n in self.order:
            op = f.op(n)
            if n in self.static or op not in CONVERSIONS:
                continue
            if self.fp32:
                self.folded.add(n)
                continue
            if _fusion_rule(op) not in self.target.fuse:
                continue
            src = f.operands(n)[0]
            narrows = f.types(n)[0].nbytes < f.type_of(src).nbytes
            producer = f.op(src[0])
            single = len(f.uses(src)) == 1
            # A narrowing conversion of a computed value used once is its producer's store
            # (left in place: the grouping merges it); every other one is its consumers' load.
            if not (narrows and single and producer != ARG and src[0] not in self.static
                    and src[0] not in self.folded):
                self.folded.add(n)

    def resolve(self, v: Value) -> Value:
        """The value a kernel actually reads for operand `v`: through folded conversions."""
        while v[0] in self.folded:
            v = self.f.operands(v[0])[0]
        return v

    def type_of(self, v: Value) -> TensorType:
        t = self.f.type_of(v)
        return _wide(t) if self.fp32 else t

    def weight_bytes(self, v: Value) -> int:
        """Bytes of a deploy-time constant as its kernel reads it: the narrowest form along
        its chain of single-operand ops, with a sparse encoding's values and metadata."""
        return self._stored(v)[0]

    def _stored(self, v: Value) -> tuple[int, str]:
        """(bytes, element format) of that narrowest form."""
        f, best = self.f, None
        while True:
            t = self.type_of(v)
            nbytes = t.nbytes
            kernel = KERNEL_FOR_ENCODING.get(t.encoding)
            if t.encoding in ("2:4", "1:2") and t.rank >= 2 and kernel is not None:
                k = t.shape[reduction_axis("mp.matmul", t.rank)]
                nbytes = storage(kernel, k, t.size // k, t.elem).total
            if not self.fp32 and f.op(v[0]) == "mp.quantize":
                nbytes += _qparam_bytes(f.attrs_of(v[0]), t.elem)
            if best is None or nbytes < best[0]:
                best = (nbytes, t.elem)
            operands = f.operands(v[0])
            if self.fp32 or len(operands) != 1:
                return best
            v = operands[0]

    def weight_only(self, n: int, fmt: str) -> bool:
        """Whether contraction `n` computes in float `fmt` on a weight stored as narrower
        integers (w4a16, w8a16): a mixed-input GEMM that dequantizes in its main loop."""
        if FORMATS[fmt].is_int:
            return False
        for v in self.f.operands(n):
            v = self.resolve(v)
            if v[0] in self.static:
                elem = FORMATS[self._stored(v)[1]]
                if elem.is_int and elem.bits < FORMATS[fmt].bits:
                    return True
        return False

    # ---- grouping ----------------------------------------------------------------------------
    def kind(self, n: int) -> str:
        op = self.f.op(n)
        if op in VIEWS or (op == "mp.transpose" and (
                _moves_only_unit_axes(self.f, n) or (self.cache and self._gemm_layout(n)))):
            return "view"
        if op in CONVERSIONS:
            return "conversion"
        if op in CONTRACTIONS:
            return "gemm"
        if op in OPS and OPS[op].elementwise or (
                op in SLICE_CONCAT and FUSE_SLICE_CONCAT in self.target.fuse):
            return "elementwise"
        return "other"

    def groups(self) -> list[list[int]]:
        f = self.f
        live = [n for n in self.order if n not in self.static and n not in self.folded
                and f.op(n) != ARG]
        group: dict[int, int] = {}  # node -> group key (the group's first node)
        members: dict[int, list[int]] = {}
        for n in live:
            group[n] = n
            members[n] = [n]
            for v in f.operands(n):
                p = self.resolve(v)[0]
                if p not in group or group[p] == group[n]:
                    continue
                a, b = group[p], group[n]
                if self._can_merge(members[a], members[b], n):
                    members[a].extend(members.pop(b))
                    for m in members[a]:
                        group[m] = a
        return sorted((sorted(ms, key=self.pos.__getitem__) for ms in members.values()),
                      key=lambda ms: self.pos[ms[0]])

    def _gemm_layout(self, n: int) -> bool:
        """Every use of `n`'s result is a contraction, through views only."""
        users = self.users.get((n, 0), set())
        return bool(users) and all(
            self.f.op(u) in CONTRACTIONS or (self.f.op(u) in VIEWS and self._gemm_layout(u))
            for u in users)

    def appended(self, n: int) -> Value | None:
        """The cache argument an mp.concat appends to in place (its first operand), if any."""
        if self.f.op(n) != "mp.concat":
            return None
        past = self.resolve(self.f.operands(n)[0])
        return past if past[0] in self.cache else None

    def _can_merge(self, producer: list[int], consumer: list[int], n: int) -> bool:
        inside = set(producer)
        for m in producer:  # everything the producer group hands out goes to n
            for r in range(len(self.f.types(m))):
                if not self.users.get((m, r), set()) <= inside | {n}:
                    return False
        kinds = {m: self.kind(m) for m in (*producer, *consumer)}
        anchors = [m for m in kinds if kinds[m] in ("gemm", "other")]
        fuse = self.target.fuse
        if len(anchors) > 1:
            return FUSE_ATTENTION in fuse and self._attention(anchors)
        for m, k in kinds.items():
            if k == "conversion" and _fusion_rule(self.f.op(m)) not in fuse:
                return False
        if not any(k == "elementwise" for k in kinds.values()):
            return True
        if anchors and kinds[anchors[0]] == "gemm":
            # Elementwise ops join a GEMM only after it (an epilogue), never before it.
            return FUSE_EPILOGUE in fuse and anchors[0] in producer
        return FUSE_ELEMENTWISE in fuse

    def _attention(self, anchors: list[int]) -> bool:
        """The anchors of a would-be group are attention's: a product of two activations (no
        weight), a softmax, and possibly a product of the softmax's result by an activation,
        in that order (the group's other members are elementwise ops, conversions and views;
        every value it hands on goes to the next op, as _can_merge requires)."""
        f = self.f
        ops = [f.op(m) for m in sorted(anchors, key=self.pos.__getitem__)]
        if ops not in (["mp.matmul", "mp.softmax"], ["mp.matmul", "mp.softmax", "mp.matmul"]):
            return False
        products = [m for m in anchors if f.op(m) == "mp.matmul"]
        return all(self.resolve(v)[0] not in self.static for m in products
                   for v in f.operands(m))

    # ---- pricing -------------------------------------------------------------------------------
    def price(self, gid: int, nodes: list[int]) -> Group:
        f, target = self.f, self.target
        inside = set(nodes)
        kinds = [self.kind(n) for n in nodes]
        anchor = next((n for n, k in zip(nodes, kinds, strict=True) if k in ("gemm", "other")),
                      nodes[0])
        flops, seconds, read, written, weights = 0, 0.0, 0, 0, 0
        seen: set[Value] = set()
        for n in nodes:
            past = self.appended(n)
            if past is not None:  # the cache stays in place: only the new positions move
                seen.add(past)
                written += self.type_of((n, 0)).nbytes - self.type_of(past).nbytes
            ins = [self.type_of(self.resolve(v)) for v in f.operands(n)]
            outs = [self.type_of((n, r)) for r in range(len(f.types(n)))]
            op = f.op(n)
            if op in OPS:
                attrs = check_attrs(OPS[op], f.attrs_of(n))
                work = int(OPS[op].flops(ins, outs, attrs))
                flops += work
                seconds += work / self._rate(n, ins, outs, attrs)
            for i, v in enumerate(f.operands(n)):
                v = self.resolve(v)
                if v[0] in inside or v in seen:
                    continue
                seen.add(v)
                if v[0] in self.static:
                    nbytes = self.weight_bytes(v)
                    if op == "mp.gather" and i == 0:  # a table is read at the rows gathered
                        size = self.type_of(v).size
                        nbytes = -(-nbytes * min(outs[0].size, size) // size) if size else 0
                    weights += nbytes
                else:
                    read += self.type_of(v).nbytes
            for r, t in enumerate(outs):
                if past is None and self.users.get((n, r), set()) - inside:
                    written += t.nbytes
        read += weights
        memory = (read + written) / target.bandwidth
        launch = target.overhead_s
        if all(k == "view" for k in kinds):  # a bitcast: no kernel at all
            memory = seconds = launch = 0.0
        bound = LAUNCH if launch >= max(seconds, memory) else (
            COMPUTE if seconds >= memory else MEMORY)
        return Group(gid, f.op_name(anchor) if f.types(anchor) else f.op(anchor),
                     f.op(anchor),
                     tuple(f.op_name(n) if f.types(n) else f.op(n) for n in nodes),
                     "f32" if self.fp32 else compute_format(f, anchor), flops, read, written,
                     bound, max(seconds, memory) + launch, weights)

    def _rate(self, n: int, ins: list[TensorType], outs: list[TensorType],
              attrs: dict) -> float:
        """FLOP/s op `n` reaches: the target's measured rate of its kernel class on a dense
        kernel, else its format's peak on its kernel, times the GEMM efficiency."""
        f, target = self.f, self.target
        fmt = "f32" if self.fp32 else compute_format(f, n)
        kernel = DENSE if self.fp32 else Plan.at(f, n).kernel_or_dense
        if kernel == DENSE:
            rate = target.class_rate(kernel_class(f.op(n), attrs, ins), fmt)
            if rate is not None:
                return rate
        try:
            peak = target.peak(fmt, kernel)
        except ValueError:  # a format the target has no rate for (e.g. i1): price it as f32
            peak = target.peak("f32")
        if f.op(n) in CONTRACTIONS and outs:
            peak *= target.gemm_efficiency(*_gemm_shape(f.op(n), outs[0].shape, ins))
            peak *= target.gemm_fraction(fmt)
            if not self.fp32 and self.weight_only(n, fmt):
                peak *= target.weight_only_fraction(fmt)
        return peak


def _moves_only_unit_axes(f: Function, n: int) -> bool:
    """A transpose that keeps the order of every axis longer than 1 ([B, 1, H, D] -> [B, H, 1,
    D]) leaves the bytes where they are: a bitcast."""
    shape = f.operand_types(n)[0].shape
    perm = check_attrs(OPS["mp.transpose"], f.attrs_of(n))["perm"]
    kept = [a for a in perm if shape[a] != 1]
    return kept == sorted(kept)


def _qparam_bytes(attrs: Mapping[str, object], elem: str) -> int:
    """Bytes of a quantize's parameters as stored: its scales (f32 attributes) and, where it
    has them, its zero points (in the quantized format)."""
    scale, zero = attrs.get("scale"), attrs.get("zero_point")
    nbytes = scale.type.nbytes if isinstance(scale, DenseAttr) else 4
    if isinstance(zero, DenseAttr):
        nbytes += zero.type.with_elem(elem).nbytes
    elif zero:
        nbytes += (FORMATS[elem].bits + 7) // 8
    return nbytes


def _gemm_shape(op: str, shape: tuple[int, ...],
                ins: list[TensorType]) -> tuple[int, int, int, int | None]:
    """(M, N, batch, K or None) of a contraction's output: a conv2d is an implicit GEMM with M = batch x
    height x width and N = output channels (NCHW); a matmul's leading axes are its batch,
    except where its second operand is one matrix (a weight), which every row of the leading
    axes shares: then they are rows of one GEMM (M = their product), as a compiler folds them.
    K (for split-K and skinny rows) is given for matmuls, None for a conv."""
    if op == "mp.conv2d" and len(shape) == 4:
        return shape[0] * shape[2] * shape[3], shape[1], 1, None
    if len(shape) < 2:
        return 1, shape[0] if shape else 1, 1, None
    if op == "mp.matmul" and len(ins) == 2 and ins[1].rank == 2:
        return math.prod(shape[:-1]), shape[-1], 1, ins[1].shape[0]
    batch = 1
    for d in shape[:-2]:
        batch *= d
    # A batch of products (attention's Q K^T and P V): K is the first operand's last axis.
    # In a decode step each has a row or a few (one query per head, or a GQA group's), priced
    # as skinny rows like a GEMM against a weight: by 128-row tiles, Llama3-8B's batch-64 step
    # came out 1.7x slower than measured on an H200 (docs/gpu-validation.md).
    depth = ins[0].shape[-1] if op == "mp.matmul" and ins and ins[0].rank >= 2 else None
    return shape[-2], shape[-1], batch, depth


# Ops a quantize of their result commutes with (a monotone map, per tensor or per channel, and
# the op only selects values within each channel): qdq-propagation moves the quantize above them.
_QUANTIZE_COMMUTES = frozenset({"mp.max_pool2d"})


def _propagated(f: Function) -> Function:
    """`f` as a compiler with qdq-propagation runs it: each 8-bit mp.quantize that is the only
    use of a max_pool2d's result moved above the pool, which then computes in i8, where the
    pool is its operand's only use (else the float operand is still needed, and onnxruntime
    leaves the pair alone). A copy when anything moves (pricing never changes the function),
    else `f` itself."""
    moves = [q for q in f.walk("mp.quantize")
             if FORMATS[f.types(q)[0].elem].bits == 8
             and f.op(pool := f.operands(q)[0][0]) in _QUANTIZE_COMMUTES
             and len(f.uses((pool, 0))) == 1 and len(f.uses(f.operands(pool)[0])) == 1]
    if not moves:
        return f
    g = copy.deepcopy(f)
    for q in moves:
        pool = g.operands(q)[0][0]
        (x,), elem, name = g.operands(pool), g.types(q)[0].elem, g.data(q)["name"]
        moved = g.create_op("mp.quantize", [x], [TensorType(g.type_of(x).shape, elem)],
                            dict(g.attrs_of(q)), before=pool, name_hint=name)
        g.set_operand(pool, 0, (moved, 0))
        g.set_result_type(pool, 0, TensorType(g.types(pool)[0].shape, elem))
        Plan.at(g, pool)._replace(precision="i8").write(g, pool)  # i8 or u8 data alike
        g.replace_all_uses((q, 0), (pool, 0))
        g.erase(q)
        g.rename(moved, name)  # the report finds the quantize's row under its own name
    return g


def fused_groups(f: Function, target: Target, *, fp32: bool = False,
                 cache: frozenset[int] = frozenset()) -> list[Group]:
    """The fused kernels `target` would launch for `f`, in program order, each priced; with
    `fp32`, those of the fp32 plan of `f` (every op in f32, no conversions); `cache` names the
    argument nodes that hold a KV cache kept in place (serving)."""
    if not fp32 and FUSE_QDQ_PROPAGATION in target.fuse:
        f = _propagated(f)
    model = _Model(f, target, fp32, cache)
    return [model.price(i, nodes) for i, nodes in enumerate(model.groups())]


def plan_cost(f: Function, target: Target, cache: frozenset[int] = frozenset(), *,
              baseline: bool = True) -> Cost:
    """The groups and modeled time of `f` on `target`, and of its fp32 baseline (`cache`: as
    for fused_groups); without `baseline`, its time is NaN (a caller that compares against
    an evaluated fp32 plan, as tune does, is spared a second pricing)."""
    groups = fused_groups(f, target, cache=cache)
    fp32 = (sum(g.time_s for g in fused_groups(f, target, fp32=True, cache=cache))
            if baseline else math.nan)
    return Cost(tuple(groups), {m: g.id for g in groups for m in g.members},
                sum(g.time_s for g in groups), fp32)
