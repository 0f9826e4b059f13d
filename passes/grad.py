"""`grad`: reverse-mode differentiation, the backward graph built in the same IR.

The function's result becomes a scalar loss (it already is one, or `loss=` appends softmax
cross-entropy or mean squared error against a new labels argument); the pass then walks the
ops from the loss back to the values in `wrt`, asking each op's vector-Jacobian rule (its
`vjp`, declared with the op in mplower.dialect.mp) for the cotangents of its operands, and
sums the cotangents of values used several times. The function then returns the loss followed
by one gradient per `wrt` value. Every backward op is an ordinary mp op tagged
`mp.grad_of = "NAME"` (the forward op it differentiates), so assign-precision, insert-casts, the
executor and the report treat it as any other op and the training report can split incidence
into forward and backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from mplower.passes.dce import eliminate_dead_ops

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.dialect.plan import GRAD_OF, OUTPUT_NAMES
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import ARG, RETURN, Function, Module, Value
from mplower.ir.opdef import OPS, OpError, check_attrs
from mplower.ir.types import DenseAttr, TensorType, tensor, value_dtype
from mplower.numerics.formats import FLOATS
from mplower.pass_manager import Pass, PassContext, PipelineError, option, register_pass

LOSSES = ("", "cross_entropy", "mse")


class _Builder:
    """The GradBuilder the rules emit through: new ops go before the return, typed by their
    op's own type rule, named and tagged after the forward op being differentiated."""

    def __init__(self, f: Function, ctx: PassContext):
        self.f, self.ctx = f, ctx
        self.ret = f.return_node
        self.of = ""  # the forward op whose rule is running ("" while building the loss)
        self.hint = "loss"  # the names of the loss's own ops

    def type_of(self, value: Value) -> TensorType:
        return self.f.type_of(value)

    def emit(self, op: str, operands: Sequence[Value], attrs: Mapping[str, Any] | None = None,
             result: TensorType | None = None) -> Value:
        attrs = {k: _ir_attr(v) for k, v in (attrs or {}).items()}
        types = OPS[op].infer([self.f.type_of(v) for v in operands], attrs,
                              [result] if result is not None else [])
        node = self.f.create_op(op, operands, types, attrs, before=self.ret,
                                name_hint=f"d{self.of}" if self.of else self.hint)
        if self.of:
            self.f.set_attr(node, GRAD_OF, self.of)
            self.ctx.stat("backward-ops")
        return (node, 0)

    def splat(self, value: float, shape: tuple[int, ...], elem: str) -> Value:
        t = tensor(shape, elem)
        return self.emit("mp.constant", [], {"value": DenseAttr(
            np.full(shape, value, dtype=value_dtype(elem)), t)}, result=t)


def _ir_attr(v: Any) -> Any:
    """A checked attribute value (rules copy them from the forward op) in its IR spelling:
    per-axis numbers come back from `check_attrs` as numpy arrays; they print as f64 or i32
    dense elements, which hold them exactly."""
    if not isinstance(v, np.ndarray):
        return v
    if v.ndim == 0:
        return float(v) if v.dtype.kind == "f" else int(v)
    elem = "f64" if v.dtype.kind == "f" else "i32"
    return DenseAttr(v.astype(value_dtype(elem)), tensor(v.shape, elem))


@register_pass
@dataclass
class Grad(Pass):
    """Append the backward graph: the function returns its scalar loss, then d loss / d v for
    every `wrt` value, built from each op's gradient rule (docs/training.md)."""

    name: ClassVar[str] = "grad"
    statistics: ClassVar[dict[str, str]] = {"backward-ops": "backward operations created"}
    examples: ClassVar[tuple[str, ...]] = (
        "ir_examples/mlp.ir --pass='grad{loss=cross_entropy}'",)
    loss: str = option("", "the loss: empty (the function's one result already is a scalar "
                           "loss), cross_entropy (softmax cross-entropy of the result, or of "
                           "the logits of a final mp.softmax, against one-hot labels) or mse")
    labels: str = option("labels", "name of the argument that cross_entropy/mse add for the "
                                   "targets")
    wrt: str = option("params", "what to differentiate by: params (every named float "
                                "constant), args (every float argument) or a comma-separated "
                                "list of argument and constant names")
    seed: str = option("", "name of a scalar f32 argument to add as the loss's cotangent "
                           "(a loss scale); empty: 1")

    def __post_init__(self) -> None:
        # An option typo is a usage error when the pipeline is parsed, before any input is read.
        if self.loss not in LOSSES:
            raise PipelineError(f"grad: unknown loss '{self.loss}' (expected "
                                f"{', '.join(repr(x) for x in LOSSES)})")

    def run(self, module: Module, ctx: PassContext) -> None:
        for f in module.functions.values():
            self._differentiate(f, ctx)

    def _differentiate(self, f: Function, ctx: PassContext) -> None:
        g = _Builder(f, ctx)
        ret = g.ret
        results = f.operands(ret)
        if len(results) != 1:
            raise DiagnosticError.at(f.data(ret)["loc"], f"grad: @{f.name} returns "
                                     f"{len(results)} values; it needs one (the loss or the "
                                     "model output)")
        loss = self._loss(f, g, results[0])
        lt = f.type_of(loss)
        if lt.size != 1 or lt.elem not in FLOATS:
            raise DiagnosticError.at(f.data(ret)["loc"], f"grad: the loss must be a float "
                                     f"scalar, got {lt}; pass loss=cross_entropy or loss=mse")
        leaves = self._leaves(f)
        seed = (_new_arg(f, "seed", self.seed, tensor((), lt.elem)), 0) if self.seed else None
        if seed is not None and lt.shape != ():
            seed = g.emit("mp.reshape", [seed], result=lt)
        grads = backward(f, g, loss, seed if seed is not None else g.splat(1.0, lt.shape, lt.elem),
                         [(n, 0) for n in leaves])
        outs = [loss, *grads]
        for pos, v in enumerate(outs):
            f.set_operand(ret, pos, v)
        f.result_types = [f.type_of(v) for v in outs]
        # The imported model's output names named its output, not the loss and gradients.
        f.attrs.pop(OUTPUT_NAMES, None)
        eliminate_dead_ops(f)

    def _loss(self, f: Function, g: _Builder, out: Value) -> Value:
        if not self.loss:
            return out
        d = f.data(out[0])
        if self.loss == "cross_entropy" and d["op"] == "mp.softmax":
            t = f.type_of(out)
            if check_attrs(OPS["mp.softmax"], d["attrs"])["axis"] % t.rank == t.rank - 1:
                out = f.operands(out[0])[0]  # the logits: log_softmax is the stable form
        t = f.type_of(out)
        if t.elem not in FLOATS or (self.loss == "cross_entropy" and t.rank != 2):
            want = "(batch, classes) logits" if self.loss == "cross_entropy" else "a float result"
            raise DiagnosticError.at(f.data(f.return_node)["loc"],
                                     f"grad: loss={self.loss} needs {want}, got {t}")
        target = (_new_arg(f, "labels", self.labels, t), 0)
        g.hint = self.loss
        if self.loss == "mse":
            diff = g.emit("mp.sub", [out, target])
            return g.emit("mp.reduce_mean", [g.emit("mp.mul", [diff, diff])],
                          {"axes": (), "keepdims": False})
        logp = g.emit("mp.log_softmax", [out], {"axis": -1})
        total = g.emit("mp.reduce_sum", [g.emit("mp.mul", [logp, target])],
                       {"axes": (), "keepdims": False})
        return g.emit("mp.mul", [total, g.splat(-1.0 / t.shape[0], (), t.elem)])

    def _leaves(self, f: Function) -> list[int]:
        floats = [n for n in [*f.args, *f.ops()]
                  if f.op(n) in (ARG, "mp.constant") and f.types(n)[0].elem in FLOATS]
        if self.wrt == "params":
            return [n for n in floats if "name" in f.attrs_of(n)]
        if self.wrt == "args":
            return [n for n in floats if f.op(n) == ARG and f.data(n)["name"] != self.labels]
        by_name = {}
        for n in floats:
            key = f.data(n)["name"] if f.op(n) == ARG else f.attrs_of(n).get("name")
            by_name.setdefault(key, n)
        names = [w.strip().lstrip("%") for w in self.wrt.split(",") if w.strip()]
        missing = [w for w in names if w not in by_name]
        if missing:
            raise DiagnosticError.at(f.loc, f"grad: wrt names {', '.join(missing)}, which @{f.name}"
                                            " has neither as a float argument nor as a named "
                                            "constant")
        return [by_name[w] for w in names]


def _new_arg(f: Function, option: str, name: str, type_: TensorType) -> int:
    """The argument `option=name` adds; a name the function already uses would be a second
    definition of that value, which only the verifier would catch, unlocated."""
    if f.fresh_name(name) != name:
        raise DiagnosticError.at(f.loc, f"grad: {option}={name} would add an argument %{name}, "
                                        f"but @{f.name} already has a value of that name; "
                                        f"give {option}= another name")
    return f.add_arg(name, type_)


def backward(f: Function, g: _Builder, loss: Value, seed: Value,
             wrt: list[Value]) -> list[Value]:
    """The cotangent of each `wrt` value for `seed` at `loss`: reverse program order through
    the ops between them, one rule per op, cotangents of a value used twice summed."""
    needs: set[Value] = set(wrt)
    order = [n for n in f.ops() if f.op(n) != RETURN]
    for n in order:
        if any(v in needs for v in f.operands(n)):
            needs.update((n, r) for r, t in enumerate(f.types(n)) if t.elem in FLOATS)
    cot: dict[Value, Value] = {loss: seed}
    for n in reversed(order):
        results = [(n, r) for r in range(len(f.types(n)))]
        if not any(v in cot and v in needs for v in results):
            continue
        # An op with several results (mp.split) gets the cotangent of each, zeros for those
        # the loss does not use; a single-result op gets its one.
        dys = tuple(cot.get(v) or g.splat(0.0, t.shape, t.elem)
                    for v, t in zip(results, f.types(n)))
        dy = dys[0] if len(dys) == 1 else dys
        d = f.data(n)
        operands = f.operands(n)
        flags = [v in needs for v in operands]
        if not any(flags):
            continue
        opdef = OPS[d["op"]]
        if opdef.vjp is None:
            raise DiagnosticError.at(d["loc"], f"grad: {d['op']} has no gradient rule")
        g.of = d["name"]
        try:
            grads = opdef.vjp(g, operands, (n, 0), dy, check_attrs(opdef, d["attrs"]), flags)
        except OpError as e:
            raise DiagnosticError.at(d["loc"], f"grad: {e.message}") from None
        for v, dv, flag in zip(operands, grads, flags):
            if flag and dv is not None:
                cot[v] = g.emit("mp.add", [cot[v], dv]) if v in cot else dv
        g.of = ""
    out = []
    for v in wrt:
        t = f.type_of(v)
        out.append(cot.get(v) or g.splat(0.0, t.shape, t.elem))
    return out
