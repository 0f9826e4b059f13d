"""`cse`: common-subexpression elimination of pure ops with equal operands, attributes and types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.graph import RETURN, Function, Module
from mplower.ir.opdef import OPS
from mplower.pass_manager import Pass, PassContext, register_pass


def eliminate_common_subexpressions(f: Function) -> int:
    """Replace each op by the first earlier op computing the same thing; returns the count."""
    nodes = f.nodes
    # Bucketed by (op, operands, result types); attribute dicts are compared only within a
    # bucket, so the common case (no duplicate) never hashes attributes.
    seen: dict[tuple, list[int]] = {}
    removed = 0
    for n in f.ops():
        d = nodes[n]
        opdef = OPS.get(d["op"])
        if d["op"] == RETURN or opdef is None or not opdef.pure:
            continue
        key = (d["op"], tuple((u, r) for _, u, r in f.operand_edges(n)), tuple(d["types"]))
        bucket = seen.get(key)
        if bucket is None:
            seen[key] = [n]
            continue
        first = next((m for m in bucket if nodes[m]["attrs"] == d["attrs"]), None)
        if first is None:
            bucket.append(n)
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
