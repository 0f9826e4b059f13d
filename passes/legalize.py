"""`legalize`: make the precision plan runnable on a target, recording every fallback and why.

Each annotated op's (compute, accumulator, kernel) goes through the target's fallback chains
(mplower.lowering.target.Target.legalize: fp8 -> bf16 -> f32, i8 -> bf16 -> f32, f16 accumulation ->
f32, sparse -> dense; a GEMM whose sheet gives it MX or NVFP4 block scales the target cannot
apply -> bf16 with `no-mx-kernel`, fp4 without fp4 kernels -> bf16 with `no-fp4-kernel`; an
f16 accumulator on operands wider than the backend emulates it for (f32) -> f32 with
`no-f16-accum`). A fallback rewrites `mp.precision`/`mp.accum`/`mp.kernel`, keeps what
was asked in `mp.requested` (a dictionary attribute, mplower.dialect.plan.Requested) and appends
the reason code to `mp.reason`; `strict=true` makes it an error instead, as TensorRT's "obey"
precision constraints do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.dialect.mp import CONTRACTIONS
from mplower.dialect.plan import DENSE, TARGET, Plan, Requested
from mplower.ir.diagnostics import Diagnostic, DiagnosticError
from mplower.ir.graph import Module
from mplower.ir.opdef import OPS
from mplower.lowering.policy import module_scaling
from mplower.lowering.target import NO_F16_ACCUM, Legal, load_target
from mplower.numerics.formats import f16_accum_emulated
from mplower.pass_manager import Pass, PassContext, option, register_pass


@register_pass
@dataclass
class Legalize(Pass):
    """Fall back from formats and kernels the target lacks, recording a reason code for each.

    Reads `mp.precision`, `mp.accum` and `mp.kernel` (as written by assign-precision and
    lower-sparse) and rewrites them to what the target runs. A fallback sets `mp.fallback` to
    the reason code(s) (docs/targets.md), `mp.requested` to the original request (a dictionary
    `{precision = T, accum = T, kernel = "K"}`), and appends
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
        # Block scales the sheet's [scaling] gives GEMM operands (MX, NVFP4) need kernels that
        # apply them; f32 scales run anywhere.
        scaling = module_scaling(module)
        block_scales = scaling.scale_format if scaling is not None and \
            scaling.scale_format != "f32" else None
        errors = []
        checked = 0
        for f in module.functions.values():
            for n in f.ops():
                attrs = f.attrs_of(n)
                asked_plan = Plan.asked(attrs)
                if asked_plan is None:
                    continue
                op = f.op(n)
                compute, accum, kernel = asked_plan
                ctx.stat("ops-checked")
                checked += 1
                try:
                    legal = target.legalize(op, compute, accum, kernel,
                                            block_scales if op in CONTRACTIONS else None)
                except ValueError as e:
                    errors.append(Diagnostic(f.data(n)["loc"], f"'{op}': {e}"))
                    continue
                if legal.accum == "f16" and op in CONTRACTIONS \
                        and not f16_accum_emulated(legal.compute):
                    # The backend's f16 accumulator is exact only for narrow operands: decided
                    # here, once, and recorded, so the executor runs the plan as written.
                    legal = Legal(legal.compute, "f32", legal.kernel,
                                  (*legal.reasons, NO_F16_ACCUM))
                if not legal.fallback:
                    continue
                asked = Requested(compute, accum, kernel)
                got = Requested(legal.compute, legal.accum, legal.kernel)
                if self.strict:
                    errors.append(Diagnostic(f.data(n)["loc"], (
                        f"'{op}' has no {asked} kernel on target '{target.name}' "
                        f"({legal.reason}); without strict=true it would run as {got}")))
                    continue
                plan = Plan.of(attrs)
                plan._replace(precision=legal.compute, accum=legal.accum or plan.accum,
                              kernel=legal.kernel if plan.kernel or legal.kernel != DENSE
                              else None,
                              requested=asked, fallback=legal.reasons,
                              reason=(f"{plan.reason}; " if plan.reason else "")
                              + f"fallback {legal.reason}: {asked} -> {got}").write(f, n)
                ctx.stat("fallbacks")
                for code in legal.reasons:
                    ctx.stat(f"fallback:{code}")
        if errors:
            raise DiagnosticError(*errors)
        if checked:  # a module without a plan stays exactly as it was
            module.attrs[TARGET] = target.source.removeprefix("builtin:")

