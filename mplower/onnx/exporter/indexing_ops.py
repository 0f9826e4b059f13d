"""ONNX export emitters of the scatters of mplower.dialect.mp.scatter (the other ops that
the importer's indexing_ops handlers accept are written as core mp ops, exported as those)."""

from __future__ import annotations

from mplower.ir.types import TensorType
from mplower.onnx.exporter.core import _Exporter, emitter


@emitter("mp.scatter_elements")
def _scatter_elements(self: _Exporter, op: str, a: dict, ins: list[str],
                      in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    ins = [ins[0], self.index(ins[1], in_types[1], ("i32", "i64")), ins[2]]
    return self.node("ScatterElements", ins, hint, axis=a["axis"], reduction=a["reduction"])


@emitter("mp.scatter_nd")
def _scatter_nd(self: _Exporter, op: str, a: dict, ins: list[str],
                in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    ins = [ins[0], self.index(ins[1], in_types[1], ("i64",)), ins[2]]
    return self.node("ScatterND", ins, hint, reduction=a["reduction"])
