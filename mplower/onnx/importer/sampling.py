"""ONNX import handlers: AffineGrid and GridSample.

AffineGrid is the constant grid of normalized output coordinates (homogeneous, x first) times
each batch's transposed theta: one matmul. GridSample un-normalizes the grid into pixel
coordinates, takes the integer taps around each point (floor from a truncating cast: the IR
has no floor op here) and reads them with one gather_elements over the flattened image per
tap, weighted (bilinear) or chosen (nearest); a tap outside the image reads the clamped border
pixel and, for `zeros` padding, is then masked to zero. Bicubic and reflection padding are
refused, naming the node.
"""

from __future__ import annotations

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


@handler("GridSample")
def _grid_sample(imp: _Importer, node: onnx.NodeProto) -> list:
    x, grid = imp.run_input(0), imp.run_input(1)
    a = _attrs(node)
    mode = a.get("mode", "linear" if imp.opset >= 20 else "bilinear")
    mode = {"bilinear": "linear"}.get(mode, mode)
    padding = a.get("padding_mode", "zeros")
    align = bool(a.get("align_corners", 0))
    if mode not in ("linear", "nearest") or padding not in ("zeros", "border"):
        raise imp.error(f"GridSample mode '{mode}' with padding_mode '{padding}' is not "
                        f"supported (linear or nearest; zeros or border)")
    r = x.type.rank - 2
    n, c, *sp = x.type.shape
    out = grid.type.shape[1:-1]
    if r < 1 or grid.type.shape != (n, *out, r) or len(out) != r:
        raise imp.error(f"grid {grid.type} must be (N, out..., {r}) for the input {x.type}")
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    points = math.prod(out)
    g = _reshape_to(imp, grid, (n, points, r))
    coords = []  # pixel coordinate per spatial axis, (N, points), the image's axis order
    for k in range(r):
        size = sp[k]
        starts, ends = (0, 0, r - 1 - k), (n, points, r - k)  # grid holds x (last axis) first
        gk = imp.emit("mp.slice", [g], {"starts": starts, "ends": ends, "steps": (1, 1, 1)})
        gk = _reshape_to(imp, gk, (n, points))
        # align_corners: -1 and 1 are the corner pixels' centers; else the image's edges.
        scale, shift = ((size - 1) / 2, (size - 1) / 2) if align else (size / 2, (size - 1) / 2)
        p = imp.emit("mp.add", [imp.emit("mp.mul", [gk, imp.constant(np.array(scale, dtype),
                                                                      "scale")]),
                                imp.constant(np.array(shift, dtype), "shift")],
                     hint="pixel", onnx_type=x.onnx_type)
        if padding == "border":
            p = _clamp(imp, p, 0, size - 1)
        coords.append(p)
    flat = _reshape_to(imp, x, (n, c, math.prod(sp)))
    if mode == "nearest":
        taps = [([_round_half_even(imp, p) for p in coords], None)]
    else:
        lows = [_floor(imp, p) for p in coords]
        one = imp.constant(np.ones((), dtype), "one")
        fracs = [imp.emit("mp.sub", [p, lo], hint="frac") for p, lo in zip(coords, lows)]
        taps = []
        for corner in range(2 ** r):
            at, weight = [], None
            for k in range(r):
                upper = (corner >> (r - 1 - k)) & 1
                at.append(imp.emit("mp.add", [lows[k], one]) if upper else lows[k])
                wk = fracs[k] if upper else imp.emit("mp.sub", [one, fracs[k]])
                weight = wk if weight is None else imp.emit("mp.mul", [weight, wk])
            taps.append((at, weight))
    result = None
    for at, weight in taps:
        inside, index = None, None
        for k, pk in enumerate(at):
            if padding == "zeros":
                ok = imp.emit("mp.logical_and", [
                    imp.emit("mp.greater_equal", [pk, imp.constant(np.zeros((), dtype), "0")]),
                    imp.emit("mp.less_equal", [pk, imp.constant(np.array(sp[k] - 1, dtype),
                                                                "last")])])
                inside = ok if inside is None else imp.emit("mp.logical_and", [inside, ok])
            ik = imp.emit("mp.cast", [_clamp(imp, pk, 0, sp[k] - 1)],
                          declared=tensor((n, points), "i64"))
            stride = imp.constant(np.array(math.prod(sp[k + 1:]), np.int64), "stride")
            term = imp.emit("mp.mul", [ik, stride])
            index = term if index is None else imp.emit("mp.add", [index, term])
        index = imp.emit("mp.expand", [_reshape_to(imp, index, (n, 1, points))],
                         declared=tensor((n, c, points), "i64"))
        v = imp.emit("mp.gather_elements", [flat, index], {"axis": 2}, hint="tap",
                     onnx_type=x.onnx_type)
        if inside is not None:
            weight = inside if weight is None else weight
            zero = imp.constant(np.zeros((), dtype), "zero")
            mask = _reshape_to(imp, inside, (n, 1, points))
            v = imp.emit("mp.where", [mask, v, zero], onnx_type=x.onnx_type)
        if weight is not None and weight is not inside:
            v = imp.emit("mp.mul", [v, _reshape_to(imp, weight, (n, 1, points))],
                         hint="weighted", onnx_type=x.onnx_type)
        result = v if result is None else imp.emit("mp.add", [result, v], hint="sampled",
                                                   onnx_type=x.onnx_type)
    return [_reshape_to(imp, result, (n, c, *out))]
