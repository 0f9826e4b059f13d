"""ONNX export emitters of mplower.dialect.mp.qlinear (DynamicQuantizeLinear's three results).

The integer ops of mplower.onnx.importer.qlinear are written as core mp ops (an i8 matmul or
conv with an i32 accumulator, i32 arithmetic, mp.quantize) and export as those."""

from __future__ import annotations

from onnx import helper

from mplower.ir.types import TensorType
from mplower.onnx.exporter.core import _Exporter, emitter

_RESULT = {"mp.dynamic_quantize": 0, "mp.dynamic_quantize_scale": 1,
           "mp.dynamic_quantize_zero_point": 2}


@emitter(*_RESULT)
def _dynamic_quantize(self: _Exporter, op: str, a: dict, ins: list[str],
                      in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    # The node writes all three; the one this op is is kept, the others are unused.
    outs = [self.fresh(f"{hint}_{part}") for part in ("codes", "scale", "zero_point")]
    self.nodes.append(helper.make_node("DynamicQuantizeLinear", ins, outs, name=outs[0]))
    return outs[_RESULT[op]]
