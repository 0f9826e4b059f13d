"""`quantize-kv`: store an LLM's key/value cache in fp8 or int8, with its scales.

The functions this applies to are the ones `mplower import CKPT_DIR` writes (docs/hf.md): their
results named `present.{i}.key` / `present.{i}.value` (mp.output_names) are the cache, and a
decode step reads the cache it was given as the arguments `past_key_values.{i}.key` / `.value`,
joined with the new token's keys and values by an mp.concat along the positions. The pass makes
the cache narrow where it is stored: the present results and the past arguments take the format
(f8E4M3FN or i8), each with its scales beside it where the scales are per position, and
attention reads the dequantized cache, the current tokens' own keys and values included, so a
decode step still reproduces the prefill's last logits under the quantized cache.

Scales follow the serving stacks' conventions:

- `granularity=tensor`: one static scale per layer for the keys and one for the values,
  amax / fmax (fmax 448 for f8E4M3FN, 127 for i8) from the calibrated range of the cache
  (`calibrate`'s `mp.range` on the presents of any function: the largest magnitude over them),
  the k_scale / v_scale of vLLM's fp8 KV cache and of TensorRT Model Optimizer's calibrated
  checkpoints. The scales are module constants (the quantize/dequantize attributes), so the
  signature gains no argument.
- `granularity=head`: dynamic, one scale per sequence, KV head and position: the amax over the
  head's head_dim values of that position's key (value), computed when the token's keys are
  made and stored with them (LMDeploy's online int8 KV cache scales per head and token too,
  asymmetrically; these are symmetric, as vLLM's fp8 scales are).
- `granularity=token`: dynamic, one scale per sequence and position over all KV heads, vLLM's
  per-token dynamic fp8 scaling (QuantFP8 per token) applied to the [tokens, kv_heads *
  head_dim] rows.

A dynamic scale is max(amax / fmax, 1 / (fmax * 512)), the floor vLLM's QuantFP8 uses
(_FP8_MIN_SCALING_FACTOR) so that an all-zero row has a positive scale. Its scales are f32
values of shape [B, kv_heads, T, 1] (head) or [B, 1, T, 1] (token), T the positions, results
`present.{i}.key_scale` / `.value_scale` right after their cache, and in a decode step the
arguments `past_key_values.{i}.key_scale` / `.value_scale` right after theirs.

Rounding is the mp.quantize op's (round to nearest even, saturating): a static scale is its
attribute; a dynamic one divides first (`mp.div`, f32, which is what mp.quantize does with an
attribute scale) and quantizes with scale 1. Dequantization is mp.dequantize (times the stored
scale), so the executor emulates the stored cache exactly and `mplower run` reports the drift of
each quantize and dequantize like any other op.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from mplower.dialect.plan import OUTPUT_NAMES
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import ARG, Function, Module, Value
from mplower.ir.opdef import OPS, check_attrs
from mplower.ir.types import DenseAttr, TensorType, tensor
from mplower.lowering.calibration import ARG_ATTRS, range_of
from mplower.numerics.formats import FORMATS
from mplower.pass_manager import Pass, PassContext, PipelineError, option, register_pass

KV_FORMATS = ("f8E4M3FN", "i8")
GRANULARITIES = ("tensor", "head", "token")
_PRESENT = re.compile(r"present\.(\d+)\.(key|value)$")
_WIDE = ("f32", "bf16", "f16")
# vLLM's QuantFP8: _FP8_MIN_SCALING_FACTOR = 1 / (fp8 max * 512), the least dynamic scale.
_MIN_SCALE_DIVISOR = 512.0


@dataclass
class _Site:
    """One cache result of a function: `name` (present.{i}.key), its position among the
    results, the tokens' new keys or values `new`, and in a decode step the past argument and
    the mp.concat that joins them."""

    name: str
    position: int
    new: Value
    past: int | None = None
    concat: int | None = None


def past_name(name: str) -> str:
    """present.{i}.key -> past_key_values.{i}.key (the decode step's argument)."""
    return "past_key_values." + name.removeprefix("present.")


def cache_sites(f: Function) -> list[_Site]:
    """The present key/value results of `f`, each with what produces it."""
    names = f.attrs.get(OUTPUT_NAMES)
    if not isinstance(names, tuple):
        return []
    outs = f.operands(f.return_node)
    sites = []
    for pos, name in enumerate(names):
        if not isinstance(name, str) or not _PRESENT.match(name) or pos >= len(outs):
            continue
        v = outs[pos]
        if f.op(v[0]) == "mp.concat":
            joined = f.operands(v[0])
            first = joined[0][0]
            if (len(joined) == 2 and f.op(first) == ARG
                    and f.data(first)["name"] == past_name(name)):
                sites.append(_Site(name, pos, joined[1], first, v[0]))
                continue
        sites.append(_Site(name, pos, v))
    return sites


def _const(f: Function, value: float, at: dict[str, int]) -> Value:
    t = tensor((), "f32")
    dense = DenseAttr(np.asarray(value, np.float32), t)
    return (f.create_op("mp.constant", [], [t], {"value": dense}, name_hint="c", **at), 0)


def _emit(f: Function, op: str, operands: list[Value], attrs: dict[str, Any],
          at: dict[str, int], hint: str, declared: TensorType | None = None) -> Value:
    """An op placed by `at` (create_op's before= or after=, ops made one after another at the
    same place keep their order), its result type from the op table's shape rule."""
    opdef = OPS[op]
    ins = [f.type_of(v) for v in operands]
    types = opdef.infer(ins, check_attrs(opdef, attrs), [declared] if declared else [])
    return (f.create_op(op, operands, list(types), attrs, name_hint=hint, **at), 0)


@register_pass
@dataclass
class QuantizeKV(Pass):
    """Store the key/value cache of an imported LLM in fp8 or int8, with its scales.

    The cache is the `present.{i}.key|value` results and a decode step's
    `past_key_values.{i}.key|value` arguments (docs/hf.md). `granularity`: tensor (one static
    scale per layer for keys and one for values, amax / fmax from calibrate's ranges, as vLLM's
    k_scale/v_scale), head (dynamic, per sequence, KV head and position) or token (dynamic, per
    sequence and position over all KV heads, vLLM's per-token fp8 scaling). Dynamic scales are
    stored beside the cache: f32 results `present.{i}.key_scale` / `.value_scale` and decode
    arguments `past_key_values.{i}.key_scale` / `.value_scale`, right after their cache.
    Attention reads the dequantized cache; rounding is mp.quantize's (saturating)."""

    name: ClassVar[str] = "quantize-kv"
    statistics: ClassVar[dict[str, str]] = {
        "caches-quantized": "key and value caches stored narrow (per function and layer)",
        "scale-arguments": "scale arguments added to decode steps"}
    examples: ClassVar[tuple[str, ...]] = (
        "ir_examples/llm/tiny_llama.ir --pass='quantize-kv{granularity=token}'",
        "ir_examples/llm/tiny_llama.ir --pass='quantize-kv{format=i8 granularity=head}'")
    format: str = option("f8E4M3FN", "storage format of the cache: f8E4M3FN or i8")
    granularity: str = option("tensor", "tensor (static, from calibrate), head or token "
                                        "(dynamic, computed per position)")

    def __post_init__(self) -> None:
        if self.format not in KV_FORMATS:
            raise PipelineError(f"quantize-kv: format must be one of {', '.join(KV_FORMATS)}, "
                                f"got '{self.format}'")
        if self.granularity not in GRANULARITIES:
            raise PipelineError(f"quantize-kv: granularity must be one of "
                                f"{', '.join(GRANULARITIES)}, got '{self.granularity}'")

    def run(self, module: Module, ctx: PassContext) -> None:
        sites = {name: cache_sites(f) for name, f in module.functions.items()}
        if not any(sites.values()):
            raise DiagnosticError.at(module.loc, (
                "quantize-kv: no function has a key/value cache (results named "
                "present.{i}.key / present.{i}.value, as `mplower import CKPT_DIR` writes)"))
        for name, found in sites.items():
            f = module.functions[name]
            for s in found:
                elem = f.type_of(s.new).elem
                if elem not in _WIDE:
                    raise DiagnosticError.at(f.data(s.new[0])["loc"], (
                        f"quantize-kv: {s.name} of @{name} is already {elem}; the pass "
                        f"quantizes a cache of {', '.join(_WIDE)}"))
        static = self._static_scales(module, sites) if self.granularity == "tensor" else {}
        for name, found in sites.items():
            f = module.functions[name]
            results = list(f.operands(f.return_node))
            names = list(f.attrs[OUTPUT_NAMES])
            extra: dict[int, tuple[str, Value]] = {}
            for s in found:
                stored, scale = self._rewrite(f, s, static.get(s.name), ctx)
                results[s.position] = stored
                if scale is not None:
                    extra[s.position] = (s.name + "_scale", scale)
                ctx.stat("caches-quantized")
            outs, out_names = [], []
            for pos, (v, n) in enumerate(zip(results, names, strict=True)):
                outs.append(v)
                out_names.append(n)
                if pos in extra:
                    out_names.append(extra[pos][0])
                    outs.append(extra[pos][1])
            ret = f.return_node
            for pos, v in enumerate(outs):
                f.set_operand(ret, pos, v)
            f.result_types = [f.type_of(v) for v in outs]
            f.attrs[OUTPUT_NAMES] = tuple(out_names)

    def _static_scales(self, module: Module, sites: dict[str, list[_Site]]) -> dict[str, float]:
        """present name -> amax / fmax over every function's calibrated range of it."""
        amax: dict[str, float] = {}
        for name, found in sites.items():
            f = module.functions[name]
            for s in found:
                r = range_of(f, s.new)
                if r is not None:
                    amax[s.name] = max(amax.get(s.name, 0.0), abs(r[0]), abs(r[1]))
        fmax = FORMATS[self.format].max_finite
        out = {}
        for name, found in sites.items():
            for s in found:
                if s.name not in amax:
                    f = module.functions[name]
                    raise DiagnosticError.at(f.data(s.new[0])["loc"], (
                        f"quantize-kv: granularity=tensor takes its static scales from "
                        f"calibration, and {s.name} has no calibrated range in any function; "
                        f"run calibrate{{func={name} data=...}} first, or use granularity=head "
                        f"or token (scales computed per position)"))
                a = amax[s.name]
                # float32 as the attribute holds it; an all-zero cache takes scale 1 (any
                # positive scale is exact for zeros).
                out[s.name] = float(np.float32(a / fmax)) if a > 0 else 1.0
        return out

    def _rewrite(self, f: Function, s: _Site, static: float | None,
                 ctx: PassContext) -> tuple[Value, Value | None]:
        """Quantize the site's new keys/values, store them (joined with the past in a decode
        step), and give attention the dequantized cache. Returns the stored cache and its
        scales (None for a static scale)."""
        # A decode step's ops go before the concat they replace; a prefill's right after the
        # keys/values are made, before attention reads them.
        at = {"before": s.concat} if s.concat is not None else {"after": s.new[0]}
        wide = f.type_of(s.new)
        readers = [(n, p) for n, p in f.uses((s.concat, 0) if s.concat is not None else s.new)
                   if n != f.return_node]
        q, scale = self._quantize(f, s.new, static, at, s.name)
        stored, scales = q, scale
        if s.past is not None:
            ptype = f.type_of((s.past, 0))
            f.set_result_type(s.past, 0, ptype.with_elem(self.format))
            stored = _emit(f, "mp.concat", [(s.past, 0), q], {"axis": 2}, at, s.name)
            if scale is not None:
                st = f.type_of(scale)
                arg = self._scale_arg(f, s.past, tensor(st.shape[:2] + ptype.shape[2:3] + (1,),
                                                        "f32"))
                ctx.stat("scale-arguments")
                scales = _emit(f, "mp.concat", [(arg, 0), scale], {"axis": 2}, at,
                               s.name + "_scale")
        dq = _emit(f, "mp.dequantize", [stored], {"scale": static or 1.0}, at, s.name + ".dq",
                   declared=f.type_of(stored).with_elem(wide.elem))
        if scales is not None:
            dq = _emit(f, "mp.mul", [dq, scales], {}, at, s.name + ".dq")
        for n, p in readers:
            f.set_operand(n, p, dq)
        if s.concat is not None:
            f.set_operand(f.return_node, s.position, stored)
            f.erase(s.concat)
            f.rename(stored[0], s.name)  # the stored cache keeps the value's name
        return stored, scales

    def _quantize(self, f: Function, x: Value, static: float | None, at: dict[str, int],
                  hint: str) -> tuple[Value, Value | None]:
        """x in the format: with the static scale, or divided by its dynamic scale (returned)."""
        narrow = f.type_of(x).with_elem(self.format)
        if static is not None:
            return _emit(f, "mp.quantize", [x], {"scale": static}, at, hint + ".q", narrow), None
        fmax = FORMATS[self.format].max_finite
        axes = [3] if self.granularity == "head" else [1, 3]
        amax = _emit(f, "mp.reduce_max", [_emit(f, "mp.abs", [x], {}, at, hint + ".abs")],
                     {"axes": axes, "keepdims": True}, at, hint + ".amax")
        scale = _emit(f, "mp.div", [amax, _const(f, fmax, at)], {}, at, hint + ".over_fmax")
        scale = _emit(f, "mp.maximum", [scale, _const(f, 1.0 / (fmax * _MIN_SCALE_DIVISOR), at)],
                      {}, at, hint + ".scale")
        y = _emit(f, "mp.div", [x, scale], {}, at, hint + ".scaled")
        return _emit(f, "mp.quantize", [y], {"scale": 1.0}, at, hint + ".q", narrow), scale

    def _scale_arg(self, f: Function, past: int, t: TensorType) -> int:
        """A new argument `<past>_scale` of type `t`, placed right after `past`."""
        name = f.data(past)["name"] + "_scale"
        if f.fresh_name(name) != name:
            raise DiagnosticError.at(f.data(past)["loc"], (
                f"quantize-kv: @{f.name} already has a value named %{name}"))
        arg = f.add_arg(name, t, f.data(past)["loc"])
        f.args.remove(arg)
        f.args.insert(f.args.index(past) + 1, arg)
        table = f.attrs.get(ARG_ATTRS)
        if isinstance(table, tuple):  # keep the per-argument table aligned with the arguments
            at = f.attrs_of(past)["index"] + 1
            f.attrs[ARG_ATTRS] = table[:at] + ({},) + table[at:]
        for i, a in enumerate(f.args):
            f.set_attr(a, "index", i)
        return arg
