"""ONNX's ScatterElements and ScatterND with every reduction (none, add, mul, max, min): data
with `updates` written, or combined, where the indices say.

The scatter-adds of mplower.dialect.mp.indexing are the gradients of the gathers; these are
the ONNX ops as models use them (KV-cache updates, masked writes). Updates land in index order,
so with `reduction = none` the last of several updates to one element wins, as onnxruntime's
CPU kernel writes them (ONNX leaves that case undefined).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from mplower.dialect.mp.common import _SUMS, _VECTOR, _def, _zeros_like
from mplower.dialect.mp.indexing import (
    _checked_indices,
    _scatter_elements_add_infer,
    _scatter_nd_add_infer,
)
from mplower.ir.opdef import AttrSpec, GradBuilder, OpError, Value, Vjp
from mplower.ir.types import TensorType

REDUCTIONS = ("none", "add", "mul", "max", "min")
_UFUNC = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}
_ATTR = {"reduction": AttrSpec("str", default="none", choices=REDUCTIONS)}


def _write(out: np.ndarray, where: tuple, updates: np.ndarray, reduction: str) -> np.ndarray:
    if reduction == "none":
        out[where] = updates  # numpy assigns in order: the last update to an element stays
    else:
        _UFUNC[reduction].at(out, where, updates.astype(out.dtype, copy=False))
    return out


def _scatter_vjp(scatter: str, gather: str, attrs: Callable[[dict], dict]) -> Vjp:
    """Updates get the cotangent read back where they were written. With `add` data's
    cotangent is dy; with `none` the written elements of data got overwritten, so theirs is
    zero (indices of `none` do not repeat, as ONNX asks). The others have no rule here."""
    def vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
            needs: Sequence[bool]) -> list[Value | None]:
        r = a["reduction"]
        if r not in ("none", "add"):
            raise OpError(f"scatter with reduction '{r}' has no gradient rule")
        d_updates = g.emit(gather, [dy, xs[1]], attrs(a))
        d_data = dy if r == "add" else g.emit(scatter, [dy, xs[1], _zeros_like(g, xs[2])],
                                              dict(a))
        return [d_data, None, d_updates]
    return vjp


# The shape rules are the scatter-adds' (mplower.dialect.mp.indexing): only the reduction differs.
_scatter_elements_infer = _scatter_elements_add_infer


def _scatter_elements_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    data, idx, updates = xs
    axis = a["axis"] % data.ndim
    where = list(np.indices(idx.shape, sparse=True))
    where[axis] = _checked_indices(idx, data.shape[axis])
    return [_write(data.copy(), tuple(where), updates, a["reduction"])]


_def("scatter_elements",
     vjp=_scatter_vjp("mp.scatter_elements", "mp.gather_elements",
                      lambda a: {"axis": a["axis"]}),
     operands=("data", "indices", "updates"),
     attrs={"axis": AttrSpec("int", default=0), **_ATTR},
     infer=_scatter_elements_infer,
     reference=_scatter_elements_reference,
     flops=lambda ins, a: ins[2].size,
     precisions=_VECTOR,
     doc="data with each update written (or added, multiplied, maxed, minned: `reduction`) at "
         "its own position but along `axis` at its index (ONNX ScatterElements).",
     traits=_SUMS)


def _scatter_nd_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    return _scatter_nd_add_infer(ins, {"batch_dims": 0}, declared)  # ScatterND has none


def _scatter_nd_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    data, idx, updates = xs
    k = idx.shape[-1]
    where = tuple(_checked_indices(idx[..., i], data.shape[i]) for i in range(k))
    return [_write(data.copy(), where, updates, a["reduction"])]


_def("scatter_nd",
     vjp=_scatter_vjp("mp.scatter_nd", "mp.gather_nd", lambda a: {"batch_dims": 0}),
     operands=("data", "indices", "updates"),
     attrs=_ATTR,
     infer=_scatter_nd_infer,
     reference=_scatter_nd_reference,
     flops=lambda ins, a: ins[2].size,
     precisions=_VECTOR,
     doc="data with each slice of `updates` written (or combined by `reduction`) where "
         "gather_nd with the same `indices` reads it (ONNX ScatterND).",
     traits=_SUMS)
