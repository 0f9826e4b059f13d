"""`legalize`: make the precision plan runnable on a target, recording every fallback and why.

Each annotated op's (compute, accumulator, kernel) goes through the target's fallback chains
(mplower.lowering.target.Target.legalize: fp8 -> bf16 -> f32, i8 -> bf16 -> f32, f16 accumulation ->
f32, sparse -> dense). A fallback rewrites `mp.precision`/`mp.accum`/`mp.kernel`, keeps what
was asked in `mp.requested` and appends the reason code to `mp.reason`; `strict=true` makes it
an error instead, as TensorRT's "obey" precision constraints do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.diagnostics import Diagnostic, DiagnosticError
from mplower.ir.graph import Module
from mplower.ir.opdef import OPS, attr_type
from mplower.ir.types import TypeAttr
from mplower.lowering.target import DENSE, load_target
from mplower.pass_manager import Pass, PassContext, option, register_pass

PRECISION, ACCUM, KERNEL, REASON = "mp.precision", "mp.accum", "mp.kernel", "mp.reason"
REQUESTED, FALLBACK = "mp.requested", "mp.fallback"


@register_pass
@dataclass
class Legalize(Pass):
    """Fall back from formats and kernels the target lacks, recording a reason code for each.

    Reads `mp.precision`, `mp.accum` and `mp.kernel` (as written by assign-precision and
    lower-sparse) and rewrites them to what the target runs. A fallback sets `mp.fallback` to
    the reason code(s) (docs/targets.md), `mp.requested` to the original request, and appends
    `fallback <code>: <from> -> <to>` to `mp.reason`. With `strict=true` a fallback is an error.
    """

    name: ClassVar[str] = "legalize"
    statistics: ClassVar[dict[str, str]] = {
        "ops-checked": "annotated ops checked against the target",
        "fallbacks": "ops that fell back (each reason code is counted too)",
    }
    target: str = option("generic", "built-in target name or path to a .toml description")
    strict: bool = option(False, "an op without a kernel is an error instead of a fallback")

    def run(self, module: Module, ctx: PassContext) -> None:
        target = load_target(self.target, known_ops=OPS)
        errors = []
        checked = 0
        for f in module.functions.values():
            for n in f.ops():
                attrs = f.attrs_of(n)
                if PRECISION not in attrs:
                    continue
                op = f.op(n)
                compute = attr_type(attrs[PRECISION])
                accum = attr_type(attrs[ACCUM]) if ACCUM in attrs else None
                kernel = attrs.get(KERNEL, DENSE)
                ctx.stat("ops-checked")
                checked += 1
                try:
                    legal = target.legalize(op, compute, accum, kernel)
                except ValueError as e:
                    errors.append(Diagnostic(f.data(n)["loc"], f"'{op}': {e}"))
                    continue
                if not legal.fallback:
                    continue
                asked = _describe(compute, accum, kernel)
                got = _describe(legal.compute, legal.accum, legal.kernel)
                if self.strict:
                    errors.append(Diagnostic(f.data(n)["loc"], (
                        f"'{op}' has no {asked} kernel on target '{target.name}' "
                        f"({legal.reason}); without strict=true it would run as {got}")))
                    continue
                f.set_attr(n, PRECISION, TypeAttr(legal.compute))
                if legal.accum is not None:
                    f.set_attr(n, ACCUM, TypeAttr(legal.accum))
                if KERNEL in attrs or legal.kernel != DENSE:
                    f.set_attr(n, KERNEL, legal.kernel)
                f.set_attr(n, REQUESTED, asked)
                f.set_attr(n, FALLBACK, legal.reason)
                reason = attrs.get(REASON, "")
                f.set_attr(n, REASON, (f"{reason}; " if reason else "")
                           + f"fallback {legal.reason}: {asked} -> {got}")
                ctx.stat("fallbacks")
                for code in legal.reasons:
                    ctx.stat(f"fallback:{code}")
        if errors:
            raise DiagnosticError(*errors)
        if checked:  # a module without a plan stays exactly as it was
            module.attrs["mp.target"] = target.source.removeprefix("builtin:")


def _describe(compute: str, accum: str | None, kernel: str) -> str:
    text = compute + (f"/{accum}" if accum else "")
    return text if kernel == DENSE else f"{text} {kernel}"
