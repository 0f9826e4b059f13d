"""What one call of a function processes: samples (its batch) and tokens, for throughput in the
units users count (samples/s, tokens/s) beside calls per second.

A call's batch is the leading dimension of its first argument. Its tokens: with `seq_axis`
given (`--seq-axis`), the product of the first argument's dimensions up to and including that
axis ((batch, seq, hidden) with axis 1: batch x seq); otherwise, where the function has
attention (an mp.softmax over a square seq x seq block), every axis of its first argument but
the last (features), or every axis of integer token ids; None for other models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mplower.ir.graph import Function
from mplower.numerics.formats import FORMATS


@dataclass(frozen=True)
class Units:
    samples: int | None  # per call
    tokens: int | None  # per call

    def rates(self, calls_per_s: float | None) -> dict[str, float | None]:
        ok = calls_per_s is not None and math.isfinite(calls_per_s)
        return {"samples_per_s": calls_per_s * self.samples if ok and self.samples else None,
                "tokens_per_s": calls_per_s * self.tokens if ok and self.tokens else None}


class SeqAxisError(ValueError):
    pass


def tokens_per_inference(f: Function, seq_axis: int | None = None) -> int | None:
    if not f.args:
        return None
    t = f.types(f.args[0])[0]
    if seq_axis is not None:
        if not -t.rank <= seq_axis < t.rank:
            raise SeqAxisError(f"--seq-axis {seq_axis} is not an axis of the first argument "
                               f"of @{f.name}, {t}")
        return math.prod(t.shape[:seq_axis % t.rank + 1])
    attention = any(f.op(n) == "mp.softmax" and len(s := f.types(n)[0].shape) >= 2
                    and s[-1] == s[-2] for n in f.ops() if f.types(n))
    if not attention:
        return None
    dims = t.shape[:-1] if FORMATS[t.elem].is_float else t.shape
    return math.prod(dims) if dims else None


def units(f: Function, seq_axis: int | None = None) -> Units:
    first = f.types(f.args[0])[0] if f.args else None
    samples = first.shape[0] if first is not None and first.rank else None
    return Units(samples, tokens_per_inference(f, seq_axis))


def rate_text(calls_per_s: float, u: Units) -> str:
    """'1234.5 inferences/s; batch 32: 3.95e+04 samples/s, 5.06e+06 tokens/s'."""
    r = u.rates(calls_per_s)
    extra = [f"batch {u.samples}: {r['samples_per_s']:.4g} samples/s"] \
        if r["samples_per_s"] is not None else []
    if r["tokens_per_s"] is not None:
        extra.append(f"{r['tokens_per_s']:.4g} tokens/s")
    return f"{calls_per_s:.1f} inferences/s" + (f"; {', '.join(extra)}" if extra else "")
