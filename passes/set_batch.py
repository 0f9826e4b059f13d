"""`set-batch`: change the batch size a function is written for.

The IR has static shapes, so a model written for batches of 32 runs and trains only on
batches of 32. The batch is the leading dimension of the first argument; every argument whose
leading dimension is that size carries it. The pass gives those arguments the new size and
re-infers every op's result types from its operands with the op table's own shape rules (the
ones the verifier runs), in program order. An op whose result type is the writer's choice
(`mp.reshape`'s target shape, `mp.expand`'s) is offered its declared type with the leading
dimension scaled when that dimension is the old batch, so the shape rule itself decides (a
reshape's element count, an expand's broadcast). Batch rows stay independent: a slice that
takes part of the batch or a concat that joins along it would change which rows an output
holds, and the pass refuses them, as it refuses any op whose shape rule rejects the new
operands (a constant written at the old batch size), with the op's location.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import RETURN, Function, Module
from mplower.ir.opdef import OpError, attr_int, attr_ints, check_attrs, lookup
from mplower.ir.types import TensorType, tensor
from mplower.pass_manager import Pass, PassContext, PipelineError, option, register_pass


def _with_batch(t: TensorType, size: int) -> TensorType:
    return tensor((size,) + t.shape[1:], t.elem, t.encoding)


def _keep_batch_rows(f: Function, n: int, old: int, size: int) -> None:
    """Refuse a slice or concat that would regroup the rows of the batch (axis 0); a slice of
    all of them is widened to the new size."""
    d = f.data(n)
    attrs = check_attrs(lookup(d["op"]), d["attrs"])
    if d["op"] == "mp.concat" and attr_int(attrs["axis"]) % f.operand_types(n)[0].rank == 0:
        raise DiagnosticError.at(d["loc"], "set-batch: mp.concat joins along the batch "
                                           "dimension (axis 0)")
    if d["op"] == "mp.slice":
        starts, ends = attr_ints(attrs["starts"]), attr_ints(attrs["ends"])
        steps = attr_ints(attrs["steps"]) if "steps" in attrs else (1,) * len(starts)
        if (starts[0], steps[0]) != (0, 1) or ends[0] < old:
            raise DiagnosticError.at(d["loc"], "set-batch: mp.slice takes part of the batch "
                                               "dimension (axis 0); only a slice of all of it "
                                               "can follow a new batch size")
        if ends[0] < size:
            f.set_attr(n, "ends", (size,) + ends[1:])


def set_batch(f: Function, size: int) -> int:
    """Give @f batches of `size`; returns how many ops' result types changed. Raises a
    DiagnosticError at the op (or argument) that cannot follow the new size."""
    if not f.args or f.type_of((f.args[0], 0)).rank == 0:
        raise DiagnosticError.at(f.loc, f"set-batch: @{f.name} has no batch dimension (its "
                                        "first argument is not a tensor of rank >= 1)")
    old = f.type_of((f.args[0], 0)).shape[0]
    if size == old:
        return 0
    # A value follows the batch iff its type changed, so keep the types as written.
    written = {n: list(f.types(n)) for n in f.args + f.ops()}
    for a in f.args:
        t = f.type_of((a, 0))
        if t.rank and t.shape[0] == old:
            f.set_result_type(a, 0, _with_batch(t, size))
    retyped = 0
    for n in f.ops():
        d = f.data(n)
        if d["op"] == RETURN:
            f.result_types = f.operand_types(n)
            break
        ins = f.operand_types(n)
        written_in = [written[u][res] for u, res in f.operands(n)]
        if ins == written_in:
            continue
        if d["op"] in ("mp.concat", "mp.slice") and any(
                t.shape[:1] != w.shape[:1] for t, w in zip(ins, written_in)):
            _keep_batch_rows(f, n, old, size)
        scaled = [_with_batch(t, size) if t.rank and t.shape[0] == old else t
                  for t in d["types"]]
        try:
            out = lookup(d["op"]).infer(ins, check_attrs(lookup(d["op"]), d["attrs"]), scaled)
        except OpError as e:
            raise DiagnosticError.at(d["loc"], f"set-batch: cannot change the batch from {old} "
                                               f"to {size}: {e.message}") from None
        if list(out) != d["types"]:
            for i, t in enumerate(out):
                f.set_result_type(n, i, t)
            retyped += 1
    return retyped


@register_pass
@dataclass
class SetBatch(Pass):
    """Change the batch size of every function: the leading dimension of the arguments that
    carry the batch (those whose leading dimension is the first argument's), with every result
    type re-inferred by the op's shape rule. Refuses, at the op, what cannot follow a new batch
    (a constant or reshape written for the old size, a slice or concat across the batch)."""

    name: ClassVar[str] = "set-batch"
    statistics: ClassVar[dict[str, str]] = {"ops-retyped": "ops whose result types changed"}
    examples: ClassVar[tuple[str, ...]] = ("ir_examples/mlp.ir --pass='set-batch{size=16}'",)
    size: int = option(0, "the new batch size (required, >= 1)")

    def __post_init__(self) -> None:
        if self.size < 1:
            raise PipelineError(f"set-batch: size must be at least 1, got {self.size}")

    def run(self, module: Module, ctx: PassContext) -> None:
        for f in module.functions.values():
            ctx.stat("ops-retyped", set_batch(f, self.size))
