"""ONNX import handlers: Pad and CenterCropPad, as slices, concats and gathers of the input.

Every pad mode is a fixed choice of input elements (or the constant), known from the shapes
alone: constant padding is a crop (slice) then constant blocks concatenated on; reflect, edge
and wrap are one gather per padded axis with the index map numpy's `np.pad` gives (what ONNX's
reference computes). No new mp op, so precision passes and export see data movement only.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.onnx.importer.core import Run, _attrs, _Importer, handler

_MODES = ("constant", "reflect", "edge", "wrap")


def _crop(imp: _Importer, x: Run, begins: list[int], ends: list[int]) -> Run:
    """x with `begins[k]` elements removed at the start of axis k and `ends[k]` at its end."""
    if not any(begins) and not any(ends):
        return x
    shape = x.type.shape
    attrs = {"starts": tuple(begins), "ends": tuple(d - e for d, e in zip(shape, ends)),
             "steps": (1,) * len(shape)}
    return imp.emit("mp.slice", [x], attrs, hint="cropped", onnx_type=x.onnx_type)


def pad(imp: _Importer, x: Run, begins: list[int], ends: list[int], mode: str,
        value: np.ndarray | None = None) -> Run:
    """x padded by `begins`/`ends` per axis (negative counts crop, before any padding)."""
    rank = x.type.rank
    x = _crop(imp, x, [max(0, -b) for b in begins], [max(0, -e) for e in ends])
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    for k in range(rank):
        b, e = max(0, begins[k]), max(0, ends[k])
        if not b and not e:
            continue
        n = x.type.shape[k]
        if mode == "constant":
            fill = np.zeros((), dtype) if value is None else np.asarray(value).astype(dtype)
            parts = []
            for count, side in ((b, "begin"), (None, ""), (e, "end")):
                if count is None:
                    parts.append(x)
                elif count:
                    shape = list(x.type.shape)
                    shape[k] = count
                    parts.append(imp.constant(np.full(shape, fill.reshape(()), dtype),
                                              f"pad_{side}"))
            x = imp.emit("mp.concat", parts, {"axis": k}, hint="padded", onnx_type=x.onnx_type)
            continue
        if n == 0:
            raise imp.error(f"'{mode}' padding of an empty axis {k} ({x.type}) has no "
                            f"element to repeat")
        if mode == "reflect" and n == 1:
            raise imp.error(f"'reflect' padding needs at least 2 elements along axis {k}, "
                            f"got {x.type}")
        index = np.pad(np.arange(n, dtype=np.int64), (b, e), mode=mode)
        x = imp.emit("mp.gather", [x, imp.constant(index, f"pad_index_{k}")], {"axis": k},
                     hint="padded", onnx_type=x.onnx_type)
    return x


@handler("Pad")
def _pad(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    a = _attrs(node)
    rank = x.type.rank
    mode = a.get("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode not in _MODES or (mode == "wrap" and imp.opset < 19):
        raise imp.error(f"pad mode '{mode}' is not an ONNX mode at opset {imp.opset} "
                        f"(constant, reflect, edge; wrap from opset 19)")
    if imp.opset < 11:
        raw = a.get("pads", a.get("paddings"))
        if raw is None:
            raise imp.error("Pad needs the 'pads' attribute before opset 11")
        pads = [int(p) for p in raw]
        value = np.asarray(float(a.get("value", 0.0)))
        axes = list(range(rank))
    else:
        pads = [int(p) for p in np.asarray(imp.const(1, "Pad's pads")).reshape(-1)]
        value = imp.const(2, "Pad's constant_value")
        raw_axes = imp.const(3, "Pad's axes") if imp.opset >= 18 else None
        axes = list(range(rank)) if raw_axes is None else \
            [int(v) for v in np.asarray(raw_axes).reshape(-1)]
    for ax in axes:
        if not -rank <= ax < rank:
            raise imp.error(f"axis {ax} is out of range for {x.type}")
    axes = [ax % rank for ax in axes]
    if len(set(axes)) != len(axes) or len(pads) != 2 * len(axes):
        raise imp.error(f"pads {pads} must hold a begin and an end count for each of the "
                        f"{len(axes)} distinct axes {axes}")
    begins, ends = [0] * rank, [0] * rank
    for i, ax in enumerate(axes):
        begins[ax], ends[ax] = pads[i], pads[i + len(axes)]
    for k in range(rank):
        if begins[k] + ends[k] < -x.type.shape[k]:
            raise imp.error(f"pads {pads} crop more than the {x.type.shape[k]} elements of "
                            f"axis {k} of {x.type}")
    if value is not None and np.asarray(value).size != 1:
        raise imp.error(f"constant_value must be one value, got shape "
                        f"{list(np.asarray(value).shape)}")
    return [pad(imp, x, begins, ends, mode, value)]


@handler("CenterCropPad")
def _center_crop_pad(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    rank = x.type.rank
    shape = [int(v) for v in np.asarray(imp.const(1, "CenterCropPad's shape")).reshape(-1)]
    axes = [int(v) for v in _attrs(node).get("axes", range(rank))]
    if len(axes) != len(shape) or any(not -rank <= ax < rank for ax in axes) \
            or min(shape, default=0) < 0:
        raise imp.error(f"shape {shape} must give one size >= 0 for each of the axes {axes} "
                        f"of {x.type}")
    begins, ends = [0] * rank, [0] * rank
    for ax, want in zip(axes, shape):
        ax %= rank
        diff = want - x.type.shape[ax]
        # ONNX centers with the odd element at the end, padding and cropping alike.
        half = abs(diff) // 2
        sign = 1 if diff >= 0 else -1
        begins[ax], ends[ax] = sign * half, sign * (abs(diff) - half)
    return [pad(imp, x, begins, ends, "constant")]
