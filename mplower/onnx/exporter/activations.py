"""ONNX export emitters of the activation and elementwise-math ops (mplower.dialect.mp
.activations): each is its ONNX op with the same attributes, except Swish, which is ONNX
opset 24 and is written as x * Sigmoid(alpha x) in the exported opset (ONNX's own definition
of Swish)."""

from __future__ import annotations

import numpy as np

from mplower.ir.opdef import OPS
from mplower.ir.types import TensorType
from mplower.onnx.exporter.core import _Exporter, emitter

_SAME = {
    "mp.hard_swish": "HardSwish", "mp.mish": "Mish", "mp.softplus": "Softplus",
    "mp.softsign": "Softsign", "mp.abs": "Abs", "mp.sign": "Sign", "mp.floor": "Floor",
    "mp.ceil": "Ceil", "mp.round": "Round", "mp.sin": "Sin", "mp.cos": "Cos", "mp.tan": "Tan",
    "mp.asin": "Asin", "mp.acos": "Acos", "mp.atan": "Atan", "mp.sinh": "Sinh",
    "mp.cosh": "Cosh", "mp.asinh": "Asinh", "mp.acosh": "Acosh", "mp.atanh": "Atanh",
    "mp.prelu": "PRelu", "mp.bitwise_and": "BitwiseAnd", "mp.bitwise_or": "BitwiseOr",
    "mp.bitwise_xor": "BitwiseXor", "mp.bitwise_not": "BitwiseNot",
    # ops whose attributes are ONNX's, by the same names
    "mp.hard_sigmoid": "HardSigmoid", "mp.leaky_relu": "LeakyRelu", "mp.elu": "Elu",
    "mp.selu": "Selu", "mp.celu": "Celu", "mp.thresholded_relu": "ThresholdedRelu",
    "mp.shrink": "Shrink", "mp.hardmax": "Hardmax", "mp.bit_shift": "BitShift",
}


@emitter(*_SAME)
def _same(self: _Exporter, op: str, a: dict, ins: list[str],
          in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    attrs = {k: (int(v) if isinstance(v, bool) else v) for k, v in a.items()
             if k in OPS[op].attrs}
    return self.node(_SAME[op], ins, hint, **attrs)


@emitter("mp.mod")
def _mod(self: _Exporter, op: str, a: dict, ins: list[str],
         in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("Mod", ins, hint, fmod=int(a["fmod"]))


@emitter("mp.clip")
def _clip(self: _Exporter, op: str, a: dict, ins: list[str],
          in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    # ONNX Clip's bounds are scalars; mp.clip's hold one value in any shape.
    bounds = [b if t.rank == 0 else
              self.node("Reshape", [b, self.ints([], f"{hint}_scalar")], f"{b}_scalar")
              for b, t in zip(ins[1:], in_types[1:])]
    return self.node("Clip", [ins[0], *bounds], hint)


@emitter("mp.swish")
def _swish(self: _Exporter, op: str, a: dict, ins: list[str],
           in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    dtype = np.float64 if in_types[0].elem == "f64" else np.float32  # narrow floats as FLOAT
    alpha = self.init(np.array(a["alpha"], dtype), f"{hint}_alpha")
    gate = self.node("Sigmoid", [self.node("Mul", [ins[0], alpha], f"{hint}_scaled")],
                     f"{hint}_gate")
    return self.node("Mul", [ins[0], gate], hint)

