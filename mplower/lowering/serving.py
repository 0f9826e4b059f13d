"""Serving a decoder LLM: the prefill and decode phases of a module with @prefill and @decode.

A module imported from a checkpoint folder (mplower.hf) has `@prefill(input_ids BxS)` and
`@decode(input_ids Bx1, past_key_values.{i}.key/value [B, kv_heads, C, head_dim], ...)`. Serving
runs them in two phases: the prompt's pass (time to first token, mostly compute-bound) and one
decode step per generated token (inter-token latency, bound by reading the weights and the KV
cache). This module prices both with the fusion-aware cost model (mplower.lowering.cost) at a
batch B and context C other than the ones the module was written for:

- Re-shaping: a copy of the function with its arguments re-typed (the batch is the leading
  dimension of every argument that has the first one's; the context is axis 2 of the cache
  arguments, as HF's cache lays it out) and every result type re-inferred by the op's own shape
  rule, as set-batch does. A reshape's declared shape follows the dimensions of its operand
  that changed (its dimensions are aligned with the operand's by equal products); a slice over
  all of a dimension widens with it. What cannot follow is refused at the op. @prefill's prompt
  length is not re-shaped: its causal mask and rotary tables are constants of that length, so
  the prompt is the module's (`mplower import --seq P`).
- The cache: every argument of @decode after the first whose axis 2 has the context's size
  (keys, values, and per-position scales a KV-cache quantization adds beside them). Its bytes
  per token of context are what the arguments' element types say, so a pass that stores the
  cache narrower shrinks `kv_cache_bytes_per_token` with no change here. The decode step reads
  the whole cache, appends the new position in place, and attention's work grows with C.
- End to end (`prompt` P, `generate` G): the first token comes from @prefill, each other one
  from a decode step at contexts P, P+1, ..., P+G-2; more than `MAX_STEPS_PRICED` steps are
  priced at that many evenly spaced contexts and summed piecewise linearly between them.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import RETURN, Function, Module
from mplower.ir.opdef import OpError, attr_ints, check_attrs, lookup
from mplower.ir.types import TensorType, tensor
from mplower.lowering.cost import Cost, plan_cost
from mplower.lowering.target import Target

PREFILL, DECODE = "prefill", "decode"
PHASES = (PREFILL, DECODE)
CONTEXT_AXIS = 2  # of a cache argument: [batch, kv_heads, positions, head_dim]
MAX_STEPS_PRICED = 9


def cache_args(f: Function) -> list[int]:
    """The argument nodes of decode function `f` that hold the KV cache (and any per-position
    scales beside it): after the first, those whose axis 2 has the first cache's size."""
    args = [(a, f.type_of((a, 0))) for a in f.args[1:]]
    if not args or args[0][1].rank <= CONTEXT_AXIS:
        return []
    context = args[0][1].shape[CONTEXT_AXIS]
    return [a for a, t in args if t.rank > CONTEXT_AXIS and t.shape[CONTEXT_AXIS] == context]


def written_for(f: Function, phase: str) -> tuple[int, int]:
    """(batch, context) a decode function is written for; (batch, prompt) for prefill."""
    first = f.type_of((f.args[0], 0))
    if phase == PREFILL:
        return first.shape[0], first.shape[1]
    cache = cache_args(f)
    return first.shape[0], f.type_of((cache[0], 0)).shape[CONTEXT_AXIS]


def kv_bytes_per_token(f: Function) -> int:
    """Bytes the cache of decode function `f` holds per sequence and position of context."""
    batch, context = written_for(f, DECODE)
    return sum(f.type_of((a, 0)).nbytes for a in cache_args(f)) // (batch * context)


def check_phase_function(module: Module, phase: str) -> Function:
    """@prefill or @decode of `module`, refused (located) when missing or not of their form."""
    f = module.functions.get(phase)
    if f is None:
        raise DiagnosticError.at(module.loc, f"--phase {phase} needs a function @{phase} (a "
                                             f"module imported from a checkpoint folder has "
                                             f"@prefill and @decode: docs/hf.md)")
    first = f.type_of((f.args[0], 0)) if f.args else None
    if first is None or first.rank != 2:
        raise DiagnosticError.at(f.loc, f"@{phase}: its first argument must be the token ids "
                                        f"[batch, tokens]")
    if phase == DECODE and not cache_args(f):
        raise DiagnosticError.at(f.loc, "@decode has no KV-cache arguments (after the token "
                                        "ids, tensors [batch, kv_heads, context, head_dim])")
    return f


def retyped(f: Function, batch: int, context: int | None = None) -> Function:
    """A copy of `f` for `batch` sequences (and, for a decode function, `context` cached
    positions), every result type re-inferred; `f` itself when nothing changes. Raises a
    DiagnosticError at the op that cannot follow."""
    old_batch = f.type_of((f.args[0], 0)).shape[0]
    cache = set(cache_args(f)) if context is not None else set()
    new_args: dict[int, TensorType] = {}
    for a in f.args:
        t = f.type_of((a, 0))
        shape = list(t.shape)
        if shape and shape[0] == old_batch:
            shape[0] = batch
        if a in cache:
            shape[CONTEXT_AXIS] = context
        if tuple(shape) != t.shape:
            new_args[a] = tensor(tuple(shape), t.elem, t.encoding)
    if not new_args:
        return f
    g = copy.deepcopy(f)
    written = {n: list(g.types(n)) for n in g.args + g.ops()}
    for a, t in new_args.items():
        g.set_result_type(a, 0, t)
    for n in g.ops():
        d = g.data(n)
        if d["op"] == RETURN:
            g.result_types = g.operand_types(n)
            break
        ins = g.operand_types(n)
        old_ins = [written[u][r] for u, r in g.operands(n)]
        if ins == old_ins:
            continue
        opdef = lookup(d["op"])
        attrs = check_attrs(opdef, d["attrs"])
        try:
            if d["op"] == "mp.slice":
                _widen_slice(g, n, old_ins[0].shape, ins[0].shape)
                attrs = check_attrs(opdef, d["attrs"])
            declared = list(d["types"])
            if d["op"] == "mp.reshape":
                t = declared[0]
                declared = [tensor(_reshaped(old_ins[0].shape, ins[0].shape, t.shape), t.elem,
                                   t.encoding)]
            out = opdef.infer(ins, attrs, declared)
        except (OpError, _Unfollowable) as e:
            raise DiagnosticError.at(d["loc"], f"cannot re-shape @{f.name} for batch {batch}"
                                               f"{'' if context is None else f' context {context}'}"
                                               f": {getattr(e, 'message', e)}; import the "
                                               f"checkpoint with --batch/--context") from None
        for i, t in enumerate(out):
            g.set_result_type(n, i, t)
    return g


class _Unfollowable(ValueError):
    pass


def _widen_slice(g: Function, n: int, old: tuple[int, ...], new: tuple[int, ...]) -> None:
    """A slice that took all of a dimension that changed takes all of its new size."""
    attrs = g.attrs_of(n)
    starts, ends = list(attr_ints(attrs["starts"])), list(attr_ints(attrs["ends"]))
    steps = attr_ints(attrs["steps"]) if "steps" in attrs else (1,) * len(starts)
    for ax, (o, w) in enumerate(zip(old, new, strict=True)):
        if o == w:
            continue
        if (starts[ax], steps[ax]) != (0, 1) or ends[ax] < o:
            raise _Unfollowable(f"mp.slice takes part of axis {ax}, whose size changes")
        ends[ax] = w
    g.set_attr(n, "ends", tuple(ends))


def _reshaped(old_in: tuple[int, ...], new_in: tuple[int, ...],
              out: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a reshape of `old_in` to `out` takes for the operand shape `new_in`: the
    dimensions are aligned by equal products, and an output group takes the new size of its
    operand group where it holds one dimension that is not 1 (or is one dimension)."""
    if 0 in old_in or 0 in out:
        raise _Unfollowable("a reshape of an empty tensor")
    result, i, j = list(out), 0, 0
    while i < len(old_in) and j < len(out):
        gi, gj, px, py = [i], [j], old_in[i], out[j]
        i, j = i + 1, j + 1
        while px != py:
            if px < py and i < len(old_in):
                gi.append(i)
                px, i = px * old_in[i], i + 1
            elif py < px and j < len(out):
                gj.append(j)
                py, j = py * out[j], j + 1
            else:
                raise _Unfollowable("mp.reshape's dimensions do not align with its operand's")
        if all(old_in[k] == new_in[k] for k in gi):
            continue
        wide = [k for k in gj if out[k] != 1] or gj
        if len(wide) != 1:
            raise _Unfollowable("mp.reshape splits a dimension whose size changes")
        result[wide[0]] = math.prod(new_in[k] for k in gi)
    if any(old_in[k] != new_in[k] for k in range(i, len(old_in))):
        raise _Unfollowable("mp.reshape's dimensions do not align with its operand's")
    return tuple(result)


@dataclass(frozen=True)
class Step:
    """One call of a phase function at a serving point, priced."""

    function: Function  # the (re-typed) function that was priced
    cost: Cost
    batch: int
    tokens: int  # prompt length (prefill) or context (decode)

    @property
    def time_s(self) -> float:
        return self.cost.time_s


def price(module: Module, phase: str, target: Target, batch: int | None = None,
          context: int | None = None) -> Step:
    """@prefill at `batch` (its own prompt length), or @decode at `batch` and `context`; each
    defaults to what the function is written for."""
    return price_function(check_phase_function(module, phase), phase, target, batch, context)


def price_function(f: Function, phase: str, target: Target, batch: int | None = None,
                   context: int | None = None) -> Step:
    """As `price`, for the phase function `f` itself."""
    b0, c0 = written_for(f, phase)
    batch = batch or b0
    if phase == PREFILL:
        g = retyped(f, batch)
        return Step(g, plan_cost(g, target), batch, c0)
    context = context or c0
    g = retyped(f, batch, context)
    return Step(g, plan_cost(g, target, frozenset(cache_args(g))), batch, context)


def generation_time(module: Module, target: Target, batch: int, prompt: int,
                    generate: int) -> tuple[float, float]:
    """(time to first token, total time) for `generate` tokens after a `prompt`-token prompt:
    @prefill once, then decode steps at contexts prompt .. prompt + generate - 2."""
    ttft = price(module, PREFILL, target, batch).time_s
    steps = generate - 1
    if steps <= 0:
        return ttft, ttft
    n = min(steps, MAX_STEPS_PRICED)
    contexts = sorted({prompt + round(i * (steps - 1) / max(n - 1, 1)) for i in range(n)})
    times = [price(module, DECODE, target, batch, c).time_s for c in contexts]
    total = 0.0
    for (c0, t0), (c1, t1) in zip(zip(contexts, times), zip(contexts[1:], times[1:])):
        # The steps c0 .. c1 - 1, their time linear from t0 at c0 to t1 at c1.
        total += (c1 - c0) * t0 + (t1 - t0) * (c1 - c0 - 1) / 2
    return ttft, ttft + total + times[-1]
