"""Fused convolutions and elementwise ops: what the `fuse` pass (passes/fuse.py) makes of a
conv and the ops that touch each of its outputs once, and of a bf16/fp16 add, sub or mul and
the cast of its result.

`mp.fused_conv2d` is, in order: an optional channel shuffle of its input (ShuffleNet's
reshape, swap, reshape), the conv (exact integer sums for 8-bit operands), the dequantize of
those sums (`scale`), the add of a per-channel `bias`, a relu, then either the rounding to its
result type or a quantize (`out_scale`, `out_zero_point`, `out_dtype`) whose integers are the
result, or which is dequantized back when the result is f32 (a QDQ pair). `mp.fused_binary` is
`mp.add`, `mp.sub` or `mp.mul` rounded to `formats`, then cast to its result type. Each op's
reference is the composition of the references of the ops it replaces, so the fp32 reference
still checks the fused program.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mplower.dialect.fused import PLAIN_FLOATS, apply_reference
from mplower.dialect.mp.common import (
    _CONTRACTION,
    _FLOATS,
    _VECTOR,
    _WINDOW_ATTRS,
    _binary_infer,
    _declared,
    _def,
    _elementwise_size,
)
from mplower.dialect.mp.linalg import _conv_flops, _conv_geometry
from mplower.ir.opdef import AttrSpec, OpError, attr_array, attr_type
from mplower.ir.types import TensorType, tensor
from mplower.numerics.formats import FORMATS

_EIGHT_BIT = ("i8", "ui8")
BINARY_KINDS = ("add", "sub", "mul")


def per_channel(t: TensorType, channels: int) -> bool:
    """Whether a value of type `t` holds one value per output channel of an NCHW result (or
    one for all): its one dimension that is not 1, if any, is the channels', wherever it is."""
    big = [d for d in t.shape if d != 1]
    return len(big) <= 1 and (not big or big[0] == channels)


def channel_shuffle(x: np.ndarray, groups: int) -> np.ndarray:
    """ShuffleNet's shuffle of x's channels (N, C, H, W): viewed as (N, groups, C / groups,
    H, W), the two channel axes swapped, viewed back."""
    n, c, h, w = x.shape
    return x.reshape(n, groups, c // groups, h, w).transpose(0, 2, 1, 3, 4).reshape(n, c, h, w)


def _fused_conv_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    ho, wo = _conv_geometry(ins[:2], a)
    x, w = ins[0], ins[1]
    o = w.shape[0]
    out = _declared("mp.fused_conv2d", declared).elem
    if x.shape[1] % a["shuffle"]:
        raise OpError(f"mp.fused_conv2d's input channels {x.shape[1]} are not divisible by "
                      f"its shuffle groups {a['shuffle']}", operand=0)
    ints = [FORMATS[t.elem].is_int for t in (x, w)]
    if "scale" in a:
        if not all(t.elem in _EIGHT_BIT for t in (x, w)):
            raise OpError("mp.fused_conv2d with a 'scale' (dequantized integer sums) takes 8-bit "
                          "integer operands")
        if attr_array(a["scale"]).size not in (1, o):
            raise OpError("mp.fused_conv2d's 'scale' has one value or one per output channel")
    elif any(ints) or any(t.elem == "f64" for t in (x, w)):
        raise OpError("mp.fused_conv2d without a 'scale' takes float operands (not f64)")
    if len(ins) == 3 and (ins[2].elem != "f32" and ins[2].elem not in (x.elem, out)
                          or not per_channel(ins[2], o)):
        raise OpError(f"mp.fused_conv2d's bias {ins[2]} is not one value per output channel",
                      operand=2)
    quantized = "out_dtype" in a
    if quantized != ("out_scale" in a):
        raise OpError("mp.fused_conv2d quantizes its result with both 'out_scale' and "
                      "'out_dtype', or neither")
    if quantized:
        q = attr_type(a["out_dtype"])
        if q not in _EIGHT_BIT or out not in (q, "f32"):
            raise OpError(f"mp.fused_conv2d quantizes to an 8-bit integer format; its result is "
                          f"that format or f32 (dequantized back), got {q} and {out}")
        if attr_array(a["out_scale"]).size not in (1, o):
            raise OpError("mp.fused_conv2d's 'out_scale' has one value or one per channel")
    elif out not in PLAIN_FLOATS or ("scale" in a and out != "f32"):
        raise OpError(f"mp.fused_conv2d's result is f32 or a format it rounds to "
                      f"({', '.join(PLAIN_FLOATS)}; f32 with a 'scale'), got {out}")
    return [tensor((x.shape[0], o, ho, wo), out)]


def conv_attrs(a: dict) -> dict:
    """The mp.conv2d attributes among a fused conv's."""
    return {k: a[k] for k in ("strides", "padding", "dilations", "groups") if k in a}


def fused_conv_stages(xs: list, a: dict, rt: Sequence[TensorType] | None,
                      quantize: bool = True) -> np.ndarray:
    """The fused conv's result as its ops compute it one after the other; without `quantize`
    as the fp32 reference runs them, where a quantize and a dequantize are no-ops on floats."""
    x = xs[0] if a["shuffle"] == 1 else channel_shuffle(xs[0], a["shuffle"])
    y = apply_reference("mp.conv2d", [x, xs[1]], conv_attrs(a))
    if "scale" in a and y.dtype.kind in "iu":
        y = apply_reference("mp.dequantize", [y], {"scale": a["scale"], "zero_point": 0, "axis": 1},
                   [tensor(y.shape, "f32")])
    if len(xs) == 3:
        y = apply_reference("mp.add", [y, np.asarray(xs[2]).reshape(1, -1, 1, 1)])
    if a["relu"]:
        y = apply_reference("mp.relu", [y])
    if quantize and "out_dtype" in a:
        q = attr_type(a["out_dtype"])
        params = {"scale": a["out_scale"], "zero_point": a.get("out_zero_point", 0),
                  "axis": 1}
        y = apply_reference("mp.quantize", [y], params, [tensor(y.shape, q)])
        out = _declared("mp.fused_conv2d", rt or ()).elem
        if out == "f32":
            y = apply_reference("mp.dequantize", [y], params, [tensor(y.shape, "f32")])
    return y


def _fused_conv_flops(ins: Sequence[TensorType], a: dict) -> int:
    stages = ("scale" in a) + (len(ins) == 3) + bool(a["relu"]) + 2 * ("out_dtype" in a)
    ho, wo = _conv_geometry(ins[:2], a)
    return _conv_flops(ins[:2], a) + stages * ins[0].shape[0] * ins[1].shape[0] * ho * wo


_def("fused_conv2d",
     operands=("x", "w", "bias?"),
     attrs={**_WINDOW_ATTRS, "dilations": AttrSpec("ints", default=(1, 1), length=2, min=1),
            "groups": AttrSpec("int", default=1, min=1),
            "shuffle": AttrSpec("int", default=1, min=1),
            "scale": AttrSpec("number"), "relu": AttrSpec("bool", default=False),
            "out_scale": AttrSpec("number"), "out_zero_point": AttrSpec("number", default=0),
            "out_dtype": AttrSpec("type")},
     infer=_fused_conv_infer,
     reference=lambda xs, a, rt: [fused_conv_stages(xs, a, rt)],
     flops=_fused_conv_flops,
     precisions=_CONTRACTION,
     doc="Fused `mp.conv2d` (its input's channels first shuffled in `shuffle` groups, as "
         "ShuffleNet's reshape-transpose-reshape does), then with a `scale` the "
         "`mp.dequantize` of its exact 8-bit integer sums (zero point 0), the `mp.add` of "
         "`bias` (one value per output channel), `mp.relu` where `relu`, and the rounding to "
         "the result type, or with `out_dtype` an `mp.quantize` by `out_scale` and "
         "`out_zero_point` (per tensor or per channel), dequantized back when the result is "
         "f32.")


# ---- a binary op and the cast of its result -------------------------------------------------


def _fused_binary_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    shape = _binary_infer(frozenset(_FLOATS), "a float")(ins, a, declared)[0].shape
    out = _declared("mp.fused_binary", declared).elem
    formats = a["formats"]
    if len(formats) != 1 or any(e not in PLAIN_FLOATS for e in (*formats, out)):
        raise OpError(f"mp.fused_binary rounds to one format of 'formats', then to its result "
                      f"type, both among {', '.join(PLAIN_FLOATS)}")
    return [tensor(shape, out)]


def _fused_binary_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    # The op in float32; the rounding to `formats` and the cast's to the result type are the
    # result's (the backend's kernel rounds to both, the fp32 reference to neither).
    return [apply_reference(f"mp.{a['kind']}", xs)]


_def("fused_binary",
     operands=("a", "b"),
     attrs={"kind": AttrSpec("str", required=True, choices=BINARY_KINDS),
            "formats": AttrSpec("types", required=True)},
     infer=_fused_binary_infer,
     reference=_fused_binary_reference,
     flops=lambda ins, a: _elementwise_size(ins),
     precisions=_VECTOR,
     doc="Fused `mp.add`, `mp.sub` or `mp.mul` (`kind`) with its result rounded to its one "
         "entry of `formats`, then `mp.cast` to the result type.")
