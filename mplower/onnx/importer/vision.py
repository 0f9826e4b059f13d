"""ONNX import handlers for vision models: ConvTranspose, Resize/Upsample, InstanceNormalization
and GroupNormalization, each lowered exactly to mp ops the precision passes already know.

* ConvTranspose is split by output phase (position modulo the stride): the outputs of one
  phase are a forward convolution of the input with the kernel taps that reach them, flipped,
  channel axes swapped per group (sub-pixel convolution). Each is an mp.conv2d, so its products
  get a precision (and a cost) like any convolution, and the phases together multiply exactly
  the products of the transposed convolution, none with the zeros a stuffed input would hold;
  reshapes and concats interleave the phases.
* Resize is separable: each resized axis is a gather of the n taps of every output position
  and a weighted sum of them (n = 1 for nearest, 2 for linear, 4 for cubic), the weights being
  constants computed here from ONNX's coordinate transformation (antialias widens the window
  when shrinking); axes whose output is their input are left alone. Nearest is therefore pure
  data movement (exact in any format). Coordinates are computed as onnxruntime computes them.
* InstanceNormalization and GroupNormalization are mp.layer_norm over the normalized block (of
  a (N, groups, rest) view for groups), then the per-channel scale and bias.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.types import tensor
from mplower.numerics.formats import FORMATS
from mplower.onnx.importer.core import (
    Const,
    Run,
    _attrs,
    _from_2d,
    _Importer,
    _reshape_to,
    _same_onnx,
    _shape_of,
    _to_2d,
    handler,
    onnx_type_name,
)


def _np_dtype(r: Run) -> np.dtype:
    return helper.tensor_dtype_to_np_dtype(r.onnx_type)


def _need_float(imp: _Importer, x: Run, what: str) -> None:
    if not FORMATS[x.type.elem].is_float:
        raise imp.error(f"{what} of a {onnx_type_name(x.onnx_type)} tensor: mplower lowers it "
                        f"for float tensors only")


# ---- ConvTranspose ---------------------------------------------------------------------------


def _transpose_pads(imp: _Importer, a: dict, spatial: Sequence[int], ek: Sequence[int],
                    strides: Sequence[int], out_pad: Sequence[int]) -> tuple[list[int], list[int]]:
    """(begin pads, output sizes) of a ConvTranspose: the output is the full transposed
    convolution (stride * (in - 1) + dilated kernel + output_padding) with `begin` elements cut
    at the start, cut or zero-extended at the end to the size. With output_shape (whose pads are
    ignored) or SAME auto_pad (whose target is in * stride) the total cut is full - target, at
    least 0, split as the operator's text and onnxruntime split it: SAME_UPPER cuts the smaller
    half at the start, NOTSET and SAME_LOWER the larger. Without output_shape a SAME output is
    never larger than the full one (onnxruntime and ONNX's shape inference agree)."""
    r = len(spatial)
    full = [strides[k] * (spatial[k] - 1) + ek[k] + out_pad[k] for k in range(r)]
    auto = a.get("auto_pad", "NOTSET")
    if auto not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise imp.error(f"auto_pad '{auto}' is not an ONNX value")
    shape = a.get("output_shape")
    if shape is not None:
        shape = list(shape)[-r:]  # some exporters write the (N, C, ...) shape
        if len(shape) != r:
            raise imp.error(f"output_shape {list(a['output_shape'])} does not give the "
                            f"{r} spatial sizes")
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        shape = [spatial[k] * strides[k] for k in range(r)]
    if shape is not None:
        totals = [max(full[k] - shape[k], 0) for k in range(r)]
        begin = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in totals]
        if a.get("output_shape") is None:
            shape = [full[k] - totals[k] for k in range(r)]
        return begin, list(shape)
    pads = [0] * (2 * r) if auto == "VALID" else list(a.get("pads", [0] * (2 * r)))
    if len(pads) != 2 * r:
        raise imp.error(f"pads {pads} must give a begin and an end for each of the {r} spatial "
                        f"axes")
    return pads[:r], [full[k] - pads[k] - pads[k + r] for k in range(r)]


def _transposed_weight(imp: _Importer, w: Const | Run, groups: int) -> Const | Run:
    """ConvTranspose's (C, M/g, k...) weight with its channel axes swapped per group: the
    (M, C/g, k...) weight of a convolution (kernels not yet flipped)."""
    c, mg, *ks = _shape_of(w)
    if c % groups:
        raise imp.error(f"weight {list(_shape_of(w))}: its {c} input channels are not "
                        f"divisible by group {groups}")
    cg = c // groups
    if isinstance(w, Const):
        return Const(np.ascontiguousarray(
            w.array.reshape(groups, cg, mg, *ks).swapaxes(1, 2).reshape(groups * mg, cg, *ks)))
    v = _reshape_to(imp, w, (groups, cg, mg, *ks))
    v = imp.emit("mp.transpose", [v], {"perm": (0, 2, 1, *range(3, 3 + len(ks)))},
                 onnx_type=w.onnx_type)
    return _reshape_to(imp, v, (groups * mg, cg, *ks))


def _phase(kernel: int, stride: int, dilation: int, phase: int) -> tuple[int, int, int, int]:
    """The kernel taps k that reach full positions f = stride * q + phase (those with
    k * dilation = phase mod stride): (first tap, tap spacing, tap count, input offset of the
    first tap); the output at q reads input q - offset - j * (spacing * dilation / stride)."""
    first = next((k for k in range(kernel) if (k * dilation - phase) % stride == 0), None)
    if first is None:
        return 0, 1, 0, 0
    spacing = stride // math.gcd(stride, dilation)
    return first, spacing, (kernel - 1 - first) // spacing + 1, (first * dilation - phase) // stride


def _phase_weight(imp: _Importer, wt: Const | Run, taps: Sequence[tuple[int, int, int]],
                  name: str) -> Run:
    """The taps (first, spacing, count) of each spatial axis of `wt`, in reverse order: the
    kernel of the forward correlation that computes one output phase."""
    if isinstance(wt, Const):
        picked = wt.array[(..., *(slice(f + (c - 1) * s, None if f == 0 else f - 1, -s)
                                  for f, s, c in taps))]
        return imp.constant(np.ascontiguousarray(picked), f"{name}_phase")
    big = -(2 ** 31)  # ONNX Slice's "to the start" for a negative step
    m, cg = wt.type.shape[:2]
    return imp.emit("mp.slice", [wt], {
        "starts": (0, 0, *(f + (c - 1) * s for f, s, c in taps)),
        "ends": (m, cg, *(f - 1 if f else big for f, s, c in taps)),
        "steps": (1, 1, *(-s for f, s, c in taps))}, hint=f"{name}_phase", onnx_type=wt.onnx_type)


def _zero_border(imp: _Importer, x: Run, before: Sequence[int], after: Sequence[int]) -> Run:
    """(N, C, H, W) with zero rows and columns joined before and after its spatial axes."""
    for k in range(2):
        if before[k] == after[k] == 0:
            continue
        shape = x.type.shape
        parts = [x]
        for count, at in ((before[k], 0), (after[k], 1)):
            if count:
                zeros = imp.constant(np.zeros(shape[:2 + k] + (count,) + shape[3 + k:],
                                              _np_dtype(x)), "zeros")
                parts.insert(at * len(parts), zeros)
        x = imp.emit("mp.concat", parts, {"axis": 2 + k}, onnx_type=x.onnx_type)
    return x


def _sub_pixel(imp: _Importer, x: Run, wt: Const | Run, geometry: dict, bias: Run | None,
               name: str) -> Run:
    """ConvTranspose (2-D) as one forward convolution per output phase (position mod stride),
    each with the kernel taps that reach that phase, interleaved: the scatter form's products
    and no others, so FLOPs and memory are those of the transposed convolution itself."""
    (n, _, *spatial), m = x.type.shape, _shape_of(wt)[0]
    kernel = _shape_of(wt)[2:]
    strides, dilations, begin, sizes = (geometry[k] for k in ("strides", "dilations", "begin",
                                                              "sizes"))
    groups, e, dt = geometry["groups"], x.type.elem, _np_dtype(x)
    # Output o is full position f = o + begin = stride * q + phase; every phase is computed for
    # the same q0 <= q < q0 + span, which covers f in [begin, begin + size).
    q0 = [begin[k] // strides[k] for k in range(2)]
    span = [-(-(begin[k] + sizes[k]) // strides[k]) - q0[k] for k in range(2)]
    single = strides == [1, 1]
    rows = []
    for ph in range(strides[0]):
        row = []
        for pw in range(strides[1]):
            taps = [_phase(kernel[k], strides[k], dilations[k], (ph, pw)[k]) for k in range(2)]
            if not taps[0][2] or not taps[1][2]:  # no tap reaches this phase: zeros
                row.append(imp.constant(np.zeros((n, m, *span), dt), "zeros"))
                continue
            sub = _phase_weight(imp, wt, [t[:3] for t in taps], name)
            step = [taps[k][1] * dilations[k] // strides[k] for k in range(2)]
            lo = [taps[k][3] + (taps[k][2] - 1) * step[k] - q0[k] for k in range(2)]
            hi = [span[k] - spatial[k] - lo[k] + (taps[k][2] - 1) * step[k] for k in range(2)]
            # Padding the size of the kernel or more, which mp.conv2d's gradient rule does not
            # take, is zeros joined to the input instead.
            extent = [(taps[k][2] - 1) * step[k] + 1 for k in range(2)]
            inner = [[min(max(p[k], 0), extent[k] - 1) for k in range(2)] for p in (lo, hi)]
            xp = _zero_border(imp, x, [max(lo[k], 0) - inner[0][k] for k in range(2)],
                              [max(hi[k], 0) - inner[1][k] for k in range(2)])
            operands = [xp, sub] + ([bias] if single and bias is not None else [])
            y = imp.emit("mp.conv2d", operands, {
                "padding": (inner[0][0], inner[0][1], inner[1][0], inner[1][1]),
                "dilations": tuple(step), "groups": groups}, onnx_type=x.onnx_type,
                hint=name if single and min(lo + hi) >= 0 else f"{name}_phase")
            if min(lo + hi) < 0:  # a pad past the kernel cuts the input instead
                starts = (0, 0, max(-lo[0], 0), max(-lo[1], 0))
                y = imp.emit("mp.slice", [y], {"starts": starts, "ends": (
                    n, m, starts[2] + span[0], starts[3] + span[1])}, onnx_type=x.onnx_type)
            row.append(y)
        rows.append(row)
    if single:
        y = rows[0][0]
    else:
        parts = []
        for row in rows:
            cells = [imp.emit("mp.reshape", [v], declared=tensor((n, m, span[0], 1, span[1], 1),
                                                                  e), onnx_type=x.onnx_type)
                     for v in row]
            parts.append(imp.emit("mp.concat", cells, {"axis": 5}, onnx_type=x.onnx_type)
                         if len(cells) > 1 else cells[0])
        y = imp.emit("mp.concat", parts, {"axis": 3}, onnx_type=x.onnx_type) \
            if len(parts) > 1 else parts[0]
        y = imp.emit("mp.reshape", [y], declared=tensor(
            (n, m, span[0] * strides[0], span[1] * strides[1]), e), onnx_type=x.onnx_type)
    starts = [begin[k] - strides[k] * q0[k] for k in range(2)]
    if y.type.shape[2:] != tuple(sizes):
        y = imp.emit("mp.slice", [y], {"starts": (0, 0, *starts), "ends": (
            n, m, starts[0] + sizes[0], starts[1] + sizes[1])}, onnx_type=x.onnx_type)
    if bias is not None and not single:
        y = imp.emit("mp.add", [y, _reshape_to(imp, bias, (m, 1, 1))], onnx_type=x.onnx_type)
    return y


@handler("ConvTranspose")
def _conv_transpose(imp: _Importer, node: onnx.NodeProto) -> list:
    x, w = imp.run_input(0), imp.need_tensor(1)
    _need_float(imp, x, "ConvTranspose")
    rank = x.type.rank
    if rank not in (3, 4):
        raise imp.error(f"{rank - 2}-D ConvTranspose: mplower lowers 1-D and 2-D ones (to "
                        f"mp.conv2d) only")
    a = _attrs(node)
    groups = int(a.get("group", 1))
    wshape = _shape_of(w)
    r = rank - 2
    if len(wshape) != rank:
        raise imp.error(f"weight {list(wshape)} must have rank {rank}, as the input does")
    kernel = list(a.get("kernel_shape", wshape[2:]))
    if kernel != list(wshape[2:]):
        raise imp.error(f"kernel_shape {kernel} differs from the weight's {list(wshape[2:])}")
    if x.type.shape[1] != wshape[0]:
        raise imp.error(f"input {x.type} has {x.type.shape[1]} channels but the weight "
                        f"{list(wshape)} expects {wshape[0]}")
    strides = list(a.get("strides", [1] * r))
    dilations = list(a.get("dilations", [1] * r))
    out_pad = list(a.get("output_padding", [0] * r))
    if not len(strides) == len(dilations) == len(out_pad) == r:
        raise imp.error("strides, dilations and output_padding must give one value per spatial "
                        "axis")
    if min(strides + dilations) < 1 or min(out_pad) < 0:
        raise imp.error("strides and dilations must be >= 1 and output_padding >= 0")
    spatial = list(x.type.shape[2:])
    ek = [(kernel[k] - 1) * dilations[k] + 1 for k in range(r)]
    begin, sizes = _transpose_pads(imp, a, spatial, ek, strides, out_pad)
    if min(sizes) < 1:
        raise imp.error(f"the output would have spatial size {sizes}")
    wt = _transposed_weight(imp, w, groups)
    if r == 1:  # as 2-D with height 1
        x = _to_2d(imp, x, f"{node.input[0]}_2d")
        wt = Const(wt.array[:, :, None, :]) if isinstance(wt, Const) else _reshape_to(
            imp, wt, (wt.type.shape[0], wt.type.shape[1], 1, kernel[0]))
        strides, dilations = [1] + strides, [1] + dilations
        begin, sizes = [0] + begin, [1] + sizes
    bias = imp.run_input(2) if imp.input(2) is not None else None
    for o in ([wt] if isinstance(wt, Run) else []) + ([bias] if bias is not None else []):
        _same_onnx(imp, x, o)
    if isinstance(wt, Const) and wt.array.dtype != _np_dtype(x):
        raise imp.error(f"weight element type {wt.array.dtype} differs from the input's "
                        f"{onnx_type_name(x.onnx_type)}")
    geometry = {"strides": strides, "dilations": dilations, "begin": begin, "sizes": sizes,
                "groups": groups}
    y = _sub_pixel(imp, x, wt, geometry, bias, node.output[0] if r == 2 else f"{node.output[0]}_2d")
    return [_from_2d(imp, y) if r == 1 else y]


# ---- Resize and Upsample -----------------------------------------------------------------------


def _source_coords(mode: str, out: int, size: int, scale: float,
                   roi: tuple[float, float] | None) -> np.ndarray:
    """Where each output position along an axis samples the input (ONNX Resize's
    coordinate_transformation_mode). Computed as onnxruntime computes it, in float32 and in its
    order of operations, so that a coordinate on a rounding tie or a whole number lands where
    it does there; `scale` is the float32 scale factor (given, or out / size for sizes).
    Lengths are the integer sizes, as the operator's text says (ONNX's reference divides
    align_corners and tf_crop_and_resize by scale * size instead)."""
    f = np.float32
    y = np.arange(out, dtype=f)
    s, n_in, n_out = f(scale), f(size), f(out)
    half = f(0.5)
    if mode in ("half_pixel", "pytorch_half_pixel"):
        if mode == "pytorch_half_pixel" and out <= 1:
            return np.zeros(out, f)
        return (y + half) / s - half
    if mode == "tf_half_pixel_for_nn":  # Resize-11 only
        return (y + half) / s
    if mode == "half_pixel_symmetric":  # the offset in float32, the rest in float64
        offset = n_in / f(2) * (f(1) - n_out / (s * n_in))
        return (np.float64(offset) + (y.astype(np.float64) + 0.5) / np.float64(s) - 0.5).astype(f)
    if mode == "align_corners":
        return np.zeros(out, f) if out == 1 else y * (n_in - f(1)) / (n_out - f(1))
    if mode == "asymmetric":
        return y / s
    assert mode == "tf_crop_and_resize" and roi is not None
    start, end = f(roi[0]), f(roi[1])
    if out == 1:
        return np.full(out, half * (start + end) * (n_in - f(1)), f)
    return start * (n_in - f(1)) + y * (end - start) * (n_in - f(1)) / (n_out - f(1))


def _nearest_index(x: np.ndarray, mode: str, scale: float) -> np.ndarray:
    whole = np.floor(x)
    frac = x - whole
    if mode == "round_prefer_floor":
        pick = whole + (frac > 0.5)
    elif mode == "round_prefer_ceil":
        pick = whole + (frac >= 0.5)
    elif mode == "floor":
        pick = whole
    elif mode == "ceil":
        pick = np.ceil(x)
    else:  # "simple", Resize-10 and Upsample as onnxruntime runs them: ceil when shrinking
        pick = np.ceil(x) if scale < 1 else whole
    return pick.astype(np.int64)


def _cubic(d: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel with coefficient `a` at distance |d| <= 2."""
    d = np.abs(d)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def _taps(x: np.ndarray, opts: dict, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(indices, weights), each (out, n), of the input positions that linear or cubic
    interpolation reads at source coordinates `x`: 2 resp. 4 taps, or with antialias, when
    shrinking, the kernel stretched by 1 / scale over more taps and its weights normalized to
    sum to 1. As ONNX places the window: at a whole-number coordinate it reaches one further
    left (with weight 0 there)."""
    whole = np.floor(x)
    ratio = np.where(x == whole, 1.0, x - whole)
    left = (x - ratio).astype(np.int64)  # the tap at distance `ratio` to the left
    stretch = min(scale, 1.0) if opts["antialias"] else 1.0
    reach = 1 if opts["mode"] == "linear" else 2
    first = math.floor(-reach / stretch) + 1
    offsets = np.arange(first, 2 - first)
    dist = stretch * (offsets[None, :] - ratio[:, None])
    if opts["mode"] == "linear":
        weights = np.clip(1 - np.abs(dist), 0, 1)
    else:
        weights = _cubic(dist, opts["cubic_a"])
    if opts["antialias"]:
        weights = weights / weights.sum(1, keepdims=True)
    return left[:, None] + offsets[None, :], weights


def _resize_axis(imp: _Importer, v: Run, axis: int, out: int, scale: float, opts: dict,
                 roi: tuple[float, float] | None) -> Run:
    size = v.type.shape[axis]
    x = _source_coords(opts["coord"], out, size, scale, roi).astype(np.float64)
    outside = (x < 0) | (x > size - 1) if opts["coord"] == "tf_crop_and_resize" else None
    if opts["mode"] == "nearest":
        idx = _nearest_index(x, opts["nearest"], scale)[:, None]
        weights = np.ones((out, 1))
    else:
        idx, weights = _taps(x, opts, scale)
        if opts["exclude_outside"]:
            weights = np.where((idx < 0) | (idx >= size), 0.0, weights)
            weights = weights / np.where(weights.sum(1, keepdims=True) == 0, 1.0,
                                         weights.sum(1, keepdims=True))
    idx = np.clip(idx, 0, size - 1)  # ONNX reads past the edges as the edge element
    if outside is not None and outside.any():
        weights = np.where(outside[:, None], 0.0, weights)
    dt = _np_dtype(v)
    line = (out,) + (1,) * (v.type.rank - axis - 1)  # a weight per position along `axis`
    total = None
    for t in range(idx.shape[1]):
        w = weights[:, t]
        if not w.any():
            continue
        column = idx[:, t]
        if out == size and np.array_equal(column, np.arange(size)):
            picked = v
        else:
            picked = imp.emit("mp.gather", [v, imp.constant(column, f"{imp.node.output[0]}_idx")],
                              {"axis": axis}, onnx_type=v.onnx_type)
        if not np.all(w == 1):
            wc = imp.constant(w.astype(dt).reshape(line), f"{imp.node.output[0]}_w")
            picked = imp.emit("mp.mul", [picked, wc], onnx_type=v.onnx_type)
        total = picked if total is None else imp.emit("mp.add", [total, picked],
                                                      onnx_type=v.onnx_type)
    if outside is not None and outside.any():
        fill = imp.constant(np.where(outside, opts["extrapolation"], 0.0).astype(dt).reshape(line),
                            f"{imp.node.output[0]}_fill")
        if total is None:  # every position lies outside: the fill alone, at the output's shape
            full = v.type.shape[:axis] + (out,) + v.type.shape[axis + 1:]
            total = imp.constant(np.zeros(full, dt), "zeros")
            return imp.emit("mp.add", [total, fill], onnx_type=v.onnx_type)
        if opts["extrapolation"] != 0:
            total = imp.emit("mp.add", [total, fill], onnx_type=v.onnx_type)
    return total


def _resize(imp: _Importer, x: Run, scales: np.ndarray | None, sizes: np.ndarray | None,
            axes: list[int], roi: np.ndarray | None, opts: dict) -> Run:
    shape = x.type.shape
    if opts["mode"] not in ("nearest", "linear", "cubic"):
        raise imp.error(f"mode '{opts['mode']}' is not an ONNX Resize mode (nearest, linear, "
                        f"cubic)")
    if opts["mode"] != "nearest":
        _need_float(imp, x, f"{opts['mode']} Resize")
    coords = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
              "asymmetric", "tf_crop_and_resize", "tf_half_pixel_for_nn")
    if opts["coord"] not in coords:
        raise imp.error(f"coordinate_transformation_mode '{opts['coord']}' is not an ONNX value "
                        f"({', '.join(coords)})")
    if opts["nearest"] not in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil",
                               "simple"):
        raise imp.error(f"nearest_mode '{opts['nearest']}' is not an ONNX value")
    if opts["antialias"] and opts["mode"] == "nearest":
        raise imp.error("antialias = 1 applies to linear and cubic modes, not nearest")
    given = scales if scales is not None else sizes
    if given is None or len(given) != len(axes):
        what = "scales" if scales is not None else "sizes"
        raise imp.error(f"Resize needs scales or sizes with one value per resized axis "
                        f"({len(axes)}); got {what} {None if given is None else list(given)}")
    # Scale factors and sizes in float32 arithmetic, as onnxruntime and ONNX's shape inference
    # take them.
    f = np.float32
    if scales is not None:
        factor = {ax: f(s) for ax, s in zip(axes, scales)}
        if min(factor.values()) <= 0:
            raise imp.error(f"scales {list(map(float, scales))} must be > 0")
        out = {ax: math.floor(f(shape[ax]) * factor[ax]) for ax in axes}
    else:
        want = {ax: int(s) for ax, s in zip(axes, sizes)}
        if min(want.values()) <= 0 or any(shape[ax] == 0 for ax in axes):
            raise imp.error(f"sizes {list(map(int, sizes))} must be > 0 for a non-empty input")
        factor = {ax: f(want[ax]) / f(shape[ax]) for ax in axes}
        policy = opts["aspect"]
        if policy not in ("stretch", "not_larger", "not_smaller"):
            raise imp.error(f"keep_aspect_ratio_policy '{policy}' is not an ONNX value")
        if policy != "stretch":
            s = (min if policy == "not_larger" else max)(factor.values())
            factor = dict.fromkeys(axes, s)
            out = {ax: math.floor(s * f(shape[ax]) + f(0.5)) for ax in axes}
        else:
            out = want
    rois = {}
    if opts["coord"] == "tf_crop_and_resize":
        if roi is None or roi.size != 2 * len(axes):
            raise imp.error(f"tf_crop_and_resize needs a roi of {2 * len(axes)} values (starts, "
                            f"then ends, one per resized axis)")
        roi = roi.astype(np.float64).reshape(-1)
        rois = {ax: (float(roi[i]), float(roi[i + len(axes)])) for i, ax in enumerate(axes)}
    y = x
    for ax in axes:
        whole = rois.get(ax, (0.0, 1.0)) == (0.0, 1.0)
        if out[ax] == shape[ax] and math.isclose(factor[ax], 1.0) and whole:
            continue  # this axis is not resized
        if out[ax] < 1:
            raise imp.error(f"axis {ax} would have size {out[ax]}")
        y = _resize_axis(imp, y, ax, out[ax], factor[ax], opts, rois.get(ax))
    return y


def _optional_const(imp: _Importer, i: int, what: str) -> np.ndarray | None:
    arr = imp.const(i, what)
    return None if arr is None or arr.size == 0 else np.asarray(arr).reshape(-1)


@handler("Resize")
def _resize_node(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    a = _attrs(node)
    rank = x.type.rank
    if imp.opset < 11:  # Resize-10: (X, scales), asymmetric coordinates, as Upsample
        scales, sizes, roi = _optional_const(imp, 1, "the scales"), None, None
        opts = {"coord": "asymmetric", "nearest": "simple"}
    else:
        roi = _optional_const(imp, 1, "the roi")
        scales = _optional_const(imp, 2, "the scales")
        sizes = _optional_const(imp, 3, "the sizes")
        if scales is not None and sizes is not None:
            raise imp.error("Resize takes scales or sizes, not both")
        opts = {"coord": a.get("coordinate_transformation_mode", "half_pixel"),
                "nearest": a.get("nearest_mode", "round_prefer_floor")}
    opts.update(mode=a.get("mode", "nearest"), cubic_a=float(a.get("cubic_coeff_a", -0.75)),
                exclude_outside=int(a.get("exclude_outside", 0)),
                extrapolation=float(a.get("extrapolation_value", 0.0)),
                antialias=int(a.get("antialias", 0)),
                aspect=a.get("keep_aspect_ratio_policy", "stretch"))
    axes = [int(ax) for ax in a.get("axes", range(rank))]
    if any(not -rank <= ax < rank for ax in axes) or len({ax % rank for ax in axes}) \
            != len(axes):
        raise imp.error(f"axes {axes} must be distinct axes of the rank-{rank} input")
    axes = [ax % rank for ax in axes]
    return [_resize(imp, x, scales, sizes, axes, roi, opts)]


@handler("Upsample")
def _upsample(imp: _Importer, node: onnx.NodeProto) -> list:
    """Upsample (opsets 7 to 9; deprecated at 10 for Resize-10, whose semantics it shares)."""
    x = imp.run_input(0)
    a = _attrs(node)
    scales = np.asarray(a["scales"], np.float64) if "scales" in a else \
        _optional_const(imp, 1, "the scales")
    if scales is not None and np.any(scales < 1):
        raise imp.error(f"Upsample scales {scales.tolist()} must be >= 1")
    mode = a.get("mode", "nearest")
    if mode == "bilinear":  # Upsample-7's name for linear over the last two axes
        mode = "linear"
    opts = {"coord": "asymmetric", "nearest": "simple", "mode": mode, "cubic_a": -0.75,
            "exclude_outside": 0, "extrapolation": 0.0, "antialias": 0, "aspect": "stretch"}
    return [_resize(imp, x, scales, None, list(range(x.type.rank)), None, opts)]


# ---- InstanceNormalization and GroupNormalization --------------------------------------------


def _normalized(imp: _Importer, x: Run, block: tuple[int, ...], eps: float) -> Run:
    """x normalized to zero mean and unit variance over each block of its trailing `block`
    axes: mp.layer_norm with a unit scale and a zero shift (both exact)."""
    dt = _np_dtype(x)
    ones, zeros = (imp.constant(np.full(block, v, dt), "ones" if v else "zeros") for v in (1, 0))
    return imp.emit("mp.layer_norm", [x, ones, zeros], {"axis": x.type.rank - len(block),
                                                        "epsilon": eps},
                    hint=f"{imp.node.output[0]}_normalized", onnx_type=x.onnx_type)


def _scale_shift(imp: _Importer, y: Run, params: list[Const | Run], names: Sequence[str],
                 per_group: int) -> Run:
    """y * scale + bias with one scale and bias per channel (axis 1); `per_group` > 1 repeats
    each given value for that many neighbouring channels (GroupNormalization-18)."""
    c, rank = y.type.shape[1], y.type.rank
    bshape = (c,) + (1,) * (rank - 2)
    for p, name, op in zip(params, names, ("mp.mul", "mp.add")):
        if isinstance(p, Const):
            arr = np.repeat(np.asarray(p.array).reshape(-1), per_group)
            if (op == "mp.mul" and np.all(arr == 1)) or (op == "mp.add" and not arr.any()):
                continue
            v = imp.constant(arr.astype(_np_dtype(y)).reshape(bshape), f"{name}_c")
        else:
            v = p
            if per_group > 1:
                g = v.type.shape[0]
                v = _reshape_to(imp, v, (g, 1))
                v = imp.emit("mp.expand", [v], declared=tensor((g, per_group), v.type.elem),
                             onnx_type=p.onnx_type)
            v = _reshape_to(imp, v, bshape)
        _same_onnx(imp, y, v)
        y = imp.emit(op, [y, v], onnx_type=y.onnx_type)
    return y


@handler("InstanceNormalization")
def _instance_norm(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    _need_float(imp, x, "InstanceNormalization")
    if x.type.rank < 3:
        raise imp.error(f"InstanceNormalization needs an (N, C, D...) input, got {x.type}")
    c = x.type.shape[1]
    params = [imp.need_tensor(i) for i in (1, 2)]
    for p, what in zip(params, ("scale", "B")):
        if _shape_of(p) != (c,):
            raise imp.error(f"{what} must have shape [{c}] (one per channel), got "
                            f"{list(_shape_of(p))}")
    y = _normalized(imp, x, x.type.shape[2:], float(_attrs(node).get("epsilon", 1e-5)))
    return [_scale_shift(imp, y, params, node.input[1:3], 1)]


@handler("GroupNormalization")
def _group_norm(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    _need_float(imp, x, "GroupNormalization")
    a = _attrs(node)
    shape = x.type.shape
    if x.type.rank < 3:
        raise imp.error(f"GroupNormalization needs an (N, C, D...) input, got {x.type}")
    n, c = shape[:2]
    groups = int(a.get("num_groups", 0))
    if groups < 1 or c % groups:
        raise imp.error(f"num_groups {groups} must divide the {c} channels")
    # GroupNormalization-18 scales and shifts per group; -21 per channel. Both compute the
    # statistics in float32 at least (stash_type 1, the only value ONNX defines).
    per_group = imp.opset < 21
    want = groups if per_group else c
    params = [imp.need_tensor(i) for i in (1, 2)]
    for p, what in zip(params, ("scale", "bias")):
        if _shape_of(p) != (want,):
            form = "one per group at opset 18" if per_group else "one per channel from opset 21"
            raise imp.error(f"{what} must have shape [{want}] ({form}), got "
                            f"{list(_shape_of(p))}")
    block = (c // groups) * math.prod(shape[2:])
    y = _normalized(imp, _reshape_to(imp, x, (n, groups, block)), (block,),
                    float(a.get("epsilon", 1e-5)))
    y = _reshape_to(imp, y, shape)
    return [_scale_shift(imp, y, params, node.input[1:3], c // groups if per_group else 1)]
