"""The precision plan of one op: the `mp.*` annotations the passes write, as one value.

assign-precision, lower-sparse, legalize, quantize and bisect decide what an op computes in;
insert-casts, the executor, the ONNX exporter and the reports read it back. Every one of them
goes through `Plan`: the annotation names are declared here and nowhere else, and what
legalize (or quantize) fell back from is stored as structure, a dictionary attribute

    mp.requested = {precision = f8E4M3FN, accum = f32, kernel = "sparse_2_4"}

(`accum` and a dense `kernel` left out), not as text that readers would parse again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from mplower.dialect.mp import CONTRACTIONS, TYPE_CARRYING
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import Function
from mplower.ir.opdef import OpError, annotation, attr_str, attr_type
from mplower.ir.types import TypeAttr, attr_to_str
from mplower.numerics.formats import FLOATS, FORMATS

PRECISION = "mp.precision"  # the compute format
ACCUM = "mp.accum"  # the accumulator of a matmul, conv or reduction
KERNEL = "mp.kernel"  # dense, or a structured sparse kernel (mplower.lowering.target.KERNELS)
REASON = "mp.reason"  # why, in words, for people
REQUESTED = "mp.requested"  # what the policy asked for before a fallback (`Requested`)
FALLBACK = "mp.fallback"  # the fallback's reason code(s), comma-separated in the IR
SPARSE_REASON = "mp.sparse_reason"  # lower-sparse's reason code for a dense choice
# In the order a plan writes them, which is the order they print in when an op gets them all.
PLAN_ATTRS = (PRECISION, ACCUM, KERNEL, REQUESTED, FALLBACK, REASON, SPARSE_REASON)
DENSE = "dense"  # the kernel of an op without `mp.kernel`

# The other annotations passes and commands write, on the module, its functions or its ops.
# Declared here and nowhere else (tests/test_one_place.py), so that a reader and a writer
# cannot spell one differently.
POLICY = "mp.policy"  # module: the sheet assign-precision applied (built-in name or path)
TARGET = "mp.target"  # module: the target legalize / lower-sparse applied
KEEP_IO_TYPES = "mp.keep_io_types"  # module: false when the sheet lets the signature narrow
SCALING = "mp.scaling"  # module: the sheet's [scaling] (mplower.lowering.scaling.Scaling)
WEIGHTS = "mp.weights"  # module: the .npz of named constants, relative to the IR file
SHAPES_ONLY = "mp.shapes_only"  # module: imported without weights (each reads as zeros)
OUTPUT_NAMES = "mp.output_names"  # function: the imported model's output names
# A GEMM whose accumulator keeps fewer bits than f32 (mplower.numerics.accum): its significant
# bits, and every how many elements of K it is promoted to f32.
ACCUM_BITS, PROMOTE_EVERY = "mp.accum_bits", "mp.promote_every"
WEIGHT_QUANT = "mp.weight_quant"  # op: how quantize stored its weight operand
# op: ||X W - X W_hat|| / ||X W|| of its quantized weight on quantize's calibration data
WEIGHT_ERROR = "mp.weight_error"
QUANT_MARK = "mp.quant"  # op: what quantize wrote it for (ZERO_POINT, ...)
TRAINABLE = "mp.trainable"  # constant: mplower train learns it like a weight
GRAD_OF = "mp.grad_of"  # backward op: the name of the forward op it differentiates
# Range analysis: the static bound of a value, and the formats it over- or underflows.
OVERFLOW, UNDERFLOW, BOUND = "mp.overflow", "mp.underflow", "mp.bound"
# What a calibration writes (and a new calibration replaces).
RANGE, CALIB, OBSERVED, TINY, CHANNEL_ABSMAX = (
    "mp.range", "mp.calib", "mp.observed", "mp.tiny", "mp.channel_absmax")
RESULT_ATTRS = "mp.result_attrs"  # function: per-result attributes (calibration of results)
# Calibration: how many -inf, +inf and NaN values a value held (its range is over the rest).
NONFINITE = "mp.nonfinite"


@dataclass(frozen=True)
class Requested:
    """What the plan asked for before a pass fell back from it."""

    precision: str
    accum: str | None = None
    kernel: str = DENSE

    @classmethod
    def of(cls, value: Any) -> Requested:
        if not isinstance(value, dict) or "precision" not in value \
                or set(value) - {"precision", "accum", "kernel"}:
            raise OpError(f"{REQUESTED} must be a dictionary {{precision = T, accum = T, "
                          f"kernel = \"K\"}} (accum and kernel optional), "
                          f"got {attr_to_str(value)}")
        kernel = value.get("kernel", DENSE)
        if not isinstance(kernel, str):
            raise OpError(f"{REQUESTED}: kernel must be a string, got {attr_to_str(kernel)}")
        accum = value.get("accum")
        return cls(attr_type(value["precision"]), None if accum is None else attr_type(accum),
                   kernel)

    def attr(self) -> dict[str, Any]:
        out: dict[str, Any] = {"precision": TypeAttr(self.precision)}
        if self.accum is not None:
            out["accum"] = TypeAttr(self.accum)
        if self.kernel != DENSE:
            out["kernel"] = self.kernel
        return out

    def as_dict(self) -> dict[str, str | None]:
        """As the run report shows a plan: every key, accum None where there is none."""
        return {"precision": self.precision, "accum": self.accum, "kernel": self.kernel}

    def __str__(self) -> str:  # `bf16/f32 sparse_2_4`, as messages and mp.reason say it
        text = self.precision + (f"/{self.accum}" if self.accum else "")
        return text if self.kernel == DENSE else f"{text} {self.kernel}"


class Plan(NamedTuple):
    """An op's plan annotations; a field that is None (or an empty `fallback`) is absent.

    A named tuple rather than a frozen dataclass because the passes make one per op: it is
    built several times faster. Change fields with `_replace` (or `decided`).

    `kernel` is None when the op has no `mp.kernel` (it runs dense: `kernel_or_dense`); a pass
    that chose the dense kernel writes it explicitly. String annotations (`kernel`, `reason`,
    `sparse_reason`) are kept as written: the verifier leaves discardable attributes alone.
    """

    precision: str | None = None
    accum: str | None = None
    kernel: str | None = None
    reason: str | None = None
    requested: Requested | None = None
    fallback: tuple[str, ...] = ()
    sparse_reason: str | None = None

    @classmethod
    def of(cls, attrs: dict[str, Any]) -> Plan:
        """The plan in an op's attributes; OpError for a malformed one (`mp.precision = "x"`)."""
        if _NAMES.isdisjoint(attrs):
            return _EMPTY  # most ops of an unplanned module: no work
        get = attrs.get
        p, a, req, fb = get(PRECISION), get(ACCUM), get(REQUESTED), get(FALLBACK)
        return _new(cls, (None if p is None else _type(p), None if a is None else _type(a),
                          get(KERNEL), get(REASON), None if req is None else Requested.of(req),
                          () if fb is None else tuple(str(fb).split(",")), get(SPARSE_REASON)))

    @staticmethod
    def asked(attrs: dict[str, Any]) -> tuple[str, str | None, str] | None:
        """(precision, accum, kernel) of an op's plan, None without `mp.precision`: what
        legalize checks on every op, without building the whole Plan (`of`) for the many
        that need no fallback. OpError for a malformed format, as `of`."""
        p = attrs.get(PRECISION)
        if p is None:
            return None
        a = attrs.get(ACCUM)
        return _type(p), None if a is None else _type(a), attrs.get(KERNEL) or DENSE

    @classmethod
    def at(cls, f: Function, node: int) -> Plan:
        return cls.of(f.attrs_of(node))

    @classmethod
    def decide_at(cls, f: Function, node: int, precision: str, accum: str | None,
                  reason: str) -> None:
        """`Plan.at(f, node).decided(precision, accum, reason).write(f, node)`, with one look
        at the op's attributes when it has no plan yet: assign-precision annotates every op."""
        if _NAMES.isdisjoint(f.attrs_of(node)):
            key = (precision, accum, reason)
            present = _DECIDED.get(key)
            if present is None:
                present = _new(cls, (precision, accum, None, reason, None, (), None))._present()
                if len(_DECIDED) < 4096:
                    _DECIDED[key] = present
            f.set_attrs(node, present)
        else:
            cls.at(f, node).decided(precision, accum, reason).write(f, node)

    def decided(self, precision: str, accum: str | None, reason: str) -> Plan:
        """This plan with a new compute format, accumulator and reason (what assign-precision
        decides per op; the rest kept), without `_replace`'s keyword handling: it runs once
        per op of the module."""
        return _new(Plan, (precision, accum, self.kernel, reason, self.requested, self.fallback,
                           self.sparse_reason))

    @property
    def kernel_or_dense(self) -> str:
        return self.kernel or DENSE

    def attrs(self) -> dict[str, Any]:
        """The annotations of this plan, as attribute values, in `PLAN_ATTRS` order."""
        return dict(self._present())

    def _present(self) -> dict[str, Any]:
        """`attrs`, shared between equal plans (do not change it): a module has few distinct
        plans and assign-precision writes one per op. A plan with a `requested` dictionary is
        not shared, so no two ops hold the same mutable attribute value."""
        out = _PRESENT.get(self)
        if out is None:
            out = {name: v for name, v in zip(PLAN_ATTRS, self._values()) if v is not None}
            if self.requested is None and len(_PRESENT) < 4096:
                _PRESENT[self] = out
        return out

    def write(self, f: Function, node: int) -> None:
        """Make the op's annotations say this plan (rewriter API; other attributes untouched).

        Only the annotations that change are written, so one a pass leaves alone keeps its
        place and spelling (`mp.precision = "bf16"` stays a string), and new ones follow in
        `PLAN_ATTRS` order.
        """
        attrs = f.attrs_of(node)
        if _NAMES.isdisjoint(attrs):  # an op without a plan yet (most, in assign-precision)
            f.set_attrs(node, self._present())
            return
        for name, value in zip(PLAN_ATTRS, self._values()):
            if value is None:
                if name in attrs:
                    f.del_attr(node, name)
                continue
            old = attrs.get(name, _ABSENT)
            if old is _ABSENT or (old != value and not (
                    type(value) is TypeAttr and old == value.type)):
                f.set_attr(node, name, value)

    def _values(self) -> tuple[Any, ...]:
        """Each annotation's attribute value, in `PLAN_ATTRS` order (None: absent)."""
        p, a, req, fb = self.precision, self.accum, self.requested, self.fallback
        return (None if p is None else _TYPE_ATTRS.get(p) or TypeAttr(p),
                None if a is None else _TYPE_ATTRS.get(a) or TypeAttr(a),
                self.kernel,
                None if req is None else req.attr(),
                ",".join(fb) if fb else None,
                self.reason,
                self.sparse_reason)


# Formats that tensor cores take as matmul/conv inputs but do not write results in: a GEMM fed
# tf32 or fp8 writes its accumulator's format (as cuBLAS and Transformer Engine do).
INPUT_ONLY_FORMATS = frozenset({"tf32", "f8E4M3FN", "f8E5M2", "f6E2M3FN", "f6E3M2FN",
                                "f4E2M1FN"})


def result_format(op: str, compute: str, accum: str | None) -> str:
    """The element type an op's float results have once it computes in `compute`.

    Integer compute (w8a8) is materialized by quantize/dequantize pairs whose result is f32;
    tf32 and fp8 matmuls and convs write their accumulator; every other op writes its compute
    format, as its type rule infers (an fp8 slice moves fp8 values and gives fp8).
    """
    if FORMATS[compute].is_int:
        return "f32"
    if compute in INPUT_ONLY_FORMATS and op in CONTRACTIONS:
        return accum if accum is not None and FORMATS[accum].is_float else "f32"
    return compute


def float_formats(op: str, attrs: dict[str, Any]) -> tuple[str, str] | None:
    """(operand format, result format) of an op whose plan computes in a float format: what
    insert-casts gives its float operands and results. None for an op without a float plan, or
    one whose result type is what it is for (a cast, a constant). OpError for a malformed plan.
    """
    if op in TYPE_CARRYING:
        return None
    asked = Plan.asked(attrs)
    if asked is None or asked[0] not in FLOATS:
        return None
    return asked[0], result_format(op, asked[0], asked[1])


def unmaterialized(f: Function) -> int | None:
    """The first op whose float plan is still only an annotation: insert-casts would give it
    operands or results of another format. None when the plan (if any) is materialized."""
    nodes = f.nodes
    for n in f.ops():
        d = nodes[n]
        try:
            formats = float_formats(d["op"], d["attrs"])
        except OpError:  # a malformed annotation: the executor reports it where it stands
            continue
        if formats is None:
            continue
        want, out = formats
        if any(t.elem in FLOATS and t.elem != want for t in f.operand_types(n)) \
                or any(t.elem in FLOATS and t.elem != out for t in d["types"]):
            return n
    return None


def check_materialized(f: Function) -> None:
    """What the executor and the ONNX exporter require: a located error at the first op whose
    float plan insert-casts has not materialized (they run a module as it is)."""
    n = unmaterialized(f)
    if n is not None:
        d = f.data(n)
        raise DiagnosticError.at(d["loc"], (
            f"'{d['op']}' has a precision plan that is only an annotation "
            f"({PRECISION} = {Plan.of(d['attrs']).precision}): run insert-casts first "
            f"(mplower opt --pass=insert-casts)"))


_EMPTY = Plan()
_NAMES = frozenset(PLAN_ATTRS)
_ABSENT = object()
_new = tuple.__new__  # Plan's fields in order, without the keyword handling of Plan(...)
_PRESENT: dict[Plan, dict[str, Any]] = {}
_DECIDED: dict[tuple[str, str | None, str], dict[str, Any]] = {}  # decide_at's plans
_TYPE_ATTRS = {name: TypeAttr(name) for name in FORMATS}  # TypeAttr is immutable: share them


def _type(v: Any) -> str:
    """attr_type, with the common case (a TypeAttr of a known format) first: once per op."""
    if v.__class__ is TypeAttr and v.type in FORMATS:
        return v.type
    return attr_type(v)


annotation(PRECISION, _type, "an element type such as bf16")
annotation(ACCUM, _type, "an element type such as f32")
annotation(KERNEL, attr_str, 'a string ("dense")')
annotation(REQUESTED, Requested.of, "a dictionary {precision = T, accum = T, kernel = \"K\"} "
                                    "(accum and kernel optional)")

__all__ = [
    "ACCUM",
    "ACCUM_BITS",
    "BOUND",
    "CALIB",
    "CHANNEL_ABSMAX",
    "DENSE",
    "FALLBACK",
    "GRAD_OF",
    "INPUT_ONLY_FORMATS",
    "KEEP_IO_TYPES",
    "KERNEL",
    "NONFINITE",
    "OBSERVED",
    "OUTPUT_NAMES",
    "OVERFLOW",
    "PLAN_ATTRS",
    "POLICY",
    "PRECISION",
    "PROMOTE_EVERY",
    "QUANT_MARK",
    "RANGE",
    "REASON",
    "REQUESTED",
    "RESULT_ATTRS",
    "SCALING",
    "SHAPES_ONLY",
    "SPARSE_REASON",
    "TARGET",
    "TINY",
    "TRAINABLE",
    "UNDERFLOW",
    "WEIGHTS",
    "WEIGHT_ERROR",
    "WEIGHT_QUANT",
    "Plan",
    "Requested",
    "check_materialized",
    "float_formats",
    "result_format",
    "unmaterialized",
]
