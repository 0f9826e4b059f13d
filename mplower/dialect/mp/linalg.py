"""mp.constant and the contractions, mp.matmul and mp.conv2d."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mplower.dialect.mp.common import (
    _ANY,
    _CONTRACTION,
    _GEMM,
    _WINDOW_ATTRS,
    _broadcast,
    _contraction_elem,
    _declared,
    _def,
    _need_rank,
    _no_flops,
    _no_rule,
    _num,
    _prod,
    _sum_to,
    _window_out,
)
from mplower.ir.opdef import AttrSpec, GradBuilder, OpError, Trait, Value, show_value
from mplower.ir.types import TensorType, tensor

# ---------------------------------------------------------------------------------------------
# constant


def _constant_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    if ("name" in a) == ("value" in a):
        raise OpError("mp.constant needs exactly one of 'name' (a key of the weights file) or "
                      "'value' (dense elements)")
    t = _declared("mp.constant", declared)
    if "value" in a and a["value"].type.shape != t.shape:
        raise OpError(f"constant value has type {a['value'].type}, which does not have the "
                      f"shape of the result type {t}")
    return [t]


def _constant_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    if "value" not in a:
        raise OpError(f"mp.constant {{name = {show_value(a['name'])}}} is loaded from the weights file "
                      "by the executor; it has no reference value of its own")
    return [a["value"].array]


_def("constant",
     operands=(),
     attrs={"name": AttrSpec("str"), "value": AttrSpec("dense")},
     infer=_constant_infer,
     reference=_constant_reference,
     flops=_no_flops,
     precisions=_ANY,
     doc="A tensor from the weights file (`name`) or inline (`value`); its type is the result type.",
     traits=frozenset({Trait.TYPE_CARRYING}))


# ---------------------------------------------------------------------------------------------
# matmul and conv2d


def _matmul_shape(a: TensorType, b: TensorType) -> tuple[int, ...]:
    for i, t in enumerate((a, b)):
        if t.rank == 0:
            raise OpError(f"matmul operands must have rank >= 1, got {t}", operand=i)
    if b.encoding is not None and b.rank != 2:
        raise OpError(f"a sparse matmul operand must be 2-D, got {b}", operand=1)
    # np.matmul: a 1-D a is a row vector, a 1-D b a column vector; the added dim is dropped.
    sa = a.shape if a.rank >= 2 else (1,) + a.shape
    sb = b.shape if b.rank >= 2 else b.shape + (1,)
    if sa[-1] != sb[-2]:
        raise OpError(f"matmul contraction mismatch: {sa[-1]} vs {sb[-2]} ({a} @ {b})", operand=1)
    batch = _broadcast(sa[:-2], sb[:-2])
    if batch is None:
        raise OpError(f"matmul batch dimensions are not broadcast-compatible: {a} @ {b}",
                      operand=1)
    return batch + sa[-2:-1] * (a.rank >= 2) + sb[-1:] * (b.rank >= 2)


def _matmul_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    shape = _matmul_shape(ins[0], ins[1])
    return [tensor(shape, _contraction_elem("mp.matmul", ins[0], ins[1], declared))]


def _matmul_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    # mplower's own summation order, not BLAS's (mplower.numerics.gemm); imported here so
    # that parsing and verifying, which need this table but no numbers, do not load numba.
    from mplower.numerics.gemm import matmul

    return [matmul(_num(xs[0]), _num(xs[1]))]


def _matmul_flops(ins: Sequence[TensorType], a: dict) -> int:
    # One multiply and one add per (output element, contraction index).
    return 2 * _prod(_matmul_shape(ins[0], ins[1])) * ins[0].shape[-1]


def _swap_last(g: GradBuilder, v: Value) -> Value:
    r = g.type_of(v).rank
    return g.emit("mp.transpose", [v], {"perm": tuple(range(r - 2)) + (r - 1, r - 2)})


def _matmul_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
                needs: Sequence[bool]) -> list[Value | None]:
    ta, tb = g.type_of(xs[0]), g.type_of(xs[1])
    if ta.rank < 2 or tb.rank < 2:
        raise _no_rule("mp.matmul", "1-D operands (reshape them to 2-D)")
    da = db = None
    if needs[0]:  # dA = dY @ B^T, summed over the batch dims A was broadcast along
        da = _sum_to(g, g.emit("mp.matmul", [dy, _swap_last(g, xs[1])]), ta.shape)
    if needs[1]:  # dB = A^T @ dY
        db = _sum_to(g, g.emit("mp.matmul", [_swap_last(g, xs[0]), dy]), tb.shape)
    return [da, db]

_def("matmul",
     vjp=_matmul_vjp,
     operands=("a", "b"),
     attrs={},
     infer=_matmul_infer,
     reference=_matmul_reference,
     flops=_matmul_flops,
     precisions=_CONTRACTION,
     doc="Matrix product with numpy broadcasting over batch dimensions (np.matmul, ONNX MatMul).",
     traits=_GEMM,
     weight_operand=1,
     encoded_operands=frozenset({1}))


def _conv_geometry(ins: Sequence[TensorType], a: dict) -> tuple[int, int]:
    """(Hout, Wout) of a conv2d, after checking channels, groups and bias."""
    x, w = ins[0], ins[1]
    _need_rank(x, 4, 0, "NCHW")
    _need_rank(w, 4, 1, "OIHW")
    (_, c, h, wd), (o, cg, kh, kw) = x.shape, w.shape
    g = a["groups"]
    if c % g:
        raise OpError(f"conv2d input channels {c} are not divisible by groups {g}", operand=0)
    if cg * g != c:
        raise OpError(f"conv2d channel mismatch: input {x} has {c} channels but weight {w} "
                      f"expects {cg} x {g} group(s) = {cg * g}", operand=1)
    if o % g:
        raise OpError(f"conv2d output channels {o} are not divisible by groups {g}", operand=1)
    if len(ins) == 3 and ins[2].shape != (o,):
        raise OpError(f"conv2d bias must have shape ({o},), got {ins[2]}", operand=2)
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = a["strides"], a["padding"], a["dilations"]
    eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    if eh > h + pt + pb or ew > wd + pl + pr:
        raise OpError(f"conv2d kernel (dilated {eh}x{ew}) is larger than the padded input "
                      f"{h + pt + pb}x{wd + pl + pr}", operand=1)
    return _window_out(h, pt + pb, eh, sh), _window_out(wd, pl + pr, ew, sw)


def _conv_infer(ins: tuple, a: dict, declared: tuple) -> list[TensorType]:
    ho, wo = _conv_geometry(ins, a)
    x, w = ins[0], ins[1]
    elem = _contraction_elem("mp.conv2d", x, w, declared)
    if len(ins) == 3 and ins[2].elem not in (x.elem, elem):
        raise OpError(f"conv2d bias element type must be {x.elem} or {elem}, got {ins[2]}",
                      operand=2)
    return [tensor((x.shape[0], w.shape[0], ho, wo), elem)]


def _conv_reference(xs: list, a: dict, rt: tuple | None) -> list[np.ndarray]:
    # im2col on mplower's fixed-order GEMM (see _matmul_reference); integers exactly, without
    # widening them to int64 first (mplower.numerics.conv).
    from mplower.numerics.conv import conv2d

    integer = xs[0].dtype.kind in "iub" and xs[1].dtype.kind in "iub"
    x, w = (xs[0], xs[1]) if integer else (_num(xs[0]), _num(xs[1]))
    bias = _num(xs[2]) if len(xs) == 3 else None
    geometry = (a["strides"], a["padding"], a["dilations"], a["groups"])
    if not integer:  # the bias added as the GEMM stores each output: the same float sums
        return [conv2d(x, w, *geometry, bias=bias)]
    y = conv2d(x, w, *geometry)
    return [y if bias is None else y + bias.reshape(1, -1, 1, 1)]


def _conv_flops(ins: Sequence[TensorType], a: dict) -> int:
    # 2 * N * Cout * Hout * Wout * (Cin / groups) * KH * KW; the bias adds (one per output,
    # under 1/(2 * Cin/groups * KH * KW) of the total) are left out, as fvcore and ptflops do.
    ho, wo = _conv_geometry(ins, a)
    n, (o, cg, kh, kw) = ins[0].shape[0], ins[1].shape
    return 2 * n * o * ho * wo * cg * kh * kw


def _conv_vjp(g: GradBuilder, xs: Sequence[Value], y: Value, dy: Value, a: dict,
              needs: Sequence[bool]) -> list[Value | None]:
    """Both gradients as forward convolutions (so a policy lowers them as it lowers conv2d):
    the input's is the correlation of the zero-stuffed dY with the flipped, channel-swapped
    weight; the weight's the correlation of x with dY, batch and channels swapped, strides and
    dilations exchanged. Grouped convolutions: the same per group, on channel slices, joined."""
    groups = a["groups"]
    if groups == 1:
        dx, dw = _conv_group_vjp(g, xs[0], xs[1], dy, a, needs[0], needs[1])
    else:
        cg, og = g.type_of(xs[1]).shape[1], g.type_of(xs[1]).shape[0] // groups
        parts = [_conv_group_vjp(g, _channels(g, xs[0], 1, i * cg, cg),
                                 _channels(g, xs[1], 0, i * og, og),
                                 _channels(g, dy, 1, i * og, og), a, needs[0], needs[1])
                 for i in range(groups)]
        dx = g.emit("mp.concat", [p[0] for p in parts], {"axis": 1}) if needs[0] else None
        dw = g.emit("mp.concat", [p[1] for p in parts], {"axis": 0}) if needs[1] else None
    out: list[Value | None] = [dx, dw]
    if len(xs) == 3:
        out.append(g.emit("mp.reduce_sum", [dy], {"axes": (0, 2, 3), "keepdims": False})
                   if needs[2] else None)
    return out


def _channels(g: GradBuilder, v: Value, axis: int, start: int, size: int) -> Value:
    shape = g.type_of(v).shape
    return g.emit("mp.slice", [v], {"starts": tuple(start if i == axis else 0
                                                    for i in range(len(shape))),
                                    "ends": tuple(start + size if i == axis else d
                                                  for i, d in enumerate(shape))})


def _conv_group_vjp(g: GradBuilder, x: Value, wv: Value, dy: Value, a: dict, need_x: bool,
                    need_w: bool) -> tuple[Value | None, Value | None]:
    """(dx, dw) of one group of a conv2d (see `_conv_vjp`)."""
    tx, tw, tdy = g.type_of(x), g.type_of(wv), g.type_of(dy)
    (n, c, h, w), (o, _, kh, kw), (ho, wo) = tx.shape, tw.shape, tdy.shape[2:]
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = a["strides"], a["dilations"], a["padding"]
    eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    dx = dwt = None
    swap = {"perm": (1, 0, 2, 3)}
    if need_x:
        rem_h, rem_w = (h + pt + pb - eh) % sh, (w + pl + pr - ew) % sw
        pads = (eh - 1 - pt, ew - 1 - pl, eh - 1 - pb + rem_h, ew - 1 - pr + rem_w)
        if min(pads) < 0:
            raise _no_rule("mp.conv2d", "padding at least as large as the kernel")
        big = -(2 ** 31)  # ONNX Slice's "to the start" for a negative step
        flipped = g.emit("mp.slice", [wv], {"starts": (0, 0, kh - 1, kw - 1),
                                                "ends": (o, c, big, big), "steps": (1, 1, -1, -1)})
        wt = g.emit("mp.transpose", [flipped], swap)
        spread = dy
        if (sh, sw) != (1, 1):  # put stride - 1 zeros between the rows and columns of dY
            e = tdy.elem
            spread = g.emit("mp.reshape", [dy], result=tensor((n, o, ho, 1, wo, 1), e))
            if sh > 1:
                spread = g.emit("mp.concat", [spread, g.splat(0.0, (n, o, ho, sh - 1, wo, 1), e)],
                                {"axis": 3})
            if sw > 1:
                spread = g.emit("mp.concat", [spread, g.splat(0.0, (n, o, ho, sh, wo, sw - 1), e)],
                                {"axis": 5})
            spread = g.emit("mp.reshape", [spread], result=tensor((n, o, ho * sh, wo * sw), e))
            spread = g.emit("mp.slice", [spread], {"starts": (0, 0, 0, 0), "ends": (
                n, o, (ho - 1) * sh + 1, (wo - 1) * sw + 1)})
        dx = g.emit("mp.conv2d", [spread, wt], {"padding": pads, "dilations": (dh, dw)})
    if need_w:
        full = g.emit("mp.conv2d", [g.emit("mp.transpose", [x], swap),
                                    g.emit("mp.transpose", [dy], swap)],
                      {"strides": (dh, dw), "dilations": (sh, sw), "padding": (pt, pl, pb, pr)})
        if g.type_of(full).shape[2:] != (kh, kw):  # rows the strides never reached
            full = g.emit("mp.slice", [full], {"starts": (0, 0, 0, 0), "ends": (c, o, kh, kw)})
        dwt = g.emit("mp.transpose", [full], swap)
    return dx, dwt


_def("conv2d",
     vjp=_conv_vjp,
     operands=("x", "w", "bias?"),
     attrs={**_WINDOW_ATTRS, "dilations": AttrSpec("ints", default=(1, 1), length=2, min=1),
            "groups": AttrSpec("int", default=1, min=1)},
     infer=_conv_infer,
     reference=_conv_reference,
     flops=_conv_flops,
     precisions=_CONTRACTION,
     doc="2-D convolution, NCHW input, OIHW weight, optional bias (ONNX Conv with group).",
     traits=_GEMM,
     weight_operand=1)
