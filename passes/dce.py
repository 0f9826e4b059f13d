"""`dce`: erase pure ops whose results are never used."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.graph import ARG, RETURN, Function, Module
from mplower.ir.opdef import OPS
from mplower.pass_manager import Pass, PassContext, register_pass


def eliminate_dead_ops(f: Function) -> int:
    """Erase unused pure ops, last to first, so chains of dead ops go in one sweep."""
    g = f.graph
    erased = 0
    for n in reversed(f.ops()):
        op = g.nodes[n]["op"]
        if op in (RETURN, ARG) or f.has_uses(n):
            continue
        opdef = OPS.get(op)
        if opdef is not None and opdef.pure:
            f.erase(n)
            erased += 1
    return erased


@register_pass
@dataclass
class DeadCodeElimination(Pass):
    """Erase pure operations whose results have no uses."""

    name: ClassVar[str] = "dce"
    statistics: ClassVar[dict[str, str]] = {"ops-erased": "dead operations erased"}

    def run(self, module: Module, ctx: PassContext) -> None:
        for f in module.functions.values():
            ctx.stat("ops-erased", eliminate_dead_ops(f))
