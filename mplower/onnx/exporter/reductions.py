"""ONNX export emitters of the reductions and selections of mplower.dialect.mp.reductions."""

from __future__ import annotations

from onnx import TensorProto, helper

from mplower.ir.types import TensorType
from mplower.onnx.exporter.core import _Exporter, emitter

_ONNX_REDUCE = {"mp.reduce_min": "ReduceMin", "mp.reduce_prod": "ReduceProd"}


@emitter(*_ONNX_REDUCE)
def _reduce(self: _Exporter, op: str, a: dict, ins: list[str],
            in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    axes = [self.ints(a["axes"], f"{hint}_axes")] if a["axes"] else []
    return self.node(_ONNX_REDUCE[op], ins + axes, hint, keepdims=int(a["keepdims"]))


@emitter("mp.argmin")
def _argmin(self: _Exporter, op: str, a: dict, ins: list[str],
            in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    idx = self.node("ArgMin", ins, f"{hint}_i64", axis=a["axis"], keepdims=int(a["keepdims"]))
    return self.node("Cast", [idx], hint, to=TensorProto.INT32)


@emitter("mp.topk", "mp.topk_indices")
def _topk(self: _Exporter, op: str, a: dict, ins: list[str],
          in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    # TopK always writes both results; the one this op is is kept, the other is unused.
    values, indices = self.fresh(f"{hint}_values"), self.fresh(f"{hint}_indices")
    self.nodes.append(helper.make_node(
        "TopK", [ins[0], self.ints([a["k"]], f"{hint}_k")], [values, indices], name=values,
        axis=a["axis"], largest=int(a["largest"]), sorted=1))
    return values if op == "mp.topk" else indices
