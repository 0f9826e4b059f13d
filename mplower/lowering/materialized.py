"""Whether a function's precision plan is materialized: the check the executor and the ONNX
exporter make before they run or write a module as it is (they never run a pass), and the
rule insert-casts (passes/insert_casts.py) materializes a plan by: the format an op wants its
float operands in, and the format it writes its results in.
"""

from __future__ import annotations

from mplower.dialect.mp import TYPE_CARRYING
from mplower.dialect.plan import ACCUM, PRECISION
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import Function
from mplower.ir.opdef import OpError, attr_type
from mplower.ir.types import TypeAttr
from mplower.lowering.policy import result_format
from mplower.numerics.formats import FLOATS


def wanted(d: dict) -> str | None:
    """The float format an op (its node data) wants its float operands in, or None to keep them."""
    p = d["attrs"].get(PRECISION)
    if p is None or d["op"] in TYPE_CARRYING:
        return None
    elem = p.type if isinstance(p, TypeAttr) else attr_type(p)
    return elem if elem in FLOATS else None


def writes(d: dict, want: str) -> str:
    """The format an op (its node data) computing in `want` writes its float results in."""
    accum = d["attrs"].get(ACCUM)
    return result_format(d["op"], want, accum.type if isinstance(accum, TypeAttr) else
                         attr_type(accum) if accum is not None else None)


def unmaterialized(f: Function) -> int | None:
    """The first op whose float plan is still only an annotation: insert-casts would give it
    operands or results of another format. None when the plan (if any) is materialized."""
    nodes = f.nodes
    for n in f.ops():
        d = nodes[n]
        try:
            want = wanted(d)
            if want is None:
                continue
            out = writes(d, want)
        except OpError:  # a malformed annotation: the executor reports it where it stands
            continue
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
            f"({PRECISION} = {wanted(d)}): run insert-casts first "
            f"(mplower opt --pass=insert-casts)"))
