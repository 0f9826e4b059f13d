"""The kernel of mp.scaled_quant: a scale recipe run on the data, and what it did.

Each call is one executed step. `current` and `block` take their scales from the data of the
step; `static` from the calibrated amax on the op; `delayed` from Transformer Engine's amax
history (mplower.numerics.mx.DelayedScaling), which this kernel keeps: the step quantizes with
the scale of the history so far, then records its own amax, so the history advances once per
executed step (and a program run twice on the same data gives two different first results, as
a training loop under delayed scaling does). `ScaleStats` is the last step's account, which the
run report shows per op: the recipe, the amax and scale used, the fraction of the values that
saturated or flushed to zero, and the bytes of scales per element.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mplower.ir.types import TensorType
from mplower.numerics import mx, rounding
from mplower.numerics.accum import matmul_limited_accum
from mplower.numerics.rounding import Counts


@dataclass
class ScaleStats:
    recipe: str
    scale_format: str
    amax: float  # of the tensor (the largest block amax for block recipes)
    scale: float | None  # the per-tensor decode scale (1 / encode factor); None for blocks
    saturated: float  # fraction of the values
    flushed: float
    scale_bytes_per_element: float
    tensor_scale: float | None = None  # NVFP4's second level


def scaled_quant_kernel(attrs: dict, out_t: TensorType,
                        amax_of: Callable[[], float] | None = None,
                        overwrite: bool = False, counted: bool = True) -> tuple[
        Callable[[list[np.ndarray]], tuple[np.ndarray, Counts | None]], list[ScaleStats]]:
    """The kernel and the one-element list its last step's ScaleStats is written to.
    `amax_of` gives the amax of the operand where the step that computed it took it already
    (run_lowered's amax fusion), instead of a pass over it (per-tensor recipes). With
    `overwrite` the kernel may write its values over its float32 operand, which nothing else
    reads (rounding.scale_round's `overwrite`). Without `counted` (run_lowered, which keeps
    no counts or statistics) a per-tensor rounding whose scaled values are all finite takes
    no counts: the kernel returns None for them and leaves the ScaleStats list as it was."""
    elem, recipe = out_t.elem, attrs["recipe"]
    last: list[ScaleStats] = []
    delayed = None
    if recipe == "delayed":
        start = mx.encode_factor(attrs["amax"], elem, attrs["margin"], pow2=attrs["pow2"])
        delayed = mx.DelayedScaling(elem, attrs["history"], attrs["amax_compute"],
                                    attrs["margin"], scale=start, pow2=attrs["pow2"])

    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        x = np.ascontiguousarray(xs[0], dtype=np.float32)
        amax = rounding.amax(x) if amax_of is None or recipe == "block" else amax_of()
        scale, per_element, tensor_scale = None, 4 / max(1, x.size), None
        if recipe == "block":
            r = mx.quantize_blocked(x, elem, tuple(attrs["block"]), attrs["scale_format"])
            amax = float(np.max(r.amax)) if r.amax.size else 0.0
            values, counts = r.values, r.counts
            per_element, tensor_scale = r.scale_bytes_per_element, r.tensor_scale
        else:
            if delayed is not None:
                sf = delayed.scale
                delayed.update(amax)
            else:
                sf = mx.encode_factor(amax if recipe == "current" else attrs["amax"], elem,
                                      attrs["margin"], pow2=attrs["pow2"])
            if elem in rounding.MX_ROUNDING_FORMATS:
                r = mx.quantize_per_tensor(x, elem, sf)
                values, counts = r.values, r.counts
            else:  # quantize_per_tensor's values and counts in one pass over memory
                values, counts = rounding.scale_round(x, elem, sf, amax, overwrite, counted)
                if counts is None:
                    return values, None
            scale = float(np.float32(1) / np.float32(sf))
        n = max(1, x.size)
        last[:] = [ScaleStats(recipe, attrs["scale_format"], amax, scale, counts.overflow / n,
                              counts.underflow / n, per_element, tensor_scale)]
        return values, counts
    return run, last


def limited_accum_matmul(bits: int, interval: int) -> Callable[[np.ndarray, np.ndarray],
                                                                  np.ndarray]:
    """np.matmul (batch broadcasting, 2-D and up) with the limited accumulator of
    mplower.numerics.accum, for a GEMM annotated mp.accum_bits / mp.promote_every."""
    def run(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError("mp.accum_bits needs matmul operands of rank 2 or more")
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a3 = np.broadcast_to(a, batch + a.shape[-2:]).reshape(-1, *a.shape[-2:])
        b3 = np.broadcast_to(b, batch + b.shape[-2:]).reshape(-1, *b.shape[-2:])
        y = np.stack([matmul_limited_accum(x, w, bits, interval) for x, w in zip(a3, b3)])
        return y.reshape(batch + y.shape[-2:])
    return run
