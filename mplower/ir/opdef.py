"""Op definitions: how an op is declared, registered, looked up and its attributes checked.

The IR layer's half of the op machinery, as xDSL's `irdl` is to its `dialects`: `OpDef` (operand
counts, attribute specs, type rule, reference, cost, precisions, traits), the registry `OPS`
that dialect modules fill with `define` when they are imported (mplower.dialect), and the
attribute value helpers. Nothing here knows a particular op; the verifier, the passes and the
backend read ops only through the registry.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from mplower.ir.diagnostics import did_you_mean
from mplower.ir.types import (
    ELEMENT_TYPES,
    DenseAttr,
    TensorType,
    TypeAttr,
    TypedFloat,
    TypedInt,
    attr_to_str,
    int_text,
)
from mplower.numerics.formats import FORMATS


class OpError(Exception):
    """An op's operands, attributes or results break its rules.

    `operand` names the operand index at fault where there is one, so that the diagnostic can
    point at it; otherwise the diagnostic points at the op.
    """

    def __init__(self, message: str, operand: int | None = None):
        super().__init__(message)
        self.message = message
        self.operand = operand


@dataclass(frozen=True)
class AttrSpec:
    """kind: int, float, str, bool, ints, floats, type, types, dense, number (int or float, scalar
    or dense).

    `min` bounds a numeric value (each entry of an array) from below; `length` fixes the number
    of entries of an `ints`/`floats` array. Both are checked by `check_attrs`.
    """

    kind: str
    required: bool = False
    default: Any = None
    choices: tuple = ()
    min: float | None = None
    length: int | None = None


Infer = Callable[[Sequence[TensorType], Mapping[str, Any], Sequence[TensorType]], list[TensorType]]
# reference(inputs, attrs, result_types=None): ops whose result is chosen by the writer (reshape,
# cast, quantize, dequantize) need the declared result types and raise OpError without them.
Reference = Callable[..., list[np.ndarray]]
Flops = Callable[[Sequence[TensorType], Sequence[TensorType], Mapping[str, Any]], int]
Value = tuple[int, int]  # (producer node, result index), as in mplower.ir.graph


class GradBuilder(Protocol):
    """What a vector-Jacobian rule builds the backward graph with (passes/grad.py has one)."""

    def emit(self, op: str, operands: Sequence[Value], attrs: Mapping[str, Any] | None = None,
             result: TensorType | None = None) -> Value:
        """A new op on `operands`; its result type is inferred unless `result` is given."""

    def type_of(self, value: Value) -> TensorType: ...

    def splat(self, value: float, shape: tuple[int, ...], elem: str) -> Value:
        """A constant tensor of one value."""


# vjp(builder, operands, result, cotangent of the result, checked attrs, which operands need a
# cotangent) -> the cotangent of each operand (None where not needed or not differentiable).
# An op with several results gets its first result and a tuple of their cotangents.
# Rules build the backward graph from ops of the same dialect, so every pass, the executor and
# the report apply to it as to the forward graph.
Bounds = Callable[[Sequence[tuple[float, float]], Mapping[str, Any]], tuple[float, float]]
Vjp = Callable[[GradBuilder, Sequence[Value], Value, "Value | tuple[Value, ...]", dict,
                Sequence[bool]],
               list["Value | None"]]


class Trait(enum.Enum):
    """What passes, the policy and the backend may assume about an op, declared with it.

    Every category of ops the code tests for (`op in CONTRACTIONS`) is derived from these by
    `ops_with`, so adding an op means declaring its traits, not finding the sets it belongs to.
    """

    PURE = "pure"  # no side effects: dead if unused, CSE-able
    ELEMENTWISE = "elementwise"  # result[i] depends on operand[i] only (after broadcasting)
    CONTRACTION = "contraction"  # a sum of products over a contracted axis (a GEMM)
    ACCUMULATES = "accumulates"  # sums many values: its lowering chooses an accumulator
    COMPUTE_HEAVY = "compute-heavy"  # dominates the FLOPs: what keep-first-last counts
    QUANTIZABLE = "quantizable"  # the `quantize` pass rewrites it to integer arithmetic
    # Its result element type is what the op is for (a conversion, a constant's stored type),
    # not a compute format: precision assignment leaves it alone.
    TYPE_CARRYING = "type-carrying"
    # Each result element is an operand element or its negation: on operands already in the
    # result's format there is nothing to round.
    VALUE_PRESERVING = "value-preserving"
    CONVERSION = "conversion"  # changes its operand's element type (cast, quantize, ...)
    DATA_MOVEMENT = "data-movement"  # rearranges elements of any type, no arithmetic
    # A bounded-gain function of its operand (an activation): computed in f32 and rounded once,
    # it costs one rounding in the format its inputs arrive in, so sheets let it follow them.
    ACTIVATION = "activation"


@dataclass(frozen=True)
class OpDef:
    name: str
    min_operands: int
    max_operands: int | None  # None: variadic
    attrs: Mapping[str, AttrSpec]
    # Result types implied by the operands and attributes. Ops whose result type is chosen by
    # the writer (reshape's shape, cast's element type, matmul's accumulate-out type) receive the
    # declared results and check them; raise OpError on any violation.
    infer: Infer
    reference: Reference
    flops: Flops
    precisions: frozenset[str]  # compute formats this op may be assigned
    num_results: int | None = 1  # None: as many as the op's rule infers (mp.split)
    traits: frozenset[Trait] = frozenset()
    # The operand that holds a weight (a constant that sparsify prunes, lower-sparse encodes
    # and calibration does not record); None for ops without one.
    weight_operand: int | None = None
    doc: str = ""
    # Operand names for docs and diagnostics; "bias?" is optional, "inputs..." variadic.
    operand_names: tuple[str, ...] = ()
    vjp: Vjp | None = None  # None: the op has no gradient rule (grad reports it)
    # The interval (lo, hi) of the result from the operands' intervals and the checked attrs,
    # for range-analysis (infinite ends: unbounded). None: range-analysis's own rule, if any.
    bounds: Bounds | None = None
    # `reference` for attrs that check_attrs returned and a caller that holds np.errstate
    # itself (the executor's steps): the same results without checking the attributes again
    # on every call (8-30 us of a batch-1 conv). None: call `reference`.
    reference_checked: Reference | None = None

    # Cached: DCE, CSE and canonicalize ask these once per op of every function they run on.
    @cached_property
    def pure(self) -> bool:
        return Trait.PURE in self.traits

    @cached_property
    def elementwise(self) -> bool:
        return Trait.ELEMENTWISE in self.traits

    def bytes_moved(self, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> int:
        return sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs)


OPS: dict[str, OpDef] = {}


# Discardable attributes (a dotted name, `mp.precision`) whose values a dialect declares: the
# check that refuses a malformed value and what it expects, in words. The verifier applies them
# to every op, so no pass or reader meets `mp.precision = 3`.
ANNOTATIONS: dict[str, tuple[Callable[[Any], Any], str]] = {}


def annotation(name: str, check: Callable[[Any], Any], what: str) -> None:
    """Declare the annotation `name`: `check` raises OpError for a value it may not hold."""
    ANNOTATIONS[name] = (check, what)


def define(op: OpDef) -> OpDef:
    """Register `op`; a dialect module calls this for each of its ops when it is imported."""
    OPS[op.name] = op
    return op


def lookup(name: str) -> OpDef:
    """The registered op `name`; OpError when there is none.

    The IR layer never imports a dialect, so an op that is missing because its dialect was never
    imported says so, rather than reading like a misspelling.
    """
    opdef = OPS.get(name)
    if opdef is not None:
        return opdef
    dialect = name.partition(".")[0]
    if not any(n.startswith(f"{dialect}.") for n in OPS):
        raise OpError(f"unknown operation '{name}': no op of dialect '{dialect}' is registered "
                      "(import mplower.dialect)")
    raise OpError(f"unknown operation '{name}'{did_you_mean(name, OPS)}")


def ops_with(trait: Trait) -> frozenset[str]:
    """The names of the registered ops that declare `trait`."""
    return frozenset(name for name, op in OPS.items() if trait in op.traits)


# ---------------------------------------------------------------------------------------------
# Attribute values
#
# The parser hands attributes over as written: `3` is an int, `3 : i64` a TypedInt, `[1, 2]` a
# tuple, `bf16` a TypeAttr. The helpers below accept every spelling of a kind and return the
# plain Python value; `check_attrs` applies them to a whole attribute dict.


_I64 = (-(1 << 63), (1 << 63) - 1)


class _OutOfRange(OpError):
    """An integer of the right kind but too large: said as such, not as the wrong kind."""


def attr_int(v: Any) -> int:
    """An integer attribute (`3` or `3 : i64`) as an int, within int64 (an untyped integer is
    an i64 in MLIR, and op rules hand these to numpy)."""
    if isinstance(v, TypedInt):
        v = v.value
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise OpError(f"expected an integer, got {show_value(v)}")
    if not _I64[0] <= v <= _I64[1]:
        text = int_text(int(v))
        text = text if len(text) <= 40 else text[:37] + "..."
        raise _OutOfRange(f"integer {text} does not fit a 64-bit attribute (range "
                          f"[{_I64[0]}, {_I64[1]}])")
    return int(v)


def attr_float(v: Any) -> float:
    """A float attribute (`0.5`, `0.5 : f32`, or an integer) as a float."""
    if isinstance(v, (TypedFloat, TypedInt)):
        v = v.value
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise OpError(f"expected a number, got {show_value(v)}")
    return float(v)


def attr_ints(v: Any) -> tuple[int, ...]:
    """An array of integers (`[1, 2]` or 1-D integer `dense<>`) as a tuple of ints."""
    if isinstance(v, DenseAttr):
        if v.array.ndim > 1 or FORMATS[v.type.elem].is_float:
            raise OpError(f"expected an array of integers, got {show_value(v)}")
        return tuple(int(x) for x in v.array.reshape(-1))
    if not isinstance(v, (tuple, list)):
        raise OpError(f"expected an array of integers, got {show_value(v)}")
    try:
        return tuple(attr_int(x) for x in v)
    except _OutOfRange:
        raise
    except OpError:
        raise OpError(f"expected an array of integers, got {show_value(v)}") from None


def attr_floats(v: Any) -> tuple[float, ...]:
    """An array of numbers (`[0.5, 1]` or 1-D `dense<>`) as a tuple of floats."""
    if isinstance(v, DenseAttr):
        if v.array.ndim > 1:
            raise OpError(f"expected an array of numbers, got {show_value(v)}")
        return tuple(float(x) for x in v.array.reshape(-1))
    if not isinstance(v, (tuple, list)):
        raise OpError(f"expected an array of numbers, got {show_value(v)}")
    try:
        return tuple(attr_float(x) for x in v)
    except OpError:
        raise OpError(f"expected an array of numbers, got {show_value(v)}") from None


def attr_bool(v: Any) -> bool:
    """`true`/`false`; 0 and 1 are accepted too because ONNX spells flags as ints."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer, TypedInt)) and attr_int(v) in (0, 1):
        return attr_int(v) == 1
    raise OpError(f"expected true or false, got {show_value(v)}")


def attr_str(v: Any) -> str:
    if not isinstance(v, str):
        raise OpError(f"expected a string, got {show_value(v)}")
    return v


def attr_type(v: Any) -> str:
    """An element type attribute (`i8`, or the string "i8") as its name."""
    name = v.type if isinstance(v, TypeAttr) else v
    if not isinstance(name, str) or name not in FORMATS:
        raise OpError(f"expected an element type ({', '.join(ELEMENT_TYPES)}), got {show_value(v)}")
    return name


def attr_types(v: Any) -> tuple[str, ...]:
    """An array of element types (`[bf16, f32]`) as a tuple of their names."""
    if not isinstance(v, (tuple, list)):
        raise OpError(f"expected an array of element types, got {show_value(v)}")
    return tuple(attr_type(x) for x in v)


def attr_array(v: Any) -> np.ndarray:
    """A numeric attribute (`0.1`, `3 : i8`, `dense<[...]>`, N-D for blocked scales) as an array.

    Integers come back as int64 and floats as float64 so that no value is rounded here; the
    op decides the precision it computes in.
    """
    if isinstance(v, np.ndarray):
        arr = v
    elif isinstance(v, DenseAttr):
        arr = v.array
    elif isinstance(v, (TypedInt, int, np.integer)) and not isinstance(v, (bool, np.bool_)):
        arr = np.asarray(attr_int(v), dtype=np.int64)
    elif isinstance(v, (TypedFloat, float, np.floating)):
        arr = np.asarray(attr_float(v), dtype=np.float64)
    else:
        raise OpError(f"expected a number or dense elements, got {show_value(v)}")
    if arr.dtype.kind not in "iuf":
        raise OpError(f"expected a number or dense elements, got {show_value(v)}")
    return arr.astype(np.float64 if arr.dtype.kind == "f" else np.int64, copy=False)


def attr_dense(v: Any) -> DenseAttr:
    if not isinstance(v, DenseAttr):
        raise OpError(f"expected dense elements, got {show_value(v)}")
    return v


def _show_choice(spec: AttrSpec, choice: Any) -> str:
    return choice if spec.kind == "type" else show_value(choice)  # element types print bare: i8


def show_value(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return np.array2string(v, separator=", ")
    return attr_to_str(v)


_KINDS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "int": (attr_int, "an integer"),
    "float": (attr_float, "a number"),
    "str": (attr_str, "a string"),
    "bool": (attr_bool, "true or false"),
    "ints": (attr_ints, "an array of integers"),
    "floats": (attr_floats, "an array of numbers"),
    "type": (attr_type, "an element type"),
    "types": (attr_types, "an array of element types"),
    "dense": (attr_dense, "dense elements"),
    "number": (attr_array, "a number or dense elements"),
}


def check_attrs(opdef: OpDef, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Validate `attrs` against the op's declaration; return them as plain values with defaults.

    Kinds come back normalized (see the `attr_*` helpers: `number` becomes a numpy array). Names
    containing a '.' are discardable annotations (`mp.precision`, `mp.reason`) and pass through
    unchanged; any other unknown name is an error. The result is accepted again unchanged, so
    `infer`, `reference` and `flops` take either the raw or the checked dict.
    """
    return check_attr_values(opdef.name, opdef.attrs, attrs)


def check_attr_values(op: str, specs: Mapping[str, AttrSpec],
                      attrs: Mapping[str, Any]) -> dict[str, Any]:
    """`check_attrs` for an op that is being declared (its OpDef does not exist yet)."""
    out: dict[str, Any] = {}
    for name, value in attrs.items():
        if "." in name:
            if (declared := ANNOTATIONS.get(name)) is not None:
                _check_annotation(name, declared, value)
            out[name] = value
            continue
        spec = specs.get(name)
        if spec is None:
            raise OpError(_unknown_attr_message(op, name, specs))
        out[name] = _check_value(name, spec, value)
    for name, spec in specs.items():
        if name in out:
            continue
        if spec.required:
            raise OpError(f"{op} needs attribute '{name}' ({_KINDS[spec.kind][1]})")
        if spec.default is not None:
            out[name] = _check_value(name, spec, spec.default)
    return out


def _check_annotation(name: str, declared: tuple[Callable[[Any], Any], str], value: Any
                      ) -> None:
    """Refuse a malformed value of a declared annotation; the value itself is kept as written."""
    check, what = declared
    try:
        check(value)
    except OpError:
        text = show_value(value)
        text = text if len(text) <= 60 else text[:57] + "..."
        raise OpError(f"attribute '{name}' must be {what}, got {text}") from None


def _unknown_attr_message(op: str, name: str, specs: Mapping[str, AttrSpec]) -> str:
    if not specs:
        return f"{op} takes no attribute '{name}'"
    msg = f"unknown attribute '{name}' for {op}"
    close = difflib.get_close_matches(name, list(specs), n=1)
    if close:
        return f"{msg}; did you mean '{close[0]}'?"
    return f"{msg} (expected {', '.join(repr(k) for k in specs)})"


def _check_value(name: str, spec: AttrSpec, value: Any) -> Any:
    convert, what = _KINDS[spec.kind]
    try:
        v = convert(value)
    except _OutOfRange as e:
        raise OpError(f"attribute '{name}': {e.message}") from None
    except OpError:
        raise OpError(f"attribute '{name}' must be {what}, got {show_value(value)}") from None
    if spec.choices and v not in spec.choices:
        options = ", ".join(_show_choice(spec, c) for c in spec.choices)
        raise OpError(f"attribute '{name}' must be one of {options}; got {show_value(value)}")
    if spec.length is not None and len(v) != spec.length:
        raise OpError(f"attribute '{name}' must have {spec.length} entries, got {show_value(value)}")
    if spec.min is not None:
        entries = v if isinstance(v, tuple) else (v,)
        if any(x < spec.min for x in entries):
            raise OpError(f"attribute '{name}' must be >= {show_value(spec.min)}, got {show_value(value)}")
    return v


def op_signature_table() -> list[tuple[str, str, str, str]]:
    """(name, operands, attributes, doc) of every op, in definition order, for docs/ir.md."""
    rows = []
    for op in OPS.values():
        attrs = ", ".join(_attr_text(n, spec) for n, spec in op.attrs.items())
        rows.append((op.name, ", ".join(op.operand_names), attrs, op.doc))
    return rows


def _attr_text(name: str, spec: AttrSpec) -> str:
    """`name: kind` (required), `name: kind = default`, or `name?: kind` (optional, no default)."""
    kind = " | ".join(_show_choice(spec, c) for c in spec.choices) if spec.choices else spec.kind
    if spec.required:
        return f"{name}: {kind}"
    if spec.default is None:
        return f"{name}?: {kind}"
    return f"{name}: {kind} = {show_value(spec.default)}"
