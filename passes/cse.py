"""`cse`: common-subexpression elimination of pure ops with equal operands, attributes and types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from mplower.ir.graph import RETURN, Function, Module
from mplower.ops import OPS
from mplower.pass_manager import Pass, PassContext, register_pass


def _hashable(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    if isinstance(v, tuple):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, np.ndarray):
        return (v.dtype.str, v.shape, v.tobytes())
    return v


def eliminate_common_subexpressions(f: Function) -> int:
    """Replace each op by the first earlier op computing the same thing; returns the count."""
    g = f.graph
    nodes = g.nodes
    seen: dict[tuple, int] = {}
    removed = 0
    for n in f.ops():
        d = nodes[n]
        opdef = OPS.get(d["op"])
        if d["op"] == RETURN or opdef is None or not opdef.pure:
            continue
        try:  # scalar attribute values hash as they are; order does not matter
            attrs = frozenset(d["attrs"].items())
        except TypeError:
            attrs = _hashable(d["attrs"])
        key = (d["op"], tuple(f.operands(n)), attrs, tuple(d["types"]))
        first = seen.get(key)
        if first is None:
            seen[key] = n
            continue
        for i in range(len(d["types"])):
            f.replace_all_uses((n, i), (first, i))
        f.erase(n)
        removed += 1
    return removed


@register_pass
@dataclass
class CommonSubexpressionElimination(Pass):
    """Merge pure operations that compute the same value from the same operands."""

    name: ClassVar[str] = "cse"
    statistics: ClassVar[dict[str, str]] = {"ops-eliminated": "duplicate operations merged"}

    def run(self, module: Module, ctx: PassContext) -> None:
        for f in module.functions.values():
            ctx.stat("ops-eliminated", eliminate_common_subexpressions(f))
