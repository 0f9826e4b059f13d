"""`prepare-qat`: fake-quantize what `quantize` would quantize, for quantization-aware training.

For every matmul and conv that the w8a8 scheme of `quantize` targets (the plan's i8 ops, or
every one without a plan) the operands get an `mp.fake_quant` on the grid quantize would give
them: weights symmetric per output channel (or per tensor) from their values now, activations
per tensor from their calibrated `mp.range` (run calibrate first), ORT's asymmetric grid unless
`symmetric`. The op itself keeps computing in float on those values, so the module runs,
differentiates (fake_quant's gradient is the straight-through estimator clipped to the range)
and trains with `mplower train`; `quantize` afterwards keeps each fake_quant's grid and turns
the op into the integer kernel (docs/quantization.md, "Quantization-aware training").
`scales=frozen` keeps every scale as calibrated: training moves the weights, not the grid.
`scales=lsq` writes `mp.fake_quant_lsq` instead, whose scale is an inline constant marked
`mp.trainable`, which `mplower train` learns with the weights (LSQ); zero points stay frozen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mplower.passes.quantize import (
    QParams,
    activation_qparams,
    missing_range,
    qat_params,
    quantized_targets,
    weight_axis,
    weight_qparams,
)

from mplower.dialect.plan import TRAINABLE
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import Function, Module, Value
from mplower.ir.types import DenseAttr, TypeAttr, tensor
from mplower.lowering.calibration import ConstantValues, range_of
from mplower.pass_manager import Pass, PassContext, option, register_pass

SCALES = ("frozen", "lsq")


@register_pass
@dataclass
class PrepareQat(Pass):
    """Insert mp.fake_quant on the operands of the ops w8a8 quantize targets (weights per
    channel, activations per tensor from calibration), for quantization-aware training."""

    name: ClassVar[str] = "prepare-qat"
    statistics: ClassVar[dict[str, str]] = {
        "fake-quant-ops": "mp.fake_quant ops inserted",
        "ops-prepared": "matmul/conv ops whose operands are fake-quantized",
    }
    examples: ClassVar[tuple[str, ...]] = (
        ("ir_examples/mlp.ir --pass='calibrate{data=ir_examples/mlp_inputs.npz}' "
        "--pass=prepare-qat"),)
    weights: str = option("per-channel", "weight scales: per-channel or per-tensor")
    symmetric: bool = option(False, "activations: false (ORT's grid, as quantize), or "
                                    "symmetric i8")
    scales: str = option("frozen", "frozen (as calibrated) or lsq (learned in training: "
                                   "mp.fake_quant_lsq with a trainable scale constant)")

    def run(self, module: Module, ctx: PassContext) -> None:
        if self.scales not in SCALES:
            raise DiagnosticError.at(module.loc, f"prepare-qat: scales must be "
                                                 f"{' or '.join(SCALES)}, got '{self.scales}'")
        if self.weights not in ("per-channel", "per-tensor"):
            raise DiagnosticError.at(module.loc, f"prepare-qat: weights must be per-channel or "
                                                 f"per-tensor, got '{self.weights}'")
        work = [(f, quantized_targets(f, "w8a8"), ConstantValues(module, f, ctx.weights_path))
                for f in module.functions.values()]
        errors = [d for f, targets, consts in work for n in targets
                  if (d := missing_range(f, n, consts)) is not None]
        if errors:  # a failing pass changes nothing
            raise DiagnosticError(*errors)
        for f, targets, consts in work:
            made: dict[tuple, Value] = {}
            for n in targets:
                for i, v in enumerate(f.operands(n)[:2]):
                    if qat_params(f, v, consts) is not None:
                        continue  # prepared already
                    if v in consts:
                        axis = weight_axis(f.op(n), i, f.type_of(v).rank,
                                           self.weights == "per-channel")
                        qp = weight_qparams(consts.get(v), axis, 127, "i8")
                    else:
                        qp = activation_qparams(*range_of(f, v), self.symmetric)
                    f.set_operand(n, i, _fake_quant(f, v, qp, made, ctx,
                                                    self.scales == "lsq"))
                ctx.stat("ops-prepared")


def _fake_quant(f: Function, v: Value, qp: QParams, made: dict[tuple, Value],
                ctx: PassContext, lsq: bool) -> Value:
    """One fake_quant per (value, grid), right after the value's producer."""
    key = (v,) + qp.key()
    if key not in made:
        name = f.value_name(v).lstrip("%").replace("#", "_")
        attrs = {**qp.attrs(), "dtype": TypeAttr(qp.elem)}
        if lsq:
            st = tensor(qp.scale.shape if qp.scale.size > 1 else (), "f32")
            scale = f.create_op("mp.constant", [], [st], {
                "value": DenseAttr(qp.scale.reshape(st.shape).astype("float32"), st),
                TRAINABLE: True}, after=v[0], name_hint=f"{name}_scale")
            del attrs["scale"]
            node = f.create_op("mp.fake_quant_lsq", [v, (scale, 0)], [f.type_of(v)], attrs,
                               after=scale, name_hint=f"{name}_fq")
        else:
            node = f.create_op("mp.fake_quant", [v], [f.type_of(v)], attrs, after=v[0],
                               name_hint=f"{name}_fq")
        ctx.stat("fake-quant-ops")
        made[key] = (node, 0)
    return made[key]
