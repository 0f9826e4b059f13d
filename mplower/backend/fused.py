"""Kernels of the `fuse` pass's conv and binary ops (mplower.dialect.fused_conv), and the
uncounted kernels `run_lowered` runs an op on where `run`'s counted one makes an extra pass.

Importing this module adds its entries to the op table (mplower.backend.kernels.KERNELS).
Every kernel gives the bits of the separate ops' kernels: a conv's epilogue runs as the
implicit GEMM stores each output (mplower.numerics.conv.conv2d), a binary op and its rounding
in one pass (mplower.numerics.elementwise.binary_rounded). A `Chosen.fast` kernel computes
the op it belongs to, the same bits without the counts that only `run` reports: it changes
no op of the program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mplower.backend.kernels import (
    KERNELS,
    Chosen,
    Kernel,
    OpToRun,
    conv_f16_chosen,
    f32,
    finish,
    generic_chosen,
    matmul_chosen,
    quantize_chosen,
    rounded_matmul_kernel,
)
from mplower.dialect.fused import PLAIN_FLOATS, RELU_BEFORE_ROUNDING, along_last_axis
from mplower.dialect.fused_conv import fused_conv_stages
from mplower.ir.opdef import attr_array, attr_type
from mplower.ir.types import TensorType
from mplower.numerics.formats import FORMATS
from mplower.numerics.rounding import ROUNDING_FORMATS, Counts


@dataclass(frozen=True)
class ConvEpilogue:
    """What a conv step's kernel computes, as numerics.conv.conv2d's arguments, so that
    run_lowered can rebuild it to write into a concatenation or to leave its result's amax in
    a box (mplower.backend.lowered). `bias_operand`: the bias is its third operand."""

    geometry: tuple
    bias_operand: bool
    channels: int
    scale: np.ndarray | None = None
    relu: bool = False
    rounded: str | None = None
    order: np.ndarray | None = None  # the input channels in the order the conv reads them
    requantize: tuple | None = None
    quantize: tuple | None = None

    @property
    def plain(self) -> bool:
        """Its result is the conv's (its epilogue's) values, neither quantized nor requantized."""
        return self.requantize is None and self.quantize is None

    def kernel(self, into: tuple | None = None, box: Any = None) -> Kernel:
        """The kernel. `into` = (channel0, shape, first): the result written into channels
        channel0.. of a concatenation of `shape`, which the `first` conv allocates and each
        other takes as its last operand; with a `box`, box.amax is set to the result's amax,
        which the conv kernels take as they store it."""
        from mplower.numerics.conv import conv2d

        spec = self

        def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
            x, w, target = xs[0], xs[1], None
            if into is not None:
                target = (np.empty(into[1], np.float32) if into[2] else xs[-1], into[0])
            bias = None
            if spec.bias_operand:
                bias = np.ascontiguousarray(np.broadcast_to(f32(xs[2]).reshape(-1),
                                                            (spec.channels,)))
            found = None if box is None else []
            common = {"bias": bias, "relu": spec.relu, "channels": spec.order, "into": target,
                      "amax": found, "requantize": spec.requantize, "quantize": spec.quantize}
            if spec.scale is None:
                y = conv2d(f32(x), f32(w), *spec.geometry, rounding=spec.rounded, **common)
            else:
                y = conv2d(x, w, *spec.geometry, scale=spec.scale, **common)
            if box is not None:
                box.amax = found[0]
            return y, None  # fused or uncounted: no counts
        if self.scale is not None:  # an integer conv: its constant weight can be an IntegerWeights
            run.integer_weights = True  # type: ignore[attr-defined]
        return run


def _geometry(a: dict) -> tuple:
    return a["strides"], a["padding"], a["dilations"], a["groups"]


def _float_operands(types: list[TensorType]) -> bool:
    return all(FORMATS[t.elem].is_float and t.elem != "f64" for t in types)


def _conv2d(o: OpToRun) -> Chosen | None:
    """A float conv with an f32 accumulator: its op's kernel (counted) for `run`, the conv
    rounding its result as it stores it for run_lowered."""
    if o.accum == "f16":
        return conv_f16_chosen(o)
    out = o.out_t.elem
    if not _float_operands(o.in_types) or out != "f32" and out not in ROUNDING_FORMATS:
        return None
    conv = ConvEpilogue(_geometry(o.attrs), len(o.in_types) == 3, o.out_t.shape[1],
                        rounded=None if out == "f32" else out)
    chosen = generic_chosen(o)
    chosen.conv = conv
    # A rounded result alone (ShuffleNet's second grouped 1x1 conv of a unit, its bias an
    # operand) is rounded as the conv stores its tiles, not in a pass after it.
    chosen.fast = conv.kernel() if out in RELU_BEFORE_ROUNDING else None
    return chosen


def _fused_conv2d(o: OpToRun) -> Chosen | None:
    a, out = o.attrs, o.out_t.elem
    channels = o.out_t.shape[1]
    x_t = o.in_types[0]
    order = None
    if a["shuffle"] > 1:  # input channel c of the conv is channel order[c] of its operand
        c, g = np.arange(x_t.shape[1]), a["shuffle"]
        order = (c % g) * (x_t.shape[1] // g) + c // g
    depthwise = a["groups"] == x_t.shape[1] and o.in_types[1].shape[1] == 1
    scale = requantize = quantize = None
    if "scale" in a:
        scale = np.ascontiguousarray(np.broadcast_to(
            attr_array(a["scale"]).astype(np.float32).reshape(-1), (channels,)))
    if "out_dtype" in a:
        q_scale, zp = attr_array(a["out_scale"]), attr_array(a["out_zero_point"])
        q = attr_type(a["out_dtype"])
        if out == "f32" and depthwise:
            requantize = (np.broadcast_to(q_scale.astype(np.float32).reshape(-1), (channels,)),
                          np.broadcast_to(zp.reshape(-1), (channels,)), q)
        elif out == q and q_scale.size == 1 and zp.size == 1:
            quantize = q_scale.astype(np.float32).reshape(()), zp.reshape(()), q
        else:
            return _fused_conv_reference(o, generic_chosen(o))
    if order is not None and not depthwise:
        return _fused_conv_reference(o, generic_chosen(o))  # numerics.conv reorders depthwise only
    conv = ConvEpilogue(_geometry(a), len(o.in_types) == 3, channels, scale, bool(a["relu"]),
                        out if out != "f32" and "out_dtype" not in a else None, order,
                        requantize, quantize)
    chosen = _fused_conv_reference(o, Chosen(conv.kernel()))
    chosen.conv = conv
    return chosen


def _fused_conv_reference(o: OpToRun, chosen: Chosen) -> Chosen:
    """The fused conv in the fp32 reference: its ops' references, where a quantize and a
    dequantize of a float are no-ops and an integer operand that never was a float (an i8
    constant beside a float input) has no fp32 value, as for its conv alone."""
    attrs, rt = o.attrs, [t.with_elem("f32") if FORMATS[t.elem].is_float else t
                          for t in o.out_types]

    def reference(xs: list[np.ndarray]) -> np.ndarray | None:
        xs = [f32(x) if x.dtype.kind == "f" and x.dtype != np.float64 else x for x in xs]
        if "scale" in attrs and len({x.dtype.kind == "f" for x in xs[:2]}) == 2:
            return None
        return fused_conv_stages(xs, attrs, rt, quantize=False)
    chosen.reference = reference
    return chosen


# ---- add, sub, mul and their rounding -------------------------------------------------------


def binary_kernel(kind: str, in_types: list[TensorType], out_t: TensorType,
                  formats: tuple[str, ...]) -> Kernel | None:
    """np.add, np.subtract or np.multiply (`kind`) of two float operands, rounded to each of
    `formats` in turn, in one pass (binary_rounded: the bits of the op then of each rounding),
    where one operand has the result's shape and the other too or is a vector along the last
    axis; else None."""
    shape = out_t.shape
    if not all(t.elem in PLAIN_FLOATS for t in (*in_types, out_t)) \
            or any(f not in PLAIN_FLOATS for f in formats):
        return None
    full = [t.shape == shape or not shape for t in in_types]
    if not any(full) or not all(f or along_last_axis(t, shape)
                                for f, t in zip(full, in_types, strict=True)):
        return None
    from mplower.numerics.elementwise import binary_rounded

    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        return binary_rounded(kind, f32(xs[0]), f32(xs[1]), formats), None  # uncounted
    return run


def _fused_binary(o: OpToRun) -> Chosen:
    kind, inner, out = o.attrs["kind"], attr_type(o.attrs["formats"][0]), o.out_t.elem
    run = binary_kernel(kind, o.in_types, o.out_t, (inner, out))
    if run is None:  # general broadcasting: the op, then each rounding, one after the other
        op = {"add": np.add, "sub": np.subtract, "mul": np.multiply}[kind]

        def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
            y = finish(op(f32(xs[0]), f32(xs[1])), inner)[0]
            return finish(y, out)[0], None
    return Chosen(run)


def _binary(o: OpToRun) -> Chosen:
    """mp.add, mp.sub, mp.mul: the op's kernel, and for run_lowered the one-pass rounding."""
    chosen = generic_chosen(o)
    if o.out_t.elem != "f32":
        chosen.fast = binary_kernel(o.opdef.name[3:], o.in_types, o.out_t, (o.out_t.elem,))
    return chosen


def _fake_quant(o: OpToRun) -> Chosen:
    """mp.fake_quant: quantize then dequantize (counted); for run_lowered one pass that never
    stores the integers (quant.fake_quantizer: the same float32 bits)."""
    from mplower.numerics.quant import fake_quantizer

    chosen = quantize_chosen(o)
    a = o.attrs
    scale, zp = attr_array(a["scale"]), attr_array(a["zero_point"])
    if o.out_t.elem == "f32" and o.in_types[0].elem == "f32" and not a["block_size"]:
        one = fake_quantizer(o.in_types[0].shape, scale.astype(np.float32), zp,
                             attr_type(a["dtype"]), a["axis"] if scale.size > 1 else None)
        if one is not None:
            chosen.fast = lambda xs: (one(f32(xs[0])), None)
    return chosen


def _matmul(o: OpToRun) -> Chosen:
    """mp.matmul; for run_lowered a float product rounded in place (round_to's bits)."""
    chosen = matmul_chosen(o)
    if len(o.in_types) == 2 and o.out_t.elem != "f32" \
            and getattr(chosen.run, "weight_dtype", None) == np.float32 \
            and all(t.elem in PLAIN_FLOATS for t in (*o.in_types, o.out_t)):
        chosen.fast = rounded_matmul_kernel(o.out_t.elem, [])
    return chosen


KERNELS.update({
    "mp.conv2d": _conv2d,
    "mp.fused_conv2d": _fused_conv2d,
    "mp.fused_binary": _fused_binary,
    "mp.add": _binary,
    "mp.sub": _binary,
    "mp.mul": _binary,
    "mp.fake_quant": _fake_quant,
    "mp.matmul": _matmul,
})
