"""ONNX import handlers: AffineGrid, GridSample, DeformConv, RoiAlign and MaxRoiPool.

AffineGrid is the constant grid of normalized output coordinates (homogeneous, x first) times
each batch's transposed theta: one matmul. GridSample un-normalizes the grid into pixel
coordinates, takes the integer taps around each point (floor from a truncating cast: the IR
has no floor op here) and reads them with one gather_elements over the flattened image per
tap (2^r for linear, 4^r for cubic, 1 for nearest), weighted; a tap outside the image reads
the clamped border pixel and, for `zeros` padding, is then masked to zero, for `reflection`
the pixel its reflection lands on. The steps follow ONNX's reference (`op_grid_sample.py`).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.types import tensor
from mplower.onnx.importer.core import Run, _attrs, _Importer, _reshape_to, handler


def _coords(size: int, align_corners: bool) -> np.ndarray:
    """Normalized coordinates of the `size` pixel centers (align_corners: of the corners)."""
    if align_corners:
        return np.linspace(-1.0, 1.0, size)
    return (2 * np.arange(size) + 1) / size - 1


@handler("AffineGrid")
def _affine_grid(imp: _Importer, node: onnx.NodeProto) -> list:
    theta = imp.run_input(0)
    size = [int(v) for v in np.asarray(imp.const(1, "AffineGrid's size")).reshape(-1)]
    r = len(size) - 2
    if r not in (2, 3) or theta.type.shape != (size[0], r, r + 1):
        raise imp.error(f"theta {theta.type} must be (N, {r}, {r + 1}) for size {size} "
                        f"(N, C, H, W) or (N, C, D, H, W)")
    align = bool(_attrs(node).get("align_corners", 0))
    spatial = size[2:]
    axes = np.meshgrid(*(_coords(s, align) for s in spatial), indexing="ij")
    # Homogeneous coordinates with x (the last spatial axis) first, then y, then z.
    base = np.stack([*axes[::-1], np.ones(spatial)], axis=-1).reshape(-1, r + 1)
    dtype = helper.tensor_dtype_to_np_dtype(theta.onnx_type)
    t = imp.emit("mp.transpose", [theta], {"perm": (0, 2, 1)}, onnx_type=theta.onnx_type)
    grid = imp.emit("mp.matmul", [imp.constant(base.astype(dtype), "base_grid"), t],
                    hint="grid", onnx_type=theta.onnx_type)
    return [_reshape_to(imp, grid, (size[0], *spatial, r))]


def _floor(imp: _Importer, x: Run) -> Run:
    """floor(x) for coordinates well inside the i32 range: a truncating cast, then one less
    where that rounded up (negative non-integers)."""
    cut = imp.emit("mp.cast", [imp.emit("mp.cast", [x], declared=x.type.with_elem("i32"))],
                   declared=x.type, hint="truncated")
    up = imp.emit("mp.greater", [cut, x])
    one = imp.constant(np.ones((), helper.tensor_dtype_to_np_dtype(x.onnx_type)), "one")
    zero = imp.constant(np.zeros((), helper.tensor_dtype_to_np_dtype(x.onnx_type)), "zero")
    return imp.emit("mp.sub", [cut, imp.emit("mp.where", [up, one, zero])], hint="floor",
                    onnx_type=x.onnx_type)


def _round_half_even(imp: _Importer, x: Run) -> Run:
    """Rounding to nearest, ties to even (ONNX's nearest mode, as std::nearbyint)."""
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    half = imp.constant(np.array(0.5, dtype), "half")
    r = _floor(imp, imp.emit("mp.add", [x, half]))
    tie = imp.emit("mp.equal", [imp.emit("mp.sub", [r, x]), half])
    halved = imp.emit("mp.mul", [r, half])
    odd = imp.emit("mp.logical_not", [imp.emit("mp.equal", [_floor(imp, halved), halved])])
    down = imp.emit("mp.logical_and", [tie, odd])
    one = imp.constant(np.ones((), dtype), "one")
    return imp.emit("mp.where", [down, imp.emit("mp.sub", [r, one]), r], hint="nearest",
                    onnx_type=x.onnx_type)


def _clamp(imp: _Importer, x: Run, low: float, high: float) -> Run:
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    lo, hi = (imp.constant(np.array(v, dtype), n) for v, n in ((low, "low"), (high, "high")))
    return imp.emit("mp.minimum", [imp.emit("mp.maximum", [x, lo]), hi], onnx_type=x.onnx_type)


def _const(imp: _Importer, value: float, like: Run, hint: str) -> Run:
    return imp.constant(np.array(value, helper.tensor_dtype_to_np_dtype(like.onnx_type)), hint)


def _reflect(imp: _Importer, v: Run, lo: float, hi: float) -> Run:
    """v folded back into [lo, hi] by reflections at the nearer border, as ONNX's reference
    (`_gs_reflect`) does: the distance past a border, modulo the range, counted from that
    border after an even number of reflections and from the other after an odd one."""
    span = hi - lo
    out = v
    for past, start, other in ((imp.emit("mp.sub", [_const(imp, lo, v, "low"), v]), lo, hi),
                               (imp.emit("mp.sub", [v, _const(imp, hi, v, "high")]), hi, lo)):
        turns = _floor(imp, imp.emit("mp.div", [past, _const(imp, span, v, "span")]))
        rest = imp.emit("mp.sub", [past, imp.emit("mp.mul", [turns, _const(imp, span, v,
                                                                             "span")])])
        half = imp.emit("mp.mul", [turns, _const(imp, 0.5, v, "half")])
        even = imp.emit("mp.equal", [_floor(imp, half), half])
        sign = 1 if start == lo else -1
        near = imp.emit("mp.add" if sign > 0 else "mp.sub", [_const(imp, start, v, "border"),
                                                             rest])
        far = imp.emit("mp.sub" if sign > 0 else "mp.add", [_const(imp, other, v, "border"),
                                                            rest])
        folded = imp.emit("mp.where", [even, near, far])
        outside = imp.emit("mp.greater", [past, _const(imp, 0, v, "zero")])
        out = imp.emit("mp.where", [outside, folded, out], hint="reflected",
                       onnx_type=v.onnx_type)
    return out


_CUBIC_A = -0.75  # Keys' cubic convolution, as ONNX's GridSample and Resize use it


def _cubic_weights(imp: _Importer, t: Run) -> list[Run]:
    """The four Keys weights of taps at -1, 0, 1, 2 for the fraction t in [0, 1)."""
    a = _CUBIC_A

    def poly(s: Run, coeffs: tuple[float, ...]) -> Run:
        acc = _const(imp, coeffs[0], t, "coeff")
        for c in coeffs[1:]:
            acc = imp.emit("mp.add", [imp.emit("mp.mul", [acc, s]), _const(imp, c, t, "coeff")])
        return acc

    one, two = _const(imp, 1, t, "one"), _const(imp, 2, t, "two")
    far = (a, -5 * a, 8 * a, -4 * a)  # a|s|^3 - 5a|s|^2 + 8a|s| - 4a for 1 <= |s| < 2
    near = (a + 2, -(a + 3), 0, 1)  # (a+2)|s|^3 - (a+3)|s|^2 + 1 for |s| < 1
    return [poly(imp.emit("mp.add", [t, one]), far), poly(t, near),
            poly(imp.emit("mp.sub", [one, t]), near), poly(imp.emit("mp.sub", [two, t]), far)]


@handler("GridSample")
def _grid_sample(imp: _Importer, node: onnx.NodeProto) -> list:
    x, grid = imp.run_input(0), imp.run_input(1)
    a = _attrs(node)
    mode = a.get("mode", "linear" if imp.opset >= 20 else "bilinear")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    padding = a.get("padding_mode", "zeros")
    align = bool(a.get("align_corners", 0))
    if mode not in ("linear", "nearest", "cubic") or \
            padding not in ("zeros", "border", "reflection"):
        raise imp.error(f"GridSample mode '{mode}' with padding_mode '{padding}' is not an "
                        f"ONNX combination")
    r = x.type.rank - 2
    n, c, *sp = x.type.shape
    out = grid.type.shape[1:-1]
    if r < 1 or grid.type.shape != (n, *out, r) or len(out) != r:
        raise imp.error(f"grid {grid.type} must be (N, out..., {r}) for the input {x.type}")
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    points = math.prod(out)
    g = _reshape_to(imp, grid, (n, points, r))
    axes = []  # per spatial axis (image order): its taps, as (coordinate, weight or None)
    for k in range(r):
        size = sp[k]
        lo, hi = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
        starts, ends = (0, 0, r - 1 - k), (n, points, r - k)  # grid holds x (last axis) first
        gk = imp.emit("mp.slice", [g], {"starts": starts, "ends": ends, "steps": (1, 1, 1)})
        gk = _reshape_to(imp, gk, (n, points))
        # align_corners: -1 and 1 are the corner pixels' centers; else the image's edges.
        scale, shift = ((size - 1) / 2, (size - 1) / 2) if align else (size / 2, (size - 1) / 2)
        p = imp.emit("mp.add", [imp.emit("mp.mul", [gk, _const(imp, scale, gk, "scale")]),
                                _const(imp, shift, gk, "shift")], hint="pixel",
                     onnx_type=x.onnx_type)
        if mode == "nearest":
            p = _round_half_even(imp, p)
        # Cubic taps are padded one by one and the point itself stays, as onnxruntime and
        # PyTorch compute it (ONNX's reference pads the point too; its node tests pad zeros).
        if padding == "border" and mode != "cubic":
            p = _clamp(imp, p, 0, size - 1)
        elif padding == "reflection" and mode != "cubic":
            p = _reflect(imp, p, lo, hi)
        if mode == "nearest":
            axes.append([(p, None)])
            continue
        low = _floor(imp, p)
        t = imp.emit("mp.sub", [p, low], hint="frac")
        one = _const(imp, 1, p, "one")
        if mode == "linear":
            axes.append([(low, imp.emit("mp.sub", [one, t])),
                         (imp.emit("mp.add", [low, one]), t)])
        else:
            axes.append([(imp.emit("mp.add", [low, _const(imp, d, p, "offset")]), w)
                         for d, w in zip((-1, 0, 1, 2), _cubic_weights(imp, t))])
    flat = _reshape_to(imp, x, (n, c, math.prod(sp)))
    zero = imp.constant(np.zeros((), dtype), "zero")
    result = None
    for combo in itertools.product(*axes):
        inside, index, weight = None, None, None
        for k, (pk, wk) in enumerate(combo):
            if padding == "zeros":
                ok = imp.emit("mp.logical_and", [
                    imp.emit("mp.greater_equal", [pk, zero]),
                    imp.emit("mp.less_equal", [pk, _const(imp, sp[k] - 1, pk, "last")])])
                inside = ok if inside is None else imp.emit("mp.logical_and", [inside, ok])
            elif padding == "reflection":
                lo, hi = (0.0, sp[k] - 1.0) if align else (-0.5, sp[k] - 0.5)
                pk = _floor(imp, _reflect(imp, pk, lo, hi))
            ik = imp.emit("mp.cast", [_clamp(imp, pk, 0, sp[k] - 1)],
                          declared=tensor((n, points), "i64"))
            stride = imp.constant(np.array(math.prod(sp[k + 1:]), np.int64), "stride")
            term = imp.emit("mp.mul", [ik, stride])
            index = term if index is None else imp.emit("mp.add", [index, term])
            if wk is not None:
                weight = wk if weight is None else imp.emit("mp.mul", [weight, wk])
        index = imp.emit("mp.expand", [_reshape_to(imp, index, (n, 1, points))],
                         declared=tensor((n, c, points), "i64"))
        v = imp.emit("mp.gather_elements", [flat, index], {"axis": 2}, hint="tap",
                     onnx_type=x.onnx_type)
        if inside is not None:
            v = imp.emit("mp.where", [_reshape_to(imp, inside, (n, 1, points)), v, zero],
                         onnx_type=x.onnx_type)
        if weight is not None:
            v = imp.emit("mp.mul", [v, _reshape_to(imp, weight, (n, 1, points))],
                         hint="weighted", onnx_type=x.onnx_type)
        result = v if result is None else imp.emit("mp.add", [result, v], hint="sampled",
                                                   onnx_type=x.onnx_type)
    return [_reshape_to(imp, result, (n, c, *out))]


def _roi_taps(roi: np.ndarray, height: int, width: int, out_h: int, out_w: int,
              ratio: int, scale: float, half_pixel: bool) -> tuple[np.ndarray, np.ndarray]:
    """(positions, weights) of shape (out_h*out_w, samples, 4): the bilinear corners of every
    sample of every bin of one region, following ONNX's reference (`op_roi_align.py`)."""
    offset = 0.5 if half_pixel else 0.0
    x0, y0, x1, y1 = (float(v) * scale - offset for v in roi)
    rh, rw = y1 - y0, x1 - x0
    if not half_pixel:  # malformed regions count as 1x1
        rh, rw = max(rh, 1.0), max(rw, 1.0)
    bh, bw = rh / out_h, rw / out_w
    gh = ratio if ratio > 0 else math.ceil(rh / out_h)
    gw = ratio if ratio > 0 else math.ceil(rw / out_w)
    pos = np.zeros((out_h * out_w, max(gh * gw, 1), 4), np.int64)
    wts = np.zeros(pos.shape, np.float64)
    for ph, pw, iy, ix in itertools.product(range(out_h), range(out_w), range(gh), range(gw)):
        y = y0 + ph * bh + (iy + 0.5) * bh / gh
        x = x0 + pw * bw + (ix + 0.5) * bw / gw
        if y < -1.0 or y > height or x < -1.0 or x > width:
            continue  # outside the map: weights 0
        y, x = max(y, 0.0), max(x, 0.0)
        ylo, xlo = int(y), int(x)
        if ylo >= height - 1:
            ylo = yhi = height - 1
            y = float(ylo)
        else:
            yhi = ylo + 1
        if xlo >= width - 1:
            xlo = xhi = width - 1
            x = float(xlo)
        else:
            xhi = xlo + 1
        ly, lx = y - ylo, x - xlo
        o, s = ph * out_w + pw, iy * gw + ix
        pos[o, s] = (ylo * width + xlo, ylo * width + xhi, yhi * width + xlo, yhi * width + xhi)
        wts[o, s] = ((1 - ly) * (1 - lx), (1 - ly) * lx, ly * (1 - lx), ly * lx)
    return pos, wts


@handler("RoiAlign")
def _roi_align(imp: _Importer, node: onnx.NodeProto) -> list:
    """Regions known at import: each output is a fixed set of weighted pixel taps (gathered
    once from the (C, N*H*W) view), summed and divided by the sample count (avg) or the
    largest weighted tap (max, as ONNX's reference and onnxruntime define it)."""
    x = imp.run_input(0)
    rois = imp.const(1, "RoiAlign's rois (they set which pixels each output reads)")
    batch = imp.const(2, "RoiAlign's batch_indices")
    a = _attrs(node)
    mode = a.get("mode", "avg")
    half = a.get("coordinate_transformation_mode",
                 "half_pixel" if imp.opset >= 16 else "output_half_pixel") == "half_pixel"
    out_h, out_w = int(a.get("output_height", 1)), int(a.get("output_width", 1))
    ratio, scale = int(a.get("sampling_ratio", 0)), float(a.get("spatial_scale", 1.0))
    if x.type.rank != 4 or mode not in ("avg", "max"):
        raise imp.error(f"RoiAlign needs an (N, C, H, W) input and mode avg or max, got "
                        f"{x.type} and '{mode}'")
    n, c, height, width = x.type.shape
    rois, batch = np.asarray(rois), np.asarray(batch).reshape(-1).astype(np.int64)
    if rois.ndim != 2 or rois.shape[1] != 4 or batch.shape != (rois.shape[0],) \
            or np.any((batch < 0) | (batch >= n)):
        raise imp.error(f"rois {list(rois.shape)} must be (R, 4) with one batch index in "
                        f"[0, {n}) per region")
    taps = [_roi_taps(r, height, width, out_h, out_w, ratio, scale, half) for r in rois]
    samples = max(p.shape[1] for p, _ in taps)
    pos = np.zeros((len(taps), out_h * out_w, samples, 4), np.int64)
    wts = np.zeros(pos.shape, np.float64)
    counts = np.ones((len(taps), out_h * out_w), np.float64)
    for k, (p, w) in enumerate(taps):
        s = p.shape[1]
        # A region with fewer samples repeats its first: no change to the maximum; its
        # repeated weights are 0 for the average, which divides by its own count.
        pos[k] = np.concatenate([p, np.repeat(p[:, :1], samples - s, axis=1)], axis=1)
        wts[k, :, :s] = w
        if mode == "max":
            wts[k, :, s:] = w[:, :1]
        pos[k] += batch[k] * height * width
        counts[k] = s
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    planes = imp.emit("mp.transpose", [_reshape_to(imp, x, (n, c, height * width))],
                      {"perm": (1, 0, 2)}, onnx_type=x.onnx_type)
    planes = _reshape_to(imp, planes, (c, n * height * width))
    picked = imp.emit("mp.gather", [planes, imp.constant(pos.reshape(-1), "roi_taps")],
                      {"axis": 1}, hint="taps", onnx_type=x.onnx_type)
    weighted = imp.emit("mp.mul", [picked, imp.constant(wts.reshape(1, -1).astype(dtype),
                                                        "roi_weights")],
                        hint="weighted", onnx_type=x.onnx_type)
    outs = len(taps) * out_h * out_w
    weighted = _reshape_to(imp, weighted, (c, outs, samples * 4))
    op = "mp.reduce_sum" if mode == "avg" else "mp.reduce_max"
    y = imp.emit(op, [weighted], {"axes": (2,), "keepdims": False}, onnx_type=x.onnx_type)
    if mode == "avg":
        y = imp.emit("mp.div", [y, imp.constant(counts.reshape(1, -1).astype(dtype),
                                                "sample_count")], onnx_type=x.onnx_type)
    y = _reshape_to(imp, y, (c, len(taps), out_h, out_w))
    return [imp.emit("mp.transpose", [y], {"perm": (1, 0, 2, 3)}, onnx_type=x.onnx_type)]


def _bilinear_zeros(imp: _Importer, flat: Run, y: Run, x: Run, height: int,
                    width: int) -> Run:
    """Bilinear samples of flat (N, C, H*W) at pixel coordinates y, x (N, P); corners outside
    the image count as zeros (deformable convolution's sampling)."""
    n, c, _ = flat.type.shape
    points = y.type.shape[1]
    zero, one = _const(imp, 0, y, "zero"), _const(imp, 1, y, "one")
    result = None
    lows = [_floor(imp, y), _floor(imp, x)]
    fracs = [imp.emit("mp.sub", [y, lows[0]]), imp.emit("mp.sub", [x, lows[1]])]
    for dy, dx in itertools.product((0, 1), (0, 1)):
        inside, index, weight = None, None, None
        for low, frac, d, size, stride in ((lows[0], fracs[0], dy, height, width),
                                           (lows[1], fracs[1], dx, width, 1)):
            at = imp.emit("mp.add", [low, one]) if d else low
            ok = imp.emit("mp.logical_and", [
                imp.emit("mp.greater_equal", [at, zero]),
                imp.emit("mp.less_equal", [at, _const(imp, size - 1, y, "last")])])
            inside = ok if inside is None else imp.emit("mp.logical_and", [inside, ok])
            i = imp.emit("mp.cast", [_clamp(imp, at, 0, size - 1)],
                         declared=tensor((n, points), "i64"))
            term = imp.emit("mp.mul", [i, imp.constant(np.array(stride, np.int64), "stride")])
            index = term if index is None else imp.emit("mp.add", [index, term])
            w = frac if d else imp.emit("mp.sub", [one, frac])
            weight = w if weight is None else imp.emit("mp.mul", [weight, w])
        weight = imp.emit("mp.where", [inside, weight, zero], hint="corner_weight")
        index = imp.emit("mp.expand", [_reshape_to(imp, index, (n, 1, points))],
                         declared=tensor((n, c, points), "i64"))
        v = imp.emit("mp.gather_elements", [flat, index], {"axis": 2}, hint="corner",
                     onnx_type=flat.onnx_type)
        v = imp.emit("mp.mul", [v, _reshape_to(imp, weight, (n, 1, points))],
                     onnx_type=flat.onnx_type)
        result = v if result is None else imp.emit("mp.add", [result, v], hint="sampled",
                                                   onnx_type=flat.onnx_type)
    return result


@handler("DeformConv")
def _deform_conv(imp: _Importer, node: onnx.NodeProto) -> list:
    """2-D deformable convolution: per kernel tap and offset group, the input sampled
    bilinearly at the offset positions (times the mask), gathered into columns, then one
    matmul per group with the reshaped weights."""
    x, w, off = imp.run_input(0), imp.run_input(1), imp.run_input(2)
    if x.type.rank != 4 or w.type.rank != 4:
        raise imp.error(f"DeformConv is imported for 2-D inputs (N, C, H, W), got {x.type}")
    a = _attrs(node)
    n, c, height, width = x.type.shape
    oc, cg, kh, kw = w.type.shape
    group, ogroups = int(a.get("group", 1)), int(a.get("offset_group", 1))
    strides, dilations = list(a.get("strides", [1, 1])), list(a.get("dilations", [1, 1]))
    pads = list(a.get("pads", [0, 0, 0, 0]))
    if len(strides) != 2 or len(dilations) != 2 or len(pads) != 4:
        raise imp.error(f"strides {strides}, dilations {dilations} and pads {pads} must match "
                        f"the 2 spatial axes")
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = strides, dilations, pads
    taps = kh * kw
    oh = (height + pt + pb - ((kh - 1) * dh + 1)) // sh + 1
    ow = (width + pl + pr - ((kw - 1) * dw + 1)) // sw + 1
    if cg * group != c or oc % group or c % ogroups or \
            off.type.shape != (n, 2 * ogroups * taps, oh, ow):
        raise imp.error(f"weights {w.type} and offsets {off.type} do not fit the input "
                        f"{x.type} with group {group}, offset_group {ogroups}")
    mask = imp.input(4)
    mask = None if mask is None else imp.run_input(4)
    points = oh * ow
    offs = _reshape_to(imp, off, (n, 2 * ogroups * taps, points))
    rows = np.arange(oh)[:, None] * sh - pt + np.zeros((1, ow))
    cols = np.arange(ow)[None, :] * sw - pl + np.zeros((oh, 1))
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    flat = _reshape_to(imp, x, (n, c, height * width))
    per_group = c // ogroups

    def channel(v: Run, k: int) -> Run:
        s = imp.emit("mp.slice", [v], {"starts": (0, k, 0), "ends": (n, k + 1, points),
                                       "steps": (1, 1, 1)}, onnx_type=v.onnx_type)
        return _reshape_to(imp, s, (n, points))

    sampled = []  # per offset group: (N, C/og, taps, P)
    for g in range(ogroups):
        part = imp.emit("mp.slice", [flat], {"starts": (0, g * per_group, 0),
                                             "ends": (n, (g + 1) * per_group, height * width),
                                             "steps": (1, 1, 1)}, onnx_type=x.onnx_type)
        per_tap = []
        for t in range(taps):
            i, j = divmod(t, kw)
            base_y = imp.constant((rows + i * dh).reshape(1, -1).astype(dtype), "base_y")
            base_x = imp.constant((cols + j * dw).reshape(1, -1).astype(dtype), "base_x")
            y = imp.emit("mp.add", [base_y, channel(offs, (g * taps + t) * 2)], hint="y")
            xx = imp.emit("mp.add", [base_x, channel(offs, (g * taps + t) * 2 + 1)], hint="x")
            v = _bilinear_zeros(imp, part, y, xx, height, width)
            if mask is not None:
                mk = _reshape_to(imp, mask, (n, ogroups * taps, points))
                v = imp.emit("mp.mul", [v, _reshape_to(imp, channel(mk, g * taps + t),
                                                       (n, 1, points))],
                             hint="masked", onnx_type=x.onnx_type)
            per_tap.append(_reshape_to(imp, v, (n, per_group, 1, points)))
        sampled.append(imp.emit("mp.concat", per_tap, {"axis": 2}, onnx_type=x.onnx_type)
                       if len(per_tap) > 1 else per_tap[0])
    columns = imp.emit("mp.concat", sampled, {"axis": 1}, onnx_type=x.onnx_type) \
        if len(sampled) > 1 else sampled[0]
    columns = _reshape_to(imp, columns, (n, c * taps, points))
    outs = []
    for g in range(group):
        cs = imp.emit("mp.slice", [columns], {"starts": (0, g * cg * taps, 0),
                                              "ends": (n, (g + 1) * cg * taps, points),
                                              "steps": (1, 1, 1)}, onnx_type=x.onnx_type) \
            if group > 1 else columns
        per = oc // group
        wg = imp.emit("mp.slice", [w], {"starts": (g * per, 0, 0, 0),
                                        "ends": ((g + 1) * per, cg, kh, kw),
                                        "steps": (1, 1, 1, 1)}, onnx_type=w.onnx_type) \
            if group > 1 else w
        wg = _reshape_to(imp, wg, (per, cg * taps))
        outs.append(imp.emit("mp.matmul", [wg, cs], hint="deform_conv", onnx_type=x.onnx_type))
    y = imp.emit("mp.concat", outs, {"axis": 1}, onnx_type=x.onnx_type) \
        if len(outs) > 1 else outs[0]
    if imp.input(3) is not None:
        b = _reshape_to(imp, imp.run_input(3), (1, oc, 1))
        y = imp.emit("mp.add", [y, b], hint="biased", onnx_type=x.onnx_type)
    return [_reshape_to(imp, y, (n, oc, oh, ow))]


@handler("MaxRoiPool")
def _max_roi_pool(imp: _Importer, node: onnx.NodeProto) -> list:
    """Regions known at import (Fast R-CNN's pooling): each output the maximum over a pixel
    rectangle, gathered from the (C, N*H*W) view; an empty bin is 0. The rectangles follow
    onnxruntime's kernel (rounded region corners, floor/ceil bin edges)."""
    x = imp.run_input(0)
    rois = imp.const(1, "MaxRoiPool's rois (they set which pixels each output reads)")
    a = _attrs(node)
    out_h, out_w = (int(v) for v in a["pooled_shape"])
    scale = float(a.get("spatial_scale", 1.0))
    if x.type.rank != 4:
        raise imp.error(f"MaxRoiPool needs an (N, C, H, W) input, got {x.type}")
    n, c, height, width = x.type.shape
    rois = np.asarray(rois, np.float64)
    if rois.ndim != 2 or rois.shape[1] != 5 or np.any((rois[:, 0] < 0) | (rois[:, 0] >= n)):
        raise imp.error(f"rois {list(rois.shape)} must be (R, 5): a batch index in [0, {n}) "
                        f"and x1, y1, x2, y2")
    bins = []
    for b, x1, y1, x2, y2 in rois:
        # std::round: halves away from zero.
        sx, sy, ex, ey = (int(np.sign(v) * np.floor(abs(v) * scale + 0.5))
                          for v in (x1, y1, x2, y2))
        bh, bw = max(ey - sy + 1, 1) / out_h, max(ex - sx + 1, 1) / out_w
        for ph, pw in itertools.product(range(out_h), range(out_w)):
            h0 = min(max(math.floor(ph * bh) + sy, 0), height)
            h1 = min(max(math.ceil((ph + 1) * bh) + sy, 0), height)
            w0 = min(max(math.floor(pw * bw) + sx, 0), width)
            w1 = min(max(math.ceil((pw + 1) * bw) + sx, 0), width)
            cells = [(int(b) * height + h) * width + w
                     for h in range(h0, h1) for w in range(w0, w1)]
            bins.append(cells)
    taps = max(max((len(cells) for cells in bins), default=1), 1)
    # A bin with fewer cells repeats its first (no change to the maximum); an empty one
    # reads cell 0 and is zeroed after.
    index = np.array([(cells or [0]) + [cells[0] if cells else 0] * (taps - len(cells or [0]))
                      for cells in bins], np.int64)
    empty = np.array([not cells for cells in bins]).reshape(1, -1)
    planes = imp.emit("mp.transpose", [_reshape_to(imp, x, (n, c, height * width))],
                      {"perm": (1, 0, 2)}, onnx_type=x.onnx_type)
    planes = _reshape_to(imp, planes, (c, n * height * width))
    picked = imp.emit("mp.gather", [planes, imp.constant(index.reshape(-1), "roi_cells")],
                      {"axis": 1}, hint="cells", onnx_type=x.onnx_type)
    picked = _reshape_to(imp, picked, (c, len(bins), taps))
    y = imp.emit("mp.reduce_max", [picked], {"axes": (2,), "keepdims": False},
                 onnx_type=x.onnx_type)
    if empty.any():
        zero = imp.constant(np.zeros((), helper.tensor_dtype_to_np_dtype(x.onnx_type)), "zero")
        y = imp.emit("mp.where", [imp.constant(empty, "empty_bin"), zero, y],
                     onnx_type=x.onnx_type)
    y = _reshape_to(imp, y, (c, len(rois), out_h, out_w))
    return [imp.emit("mp.transpose", [y], {"perm": (1, 0, 2, 3)}, onnx_type=x.onnx_type)]
