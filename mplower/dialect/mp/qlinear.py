"""ONNX DynamicQuantizeLinear as three single-result ops over one computation: the uint8
codes, the scale and the zero point that ONNX derives from the tensor's own range.

The scale is a runtime value (a function of x), so mp.quantize, whose scale is an attribute,
cannot express it. What these compute is ONNX's definition: the range [min(0, min x),
max(0, max x)] over 255 steps, the zero point rounded half to even, x / scale rounded half to
even plus the zero point, saturated to [0, 255]. Their result types are what they are for, so
precision assignment leaves them alone (TYPE_CARRYING).
"""

from __future__ import annotations

import numpy as np

from mplower.dialect.mp.common import _FLOATS, _def, _elem_of
from mplower.ir.opdef import Trait
from mplower.ir.types import TensorType, tensor


def dynamic_quantize(x: np.ndarray) -> tuple[np.ndarray, np.float32, np.uint8]:
    """(codes, scale, zero point) of ONNX DynamicQuantizeLinear, in float32 as ONNX writes it
    (a scale of 1 where the range is empty)."""
    x = np.asarray(x, np.float32)
    hi = np.float32(max(0.0, float(np.max(x)))) if x.size else np.float32(0)
    lo = np.float32(min(0.0, float(np.min(x)))) if x.size else np.float32(0)
    scale = np.float32(1.0 if hi == lo else hi - lo) / np.float32(255)
    zp = np.rint(np.clip(np.float32(0) - lo / scale, 0, 255))
    q = np.clip(np.rint(x / scale) + zp, 0, 255)
    return q.astype(np.uint8), np.float32(scale), np.uint8(zp)


def _infer(elem: str, scalar: bool):
    def infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
        _elem_of(ins, _FLOATS, "a float")
        return [tensor(() if scalar else ins[0].shape, elem)]
    return infer


for _k, (_name, _elem, _scalar, _doc) in enumerate((
        ("dynamic_quantize", "ui8", False, "the uint8 codes"),
        ("dynamic_quantize_scale", "f32", True, "the scale"),
        ("dynamic_quantize_zero_point", "ui8", True, "the zero point"))):
    _def(_name,
         operands=("x",),
         attrs={},
         infer=_infer(_elem, _scalar),
         reference=lambda xs, a, rt, k=_k: [np.asarray(dynamic_quantize(xs[0])[k])],
         flops=lambda ins, a: 3 * ins[0].size,
         precisions=frozenset({"f32"}),
         doc=f"ONNX DynamicQuantizeLinear's {_doc}: x quantized to uint8 with the scale and "
             f"zero point of its own range [min(0, min x), max(0, max x)].",
         traits=frozenset({Trait.TYPE_CARRYING}))
