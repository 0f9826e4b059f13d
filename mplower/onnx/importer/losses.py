"""ONNX import handlers: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Both are the negated input picked at each target class (gather_elements along the class axis),
weighted per class and masked where the target is `ignore_index`, then reduced: `mean`
divides the sum by the sum of the weights used (ONNX's definition, which is the plain mean
when there are no weights and nothing is ignored). SoftmaxCrossEntropyLoss takes the picks
from log_softmax over the class axis, which is also its optional second output.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.onnx.importer.core import Run, _attrs, _Importer, _reshape_to, handler

_REDUCTIONS = ("none", "sum", "mean")


def _nll(imp: _Importer, node: onnx.NodeProto, x: Run) -> Run:
    """The loss of log-probabilities x (N, C, d...) against input 1's targets (N, d...)."""
    target = imp.run_input(1)
    a = _attrs(node)
    reduction = a.get("reduction", "mean")
    if reduction not in _REDUCTIONS:
        raise imp.error(f"reduction '{reduction}' is not one of {', '.join(_REDUCTIONS)}")
    shape = x.type.shape
    if x.type.rank < 2 or target.type.shape != (shape[0], *shape[2:]):
        raise imp.error(f"target {target.type} must have the input's shape {x.type} without "
                        f"its class axis (1)")
    if target.type.elem not in ("i32", "i64"):
        raise imp.error(f"target must hold int32 or int64 class indices, got {target.type}")
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    ignore = a.get("ignore_index")
    kept = None
    if ignore is not None:
        index_dtype = helper.tensor_dtype_to_np_dtype(target.onnx_type)
        ign = imp.constant(np.array(ignore, index_dtype), "ignore_index")
        kept = imp.emit("mp.logical_not", [imp.emit("mp.equal", [target, ign])], hint="kept")
        # An ignored target may be no class at all: it reads class 0, then counts as 0.
        zero = imp.constant(np.zeros((), index_dtype), "class_0")
        target = imp.emit("mp.where", [kept, target, zero], hint="safe_target",
                          onnx_type=target.onnx_type)
    at = _reshape_to(imp, target, (shape[0], 1, *shape[2:]))
    picked = imp.emit("mp.gather_elements", [x, at], {"axis": 1}, hint="picked",
                      onnx_type=x.onnx_type)
    loss = imp.emit("mp.neg", [_reshape_to(imp, picked, target.type.shape)], hint="nll",
                    onnx_type=x.onnx_type)
    zeros = imp.constant(np.zeros((), dtype), "zero")
    weight = imp.input(2)
    w = None
    if weight is not None:
        weight = imp.run_input(2)
        if weight.type.shape != (shape[1],):
            raise imp.error(f"weight {weight.type} must hold one value per class ({shape[1]})")
        w = imp.emit("mp.gather", [weight, target], {"axis": 0}, hint="class_weight",
                     onnx_type=x.onnx_type)
        if kept is not None:
            w = imp.emit("mp.where", [kept, w, zeros], hint="class_weight",
                         onnx_type=x.onnx_type)
    elif kept is not None:
        one = imp.constant(np.ones((), dtype), "one")
        w = imp.emit("mp.where", [kept, one, zeros], hint="kept_weight", onnx_type=x.onnx_type)
    if kept is not None:
        loss = imp.emit("mp.where", [kept, loss, zeros], hint="nll", onnx_type=x.onnx_type)
    if weight is not None:
        loss = imp.emit("mp.mul", [loss, w], hint="weighted_nll", onnx_type=x.onnx_type)
    if reduction == "none":
        return loss
    everything = {"axes": tuple(range(loss.type.rank)), "keepdims": False}
    total = imp.emit("mp.reduce_sum", [loss], everything, hint="loss_sum",
                     onnx_type=x.onnx_type)
    if reduction == "sum":
        return total
    if w is None:
        return imp.emit("mp.reduce_mean", [loss], everything, onnx_type=x.onnx_type)
    count = imp.emit("mp.reduce_sum", [w], everything, hint="weight_sum",
                     onnx_type=x.onnx_type)
    return imp.emit("mp.div", [total, count], onnx_type=x.onnx_type)


@handler("NegativeLogLikelihoodLoss")
def _nll_loss(imp: _Importer, node: onnx.NodeProto) -> list:
    return [_nll(imp, node, imp.run_input(0))]


@handler("SoftmaxCrossEntropyLoss")
def _softmax_cross_entropy(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    if x.type.rank < 2:
        raise imp.error(f"scores must be (N, C, d...), got {x.type}")
    log_prob = imp.emit("mp.log_softmax", [x], {"axis": 1}, hint="log_prob",
                        onnx_type=x.onnx_type)
    return [_nll(imp, node, log_prob), log_prob]
