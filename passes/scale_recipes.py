"""`scale-recipes`: scale the narrow-float operands of matmul and conv as the hardware does.

insert-casts turns an fp8/fp6/fp4 plan into plain casts, which saturate or flush whatever lies
outside the format's range. This pass replaces each cast into a GEMM's compute format by an
`mp.scaled_quant` that carries a scale recipe (mplower.lowering.scaling): per tensor from
calibrate's amax (static), from the tensor itself (current) or from Transformer Engine's amax
history (delayed); or per block along the contraction axis (fine-grained fp8, MX with E8M0
scales, NVFP4). Only casts whose every user is a matmul or conv are scaled, and a narrow conv's
bias is moved into an f32 add after it, so biases, residuals and accumulators stay wide. insert-casts runs it with the `[scaling]` table of the
module's policy sheet (the built-in fp8, fp8-block, mxfp8, mxfp4 and nvfp4 sheets have one), so
`mplower run` of such a plan is scaled without naming this pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.dialect.mp import CONTRACTIONS
from mplower.dialect.plan import ACCUM_BITS, PROMOTE_EVERY
from mplower.ir.diagnostics import Diagnostic, DiagnosticError
from mplower.ir.graph import Function, Module
from mplower.ir.types import tensor
from mplower.lowering.calibration import constant_nodes, range_of
from mplower.lowering.scaling import Scaling, blocks_for
from mplower.numerics.formats import MX_ELEMENT_FORMATS
from mplower.pass_manager import Pass, PassContext, option, register_pass


def _wide_conv_bias(f: Function, ctx: PassContext) -> None:
    """conv2d(x, w, cast(b)) in a narrow float -> conv2d(x, w) + reshape(b): the bias stays in
    its own (f32) format, added after the accumulator, as a tensor core's epilogue adds it."""
    for n in list(f.ops()):
        if f.op(n) != "mp.conv2d" or len(f.operands(n)) != 3:
            continue
        x, w, b = f.operands(n)
        if f.type_of(x).elem not in MX_ELEMENT_FORMATS or f.op(b[0]) != "mp.cast":
            continue
        d = f.data(n)
        (bias,) = f.operands(b[0])
        out, bt = d["types"][0], f.type_of(bias)
        if out.elem != bt.elem:  # the add would mix formats
            continue
        conv = f.create_op("mp.conv2d", [x, w], [out], dict(d["attrs"]), before=n,
                           name_hint=f"{d['name']}_nobias")
        shaped = f.create_op("mp.reshape", [bias], [tensor((bt.shape[0], 1, 1), bt.elem)],
                             before=n, name_hint=f"{d['name']}_bias")
        add = f.create_op("mp.add", [(conv, 0), (shaped, 0)], [out], before=n,
                          name_hint=d["name"])
        f.replace_all_uses((n, 0), (add, 0))
        name = d["name"]
        f.erase(n)
        f.rename(add, name)
        if not f.has_uses(b[0]):
            f.erase(b[0])
        ctx.stat("biases-kept-wide")


def apply_scaling(f: Function, ctx: PassContext, scaling: Scaling) -> None:
    """Replace the casts of `f` into a GEMM's narrow float format by mp.scaled_quant (and
    re-plan the mp.scaled_quant ops already there, so that the pass overrides a sheet)."""
    _wide_conv_bias(f, ctx)
    constants = constant_nodes(f)
    errors = []
    for n in list(f.ops()):
        d = f.data(n)
        if d["op"] not in ("mp.cast", "mp.scaled_quant") \
                or d["types"][0].elem not in MX_ELEMENT_FORMATS:
            continue
        users = f.uses((n, 0))
        if not users or any(f.op(u) not in CONTRACTIONS for u, _ in users):
            ctx.stat("casts-kept")
            continue
        (src,) = f.operands(n)
        t = d["types"][0]
        weight = src[0] in constants
        blocks = {blocks_for(scaling, f.op(u), pos, t.shape, weight) for u, pos in users}
        if len(blocks) > 1:  # two GEMMs contract it along different axes
            ctx.stat("casts-kept")
            continue
        block = blocks.pop()
        recipe = "block" if block else ("current" if weight else scaling.recipe)
        attrs = {"recipe": recipe, "margin": scaling.margin}
        if not block and scaling.pow2:
            attrs["pow2"] = True
        if block:
            attrs |= {"block": list(block), "scale_format": scaling.scale_format}
        if recipe in ("static", "delayed"):
            lo_hi = range_of(f, src)
            if lo_hi is None and recipe == "static":
                errors.append(Diagnostic(d["loc"], (
                    f"scale-recipes: {f.value_name(src)} has no calibrated range (mp.range) "
                    f"for the static recipe; run calibrate{{data=...}} first")))
                continue
            if lo_hi is not None:
                attrs["amax"] = float(max(abs(lo_hi[0]), abs(lo_hi[1])))
        if recipe == "delayed":
            attrs |= {"history": scaling.history, "amax_compute": scaling.amax_compute}
        name = d["name"]
        node = f.create_op("mp.scaled_quant", [src], [t], attrs, after=n, name_hint=name)
        f.replace_all_uses((n, 0), (node, 0))
        if scaling.accum_bits:  # the GEMMs it feeds accumulate as Hopper's fp8 tensor cores
            for u, _ in users:
                f.set_attrs(u, {ACCUM_BITS: scaling.accum_bits,
                                PROMOTE_EVERY: scaling.promote_every})
        f.erase(n)
        f.rename(node, name)
        ctx.stat("casts-scaled")
    if errors:
        raise DiagnosticError(*errors)


@register_pass
@dataclass
class ScaleRecipes(Pass):
    """Scale the fp8/fp6/fp4 operands of matmul and conv (mp.scaled_quant) by a recipe.

    Run after insert-casts. Activations: `recipe` static (calibrate's amax; run calibrate
    first), current, delayed (Transformer Engine's DelayedScaling: `history` steps,
    `amax_compute`, `margin`) or block; weights: `weights` channel (one scale per output
    channel, the default), current (one per tensor) or block. Blocks run along
    the contraction axis (`block_size`; 32 with scale_format=e8m0 is MX, 16 with nvfp4 is
    NVFP4), or for weights in square tiles of `weight_block_size` (128: DeepSeek-V3's 128x128).
    `accum_bits` > 0 makes those GEMMs accumulate in that many bits, promoted to f32 every
    `promote_every` elements of K (mp.accum_bits, mp.promote_every; mplower.numerics.accum).
    """

    name: ClassVar[str] = "scale-recipes"
    statistics: ClassVar[dict[str, str]] = {
        "casts-scaled": "casts into a GEMM's narrow float replaced by mp.scaled_quant",
        "casts-kept": "narrow-float casts left plain (a user is not a matmul/conv)",
        "biases-kept-wide": "conv biases moved out of a narrow-float conv into an f32 add",
    }
    examples: ClassVar[tuple[str, ...]] = (
        ("ir_examples/mlp.ir --pass='assign-precision{policy=bf16-fp8}' "
        "--pass=insert-casts --pass='scale-recipes{recipe=delayed history=16}'"),)
    recipe: str = option("current", "activations: static, current, delayed or block")
    weights: str = option("channel", "weights: channel (one scale per output channel), current "
                                     "(one per tensor) or block")
    block_size: int = option(0, "block length along the contraction axis (32 MX, 16 NVFP4)")
    weight_block_size: int = option(0, "weights in square blocks of this size (128: 128x128)")
    scale_format: str = option("f32", "format of block scales: f32, e8m0 (MX) or nvfp4")
    history: int = option(1024, "delayed: amax history length (steps)")
    amax_compute: str = option("max", "delayed: max of the history or most_recent")
    margin: int = option(0, "scale = fmt_max / amax / 2^margin")
    pow2: bool = option(False, "round per-tensor scales down to a power of two")
    accum_bits: int = option(0, "GEMM accumulator bits (0: exact f32; ~14: Hopper fp8, "
                                "DeepSeek-V3)")
    promote_every: int = option(128, "promote that accumulator to f32 every this many of K")

    def run(self, module: Module, ctx: PassContext) -> None:
        scaling = Scaling(self.recipe, self.weights, self.block_size, self.weight_block_size,
                          self.scale_format, self.history, self.amax_compute, self.margin,
                          self.pow2, self.accum_bits, self.promote_every)
        if (problem := scaling.problem()) is not None:
            raise DiagnosticError.at(module.loc, f"scale-recipes: {problem}")
        for f in module.functions.values():
            apply_scaling(f, ctx, scaling)
