"""Scaling plans: how a scaled narrow float gets its scales, per operand of a GEMM.

A `Scaling` is what a policy sheet's `[scaling]` table and the `scale-recipes` pass's options
say: the recipe of the activations (static from calibrate's amax, current, delayed with TE's
amax history, or block), that of the weights (channel: one scale per output channel, as
TensorRT's fp8 weights; current: one per weight tensor; or block),
the block size along the contraction axis (32 for MX, 16 for NVFP4, 128 for DeepSeek-V3's 1x128
activation tiles), the 2-D block of weights (128 for 128x128 tiles), and the format of block
scales (f32, e8m0 for MX, nvfp4). `blocks_for` turns that into the block shape of one operand:
blocks run along the axis a matmul or conv contracts (the last axis of x in x @ w, the first of
w's last two; the channel axis of a conv), because that is where a tensor core applies them.
Biases and accumulators are not scaled: the plan only replaces the casts into the GEMM's
compute format.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from mplower.dialect.mp import SCALE_FORMATS

# SCALING carries a sheet's [scaling] from assign-precision to insert-casts and legalize (a
# dictionary of the Scaling fields), so that they need not read the sheet again.
from mplower.dialect.mp.quantization import MAX_MARGIN
from mplower.dialect.plan import SCALING
from mplower.ir.opdef import OpError, attr_bool, attr_int, attr_str

ACTIVATION_RECIPES = ("static", "current", "delayed", "block")
WEIGHT_RECIPES = ("current", "channel", "block")


@dataclass(frozen=True)
class Scaling:
    recipe: str = "current"  # activations
    weights: str = "channel"  # one scale per output channel (a GEMM's N, a conv's O)
    block_size: int = 0  # along the contraction axis; 0 with per-tensor recipes
    weight_block_size: int = 0  # > 0: weights in square 2-D blocks of this size
    scale_format: str = "f32"
    history: int = 1024
    amax_compute: str = "max"
    margin: int = 0  # 0..MAX_MARGIN
    pow2: bool = False  # per-tensor scales rounded down to a power of two
    accum_bits: int = 0  # > 0: Hopper-style limited accumulator of this many bits (~14)
    promote_every: int = 128  # ... promoted to f32 every this many elements of K

    def attr(self) -> dict[str, Any]:
        """The dictionary attribute that `of` reads back."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def of(cls, value: Any) -> Scaling:
        """A Scaling from its dictionary attribute; OpError on a malformed one."""
        names = {f.name: f.type for f in fields(cls)}
        if not isinstance(value, dict) or set(value) - set(names):
            raise OpError(f"{SCALING} must be a dictionary of {', '.join(names)}")
        read = {"int": attr_int, "bool": attr_bool, "str": attr_str}
        scaling = cls(**{k: read[names[k]](v) for k, v in value.items()})
        if (problem := scaling.problem()) is not None:
            raise OpError(f"{SCALING}: {problem}")
        return scaling

    def problem(self) -> str | None:
        """Why this combination cannot be run, or None."""
        if self.recipe not in ACTIVATION_RECIPES:
            return f"recipe must be one of {', '.join(ACTIVATION_RECIPES)}, got '{self.recipe}'"
        if self.weights not in WEIGHT_RECIPES:
            return f"weights must be one of {', '.join(WEIGHT_RECIPES)}, got '{self.weights}'"
        if self.scale_format not in SCALE_FORMATS:
            return (f"scale_format must be one of {', '.join(SCALE_FORMATS)}, "
                    f"got '{self.scale_format}'")
        blocked = self.recipe == "block" or self.weights == "block"
        if blocked and self.block_size < 1 and self.weight_block_size < 1:
            return "a block recipe needs block_size (or weight_block_size for the weights)"
        if self.recipe == "block" and self.block_size < 1:
            return "recipe = \"block\" needs block_size >= 1"
        if self.scale_format != "f32" and not (self.recipe == "block" and
                                               self.weights == "block"):
            return f"scale_format = \"{self.scale_format}\" needs block recipes for both"
        if self.amax_compute not in ("max", "most_recent"):
            return f"amax_compute must be max or most_recent, got '{self.amax_compute}'"
        if self.history < 1:
            return f"history must be at least 1, got {self.history}"
        if not 0 <= self.margin <= MAX_MARGIN:
            return f"margin must be in 0..{MAX_MARGIN}, got {self.margin}"
        if not 0 <= self.accum_bits <= 24 or self.promote_every < 1:
            return (f"accum_bits must be in 0..24 (0: exact f32) and promote_every >= 1, got "
                    f"{self.accum_bits} and {self.promote_every}")
        return None


def contraction_axis(op: str, operand: int, rank: int) -> int:
    """The axis of operand `operand` that `op` sums over."""
    if op == "mp.conv2d":
        return 1  # x: N C H W, w: O I kh kw
    return rank - 1 if operand == 0 or rank == 1 else rank - 2


def blocks_for(scaling: Scaling, op: str, operand: int, shape: tuple[int, ...],
               is_weight: bool) -> tuple[int, ...] | None:
    """The block shape of one GEMM operand, or None for one scale per tensor."""
    recipe = scaling.weights if is_weight else scaling.recipe
    rank = len(shape)
    axis = contraction_axis(op, operand, rank)
    if recipe == "channel" and rank >= 2:
        # One scale per output channel: a block spanning every axis but the one the GEMM
        # keeps (O of a conv's O I kh kw, N of x @ w's K x N), as TensorRT's per-channel fp8
        # weights and ONNX's per-axis QuantizeLinear.
        out = 0 if op == "mp.conv2d" else (rank - 1 if axis == rank - 2 else rank - 2)
        return tuple(1 if i == out else d for i, d in enumerate(shape))
    if recipe != "block":
        return None
    block = [1] * rank
    if is_weight and scaling.weight_block_size > 0 and rank >= 2:
        other = 0 if op == "mp.conv2d" else (rank - 1 if axis == rank - 2 else rank - 2)
        block[axis] = block[other] = scaling.weight_block_size
    else:
        block[axis] = scaling.block_size
    return tuple(block)
