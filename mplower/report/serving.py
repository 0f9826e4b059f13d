"""`mplower report --phase prefill|decode`: the precision sheet of one serving point.

The sheet is that of @prefill or @decode re-shaped to the point and priced with the KV cache in
place (mplower.lowering.serving), each fused kernel marked compute-, memory- or launch-bound.
Its summary adds what serving is judged by:

- `ttft_s`: time to first token, one @prefill call at the batch (its prompt length is the
  module's); `itl_s`: inter-token latency, one @decode step at the batch and context;
- `tokens_per_s`: generated tokens per second (batch / ITL) for decode; prompt tokens per
  second (batch x prompt / TTFT) for prefill; with `generate`, batch x generated tokens over
  the whole request (TTFT plus the decode steps at growing context, `itl_s` their mean);
- `weight_bytes`: the deploy-time constants the priced function reads per call, in their
  stored formats with their scales (an i4 weight is half a byte); `kv_cache_bytes_per_token`:
  per sequence and cached position, from the element types of @decode's cache arguments;
  `kv_cache_bytes`: the cache a decode step reads (per token x batch x context).
"""

from __future__ import annotations

from typing import Any

from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import Module
from mplower.lowering import serving
from mplower.lowering.serving import DECODE, PREFILL
from mplower.lowering.target import Target
from mplower.report.sheet import precision_sheet


def serving_sheet(module: Module, target: Target, phase: str, *, batch: int | None = None,
                  context: int | None = None, prompt: int | None = None,
                  generate: int | None = None) -> dict[str, Any]:
    """The sheet of `phase` at the point, with the serving summary (module docstring)."""
    step = serving.price(module, phase, target, batch, context)
    batch = step.batch
    sheet = precision_sheet(module, target, phase, measure=False, function=step.function,
                            cost=step.cost)
    has = {p: p in module.functions for p in serving.PHASES}
    prefill = step if phase == PREFILL else (
        serving.price(module, PREFILL, target, batch) if has[PREFILL] else None)
    decode = step if phase == DECODE else (
        serving.price(module, DECODE, target, batch, context) if has[DECODE] else None)
    kv = serving.kv_bytes_per_token(module.functions[DECODE]) if has[DECODE] else None
    ttft = prefill.time_s if prefill else None
    itl = decode.time_s if decode else None
    summary: dict[str, Any] = {
        "phase": phase, "batch": batch,
        "context": decode.tokens if decode else None,
        "prompt": prefill.tokens if prefill else None,
        "ttft_s": ttft, "itl_s": itl,
        "tokens_per_s": (batch / itl if phase == DECODE and itl
                         else batch * step.tokens / ttft if ttft else None),
        "weight_bytes": sum(g.weight_bytes for g in step.cost.groups),
        "kv_cache_bytes_per_token": kv,
        "kv_cache_bytes": kv * batch * decode.tokens if decode and kv is not None else None,
    }
    if prompt is not None and prefill is not None and prompt != prefill.tokens:
        raise DiagnosticError.at(
            module.functions[PREFILL].loc,
            f"--prompt {prompt}: @prefill is written for prompts of {prefill.tokens} tokens "
            f"(its causal mask and rotary tables are constants of that length); import the "
            f"checkpoint with --seq {prompt}")
    if generate is not None:
        if prefill is None or decode is None:
            raise DiagnosticError.at(module.loc, "--generate needs both @prefill and @decode")
        first, total = serving.generation_time(module, target, batch, prefill.tokens, generate)
        summary |= {"generate": generate, "e2e_s": total,
                    "itl_s": (total - first) / (generate - 1) if generate > 1 else None,
                    "tokens_per_s": batch * generate / total}
    sheet["summary"] |= summary
    return sheet
