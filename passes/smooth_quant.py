"""`smooth-quant`: move activation outliers into the next matmul's weights (SmoothQuant).

Xiao et al. 2023, "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large
Language Models" (arXiv 2211.10438): a few input channels of a matmul carry activations far
larger than the rest, so one per-tensor int8 scale wastes most of its steps on them. For
`y = X @ W` the pass picks one factor per input channel j,

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

(max|X_j| from calibration's `mp.channel_absmax`, max|W_j| the j-th row of W) and rewrites
`X @ W` as `(X * (1/s)) @ (s[:, None] * W)`, which is the same product. Where several matmuls
read the same X (the q, k, v projections of one input), they share s, computed from all their
weights, and one smoothed X. With `pow2` (the default) each s_j is rounded to a power of two,
so both multiplications are exact in fp32 and the fp32 result does not change in a single bit;
the smoothing loses almost nothing by it (a factor of at most sqrt(2) per channel).

Both scalings are `mp.mul` ops by inline constants: the weight's is constant-only (quantize
reads it like any weight), the activation's is an f32 op before the quantization (a deployment
folds it into the producer, e.g. a norm's gamma, as the paper does). The smoothed activation
gets a range derived from the calibrated per-channel maxima (`mp.calib = "smooth-quant"`: exact
for the |x| maximum, a bound for the minimum of two-sided data); rerun calibrate after this pass
for histogram-based methods. Matmuls are chosen as quantize chooses them: the ones a precision
plan puts in i8, or every matmul with a constant weight when there is no plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from mplower.passes.quantize import quantized_targets

from mplower.ir.diagnostics import Diagnostic, DiagnosticError
from mplower.ir.graph import Function, Module, Value
from mplower.ir.types import tensor
from mplower.lowering.calibration import (
    CALIB,
    CHANNEL_ABSMAX,
    RANGE,
    ConstantValues,
    channel_absmax_of,
    dense_f32,
    observed_of,
    set_value_attrs,
)
from mplower.pass_manager import Pass, PassContext, option, register_pass


def smoothing_factors(x_absmax: np.ndarray, w_absmax: np.ndarray, alpha: float,
                      pow2: bool = True) -> np.ndarray:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha); 1 where a channel is all zeros."""
    x = np.asarray(x_absmax, np.float64)
    w = np.asarray(w_absmax, np.float64)
    ok = (x > 0) & (w > 0)
    s = np.ones_like(x)
    s[ok] = x[ok] ** alpha / w[ok] ** (1.0 - alpha)
    s = np.clip(s, 1e-5, 1e5)
    if pow2:
        s = np.exp2(np.rint(np.log2(s)))
    return s


def smooth_groups(f: Function, consts: ConstantValues) -> dict[Value, list[int]]:
    """Matmuls to smooth, grouped by the activation they read."""
    groups: dict[Value, list[int]] = {}
    for n in quantized_targets(f, "w8a8"):
        if f.op(n) != "mp.matmul":
            continue
        x, w = f.operands(n)
        if x in consts or w not in consts or f.type_of(w).rank != 2:
            continue
        groups.setdefault(x, []).append(n)
    return groups


@register_pass
@dataclass
class SmoothQuant(Pass):
    """Migrate activation outliers into the following matmul's weights (per input channel).

    s_j = max|X_j|^alpha / max|W_j|^(1-alpha); X @ W becomes (X / s) @ (s W), the same
    product (bit-identical in fp32 with pow2=true). Needs calibrate's per-channel maxima
    (`mp.channel_absmax`); matmuls reading one activation share s. Run calibrate again
    afterwards for histogram-based ranges of the smoothed activations, then quantize.
    """

    name: ClassVar[str] = "smooth-quant"
    statistics: ClassVar[dict[str, str]] = {
        "matmuls-smoothed": "matmuls whose weights took the activation's scale",
        "activations-smoothed": "activations divided by per-channel factors",
    }
    examples: ClassVar[tuple[str, ...]] = (
        ("ir_examples/mlp.ir --pass='calibrate{data=ir_examples/mlp_inputs.npz}' "
         "--pass='smooth-quant{alpha=0.8}'"),
    )
    alpha: float = option(0.5, "migration strength in [0, 1]: 0 leaves X, 1 moves all into W")
    pow2: bool = option(True, "round each factor to a power of two (exact in fp32)")

    def run(self, module: Module, ctx: PassContext) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise DiagnosticError.at(module.loc, f"smooth-quant: alpha must be in [0, 1], "
                                                 f"got {self.alpha}")
        work = []
        errors = []
        for f in module.functions.values():
            consts = ConstantValues(module, f, ctx.weights_path)
            groups = smooth_groups(f, consts)
            for x, users in groups.items():
                if channel_absmax_of(f, x) is None:
                    n = users[0]
                    errors.append(Diagnostic(f.data(n)["loc"], (
                        f"smooth-quant: {f.value_name(x)} has no per-channel calibration "
                        f"(mp.channel_absmax); run calibrate{{data=...}} first")))
            work.append((f, consts, groups))
        if errors:
            raise DiagnosticError(*errors)
        for f, consts, groups in work:
            for x, users in groups.items():
                self._smooth(f, consts, x, users, ctx)

    def _smooth(self, f: Function, consts: ConstantValues, x: Value, users: list[int],
                ctx: PassContext) -> None:
        x_absmax = channel_absmax_of(f, x)
        weights = [f.operands(n)[1] for n in users]
        w_absmax = np.max([np.abs(consts.get(w)).max(axis=1) for w in weights], axis=0)
        s = smoothing_factors(x_absmax, w_absmax, self.alpha, self.pow2)
        k = s.size
        base = f.value_name(x).lstrip("%").replace("#", "_")
        xt = f.type_of(x)
        inv = f.create_op("mp.constant", [], [tensor((k,), "f32")],
                          {"value": dense_f32(1.0 / s)}, after=x[0], name_hint=f"{base}_smooth")
        smoothed = f.create_op("mp.mul", [x, (inv, 0)], [xt], {}, after=inv,
                               name_hint=f"{base}_smooth")
        new_absmax = x_absmax / s
        amax = float(new_absmax.max(initial=0.0))
        lo, hi = observed_of(f, x) or (-amax, amax)
        set_value_attrs(f, (smoothed, 0), {
            RANGE: (0.0 if lo >= 0 else -amax, amax if hi > 0 else 0.0),
            CALIB: "smooth-quant", CHANNEL_ABSMAX: dense_f32(new_absmax)})
        ctx.stat("activations-smoothed")
        for n, w in zip(users, weights):
            wt = f.type_of(w)
            col = f.create_op("mp.constant", [], [tensor((k, 1), "f32")],
                              {"value": dense_f32(s, (k, 1))}, after=w[0],
                              name_hint=f"{base}_smooth")
            scaled = f.create_op("mp.mul", [w, (col, 0)], [wt], {}, after=col,
                                 name_hint=f"{f.value_name(w).lstrip('%')}_smooth")
            f.set_operand(n, 0, (smoothed, 0))
            f.set_operand(n, 1, (scaled, 0))
            ctx.stat("matmuls-smoothed")
