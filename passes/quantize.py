"""`quantize`: turn calibrated matmuls and convs into integer kernels or weight-only chains.

w8a8 (static, as ONNX Runtime's and TensorRT's int8 flows): activations are quantized per
tensor from their calibrated `mp.range`, weights per channel along the output axis (`x @ W`
with W (in, out): axis 1; W @ x: the rows; conv OIHW: axis 0) or per tensor, symmetrically with
127 steps a side. When every activation zero point is 0 the op becomes the quantized kernel the
executor runs exactly: i8 x i8 (or ui8 x i8) -> i32, then one `mp.dequantize` of the i32
result with scale s_act * s_weight per output channel (the requantization to float), and a
conv's bias added after it. Symmetric activations always take this path, and so do
asymmetric ones (the default, chosen by measurement: docs/quantization.md) whose range is
one-sided (relu outputs, pixels): [0, hi] in ui8 with zero point 0 is the same grid as ORT's
int8 with zero point -128. An asymmetric range that
straddles 0 needs a zero point z, which the integer kernel has no operand for. For `x @ W` the
pass shifts instead: x - c with c = -z * scale (an `mp.sub`) is quantized with zero point 0,
which is the same grid (ORT's: 256 levels over [lo, hi], 0 exact), and
`c * colsum(dequantize(W_q))` is added back after the dequantize, so the result is asymmetric
quantization's. Both are float ops in the graph, and in the fp32 reference, which drops
quantize/dequantize, they cancel to x @ W, so the kernel stays integer. Elsewhere (conv, whose
zero padding would see the shift; activation x activation) the op is written in QDQ form
(quantize -> dequantize -> f32 op, what ORT's QDQ format writes and fuses) and annotated
`mp.precision = f32` with the reason, because that is what it computes in.

Weight-only (w8a16, w4a16): the weight of each matmul is quantized in groups of `group` along
the reduction axis (one scale per group and output column, as ORT's MatMulNBits and GPTQ/AWQ
do), dequantized to f32 and computed in the activation format (the op's float plan, which
insert-casts materializes). mp.quantize takes one scale per index of one axis, so the groups
are laid out on one axis: W (K, N) -> reshape (K/g, g, N) -> transpose (g, K/g, N) -> reshape
(g, K/g * N), quantized along axis 1, and the same steps back. Conv weights are per output
channel. With `method=gptq` or `awq` (or `sym=false`) the weights are the integers that
mplower.numerics.weight_only computed from the statistics of each layer's input on
calibration data (mplower.lowering.layer_stats), stored as an integer constant that one
blocked mp.dequantize turns back into f32 (`quantized_weight`); AWQ's input scaling is folded
into the op before the layer where that op allows it (`folded_input_scale`), else it is an
mp.mul.

After quantization-aware training (prepare-qat, mplower train) an operand produced by an
integer `mp.fake_quant` keeps that op's scale and zero point (the grid the network was trained
on) and the fake_quant goes away; the other operands are quantized from calibration as above.

Which ops: where the module carries a precision plan (assign-precision), exactly the matmuls
and convs the plan puts in i8 (w8a8) or in any format narrower than f32 (weight-only); without
a plan, every matmul and conv that has a weight or a calibrated activation. Weights are read
with mplower.lowering.calibration.ConstantValues. The fp32 reference of the executor drops quantize and
dequantize, so `mplower run` measures exactly what quantization costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from mplower.dialect.mp import QUANTIZABLE
from mplower.dialect.plan import (
    PRECISION,
    QUANT_MARK,
    WEIGHT_ERROR,
    WEIGHT_QUANT,
    Plan,
    Requested,
)
from mplower.io.npz import read_npz
from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location
from mplower.ir.graph import Function, Module, Value
from mplower.ir.opdef import OPS, attr_type, check_attrs
from mplower.ir.types import DenseAttr, TensorType, tensor
from mplower.lowering.calibration import (
    CALIB,
    CALIB_KEYS,
    RANGE,
    ConstantValues,
    dense_f32,
    nonfinite_of,
    range_of,
    set_value_attrs,
)
from mplower.lowering.layer_stats import collect_layer_stats, layer_groups
from mplower.numerics.formats import FORMATS
from mplower.numerics.weight_only import (
    LayerStats,
    awq_quantize,
    gptq_factor,
    gptq_quantize,
    reconstruction_error,
    rtn_quantize,
)
from mplower.pass_manager import Pass, PassContext, option, register_pass
from mplower.passes.calibrate import split_samples

QDQ_ZERO_POINT = "qdq-zero-point"  # the fallback code of a w8a8 op written in QDQ form
ZERO_POINT = "zero-point"  # QUANT_MARK of the ops that undo an activation shift
SCHEMES = {"w8a8": "i8", "w8a16": "i8", "w4a16": "i4"}  # scheme -> weight format
METHODS = ("rtn", "gptq", "awq")  # weight-only algorithms (mplower.numerics.weight_only)
DATA_METHODS = ("gptq", "awq")  # the methods that read calibration data (data=)


@dataclass(frozen=True)
class QParams:
    """Scale and zero point of one tensor (per tensor, or per index of `axis`)."""

    elem: str
    scale: np.ndarray  # float32, scalar or 1-D
    zero_point: int = 0
    axis: int | None = None

    def attrs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"scale": _number(self.scale)}
        if self.zero_point:
            out["zero_point"] = self.zero_point
        if self.axis is not None and self.scale.size > 1:
            out["axis"] = self.axis
        return out

    def key(self) -> tuple:
        return (self.elem, self.scale.tobytes(), self.zero_point, self.axis)


def _number(scale: np.ndarray) -> Any:
    return float(scale.reshape(-1)[0]) if scale.size == 1 else dense_f32(scale)


def _safe(scale: np.ndarray) -> np.ndarray:
    """float32 scales, with 1 where a channel is all zeros (any positive scale is exact)."""
    s = np.asarray(scale, np.float64)
    return np.where(s > 0, s, 1.0).astype(np.float32)


def activation_qparams(lo: float, hi: float, symmetric: bool) -> QParams:
    """Per-tensor parameters for the calibrated range [lo, hi] (widened to contain 0, as ORT)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if symmetric:
        return QParams("i8", _safe(np.float64(max(-lo, hi)) / 127))
    if lo == 0.0:  # one-sided: the whole unsigned range, zero point 0
        return QParams("ui8", _safe(np.float64(hi) / 255))
    if hi == 0.0:
        return QParams("i8", _safe(np.float64(-lo) / 255), 127)
    scale = _safe(np.float64(hi - lo) / 255)
    zp = int(np.clip(np.rint(-128 - lo / float(scale)), -128, 127))
    return QParams("i8", scale, zp)


def weight_qparams(w: np.ndarray, axis: int | None, qmax: int, elem: str) -> QParams:
    """Symmetric parameters, per index of `axis` (None: per tensor)."""
    if axis is None:
        return QParams(elem, _safe(np.float64(np.abs(w).max(initial=0.0)) / qmax))
    axis %= w.ndim
    others = tuple(i for i in range(w.ndim) if i != axis)
    # |w| and its maximum are exact in w's own format: no float64 copy (4x an f32 weight's
    # memory, 8 GB for an 8B model's lm_head)
    amax = np.abs(w).max(axis=others, initial=0.0).astype(np.float64)
    return QParams(elem, _safe(amax / qmax), axis=axis)


def weight_axis(op: str, operand: int, rank: int, per_channel: bool) -> int | None:
    """The per-channel axis of a weight operand: a conv's output channels (OIHW axis 0), a
    matmul's output columns (`x @ W`: W's last axis; `W @ x`: W's rows); None per tensor."""
    if not per_channel or rank < 2:
        return None
    return 0 if op == "mp.conv2d" else (rank - 1 if operand == 1 else rank - 2)


FAKE_QUANTS = ("mp.fake_quant", "mp.fake_quant_lsq")


def qat_params(f: Function, v: Value, consts: ConstantValues) -> tuple[Value, QParams] | None:
    """For a value that an integer mp.fake_quant (or mp.fake_quant_lsq, whose scale operand is
    a constant) produced (prepare-qat, then training): the value it fake-quantizes and its
    parameters, which `quantize` keeps (the grid the network was trained on); None for any
    other value."""
    d = f.data(v[0])
    if d["op"] not in FAKE_QUANTS:
        return None
    a = check_attrs(OPS[d["op"]], d["attrs"])
    elem = attr_type(a["dtype"])
    operands = f.operands(v[0])
    if not FORMATS[elem].is_int or (len(operands) > 1 and operands[1] not in consts):
        return None
    # fake_quant_lsq quantizes with |scale| (mplower.dialect.mp.quantization._lsq_attrs).
    scale = np.asarray(a["scale"] if len(operands) == 1 else np.abs(consts.get(operands[1])),
                       np.float32).reshape(-1)
    axis = a["axis"] % f.type_of(v).rank if scale.size > 1 else None
    return operands[0], QParams(elem, scale, int(np.asarray(a["zero_point"]).reshape(-1)[0]),
                                         axis)


def quantized_targets(f: Function, scheme: str) -> list[int]:
    """The matmuls and convs this scheme quantizes (see the module docstring)."""
    planned = any(PRECISION in f.attrs_of(n) for n in f.ops())
    out = []
    for n in f.ops():
        if f.op(n) not in QUANTIZABLE:
            continue
        if any(FORMATS[t.elem].is_int for t in f.operand_types(n)):
            continue  # already quantized
        if planned:
            fmt = Plan.at(f, n).precision
            if fmt is None:
                continue
            if scheme == "w8a8" and not FORMATS[fmt].is_int:
                continue
            if scheme != "w8a8" and fmt == "f32":
                continue
        out.append(n)
    return out


@dataclass
class _Rewriter:
    f: Function
    ctx: PassContext
    consts: ConstantValues
    cache: dict[tuple, Value] = field(default_factory=dict)

    def quantize(self, v: Value, qp: QParams, hint: str) -> Value:
        """One mp.quantize per (value, parameters), right after the value's producer."""
        key = (v, "q") + qp.key()
        if key not in self.cache:
            t = self.f.type_of(v)
            node = self.f.create_op("mp.quantize", [v], [t.with_elem(qp.elem)], qp.attrs(),
                                    after=v[0], name_hint=hint)
            self.ctx.stat("quantize-ops")
            self.cache[key] = (node, 0)
        return self.cache[key]

    def dequantize(self, q: Value, qp: QParams, elem: str, hint: str) -> Value:
        key = (q, "dq", elem) + qp.key()
        if key not in self.cache:
            t = self.f.type_of(q)
            node = self.f.create_op("mp.dequantize", [q], [t.with_elem(elem)], qp.attrs(),
                                    after=q[0], name_hint=hint)
            self.ctx.stat("dequantize-ops")
            self.cache[key] = (node, 0)
        return self.cache[key]

    def shifted(self, v: Value, shift: float) -> Value:
        """`v - shift`, once per value, with the range it will have."""
        key = (v, "shift", shift)
        if key not in self.cache:
            t = self.f.type_of(v)
            c = self.f.create_op("mp.constant", [], [tensor((), t.elem)],
                                 {"value": dense_f32(np.float32(shift))}, after=v[0],
                                 name_hint=f"{_name(self.f, v)}_shift")
            node = self.f.create_op("mp.sub", [v, (c, 0)], [t], {}, after=c,
                                    name_hint=f"{_name(self.f, v)}_shift")
            lo, hi = range_of(self.f, v)
            self.f.set_attr(node, RANGE, (float(min(lo, 0.0) - shift),
                                          float(max(hi, 0.0) - shift)))
            self.f.set_attr(node, CALIB, "shifted")
            self.ctx.stat("activations-shifted")
            self.cache[key] = (node, 0)
        return self.cache[key]

    def unshift(self, y: Value, shifted: Value, w_q: Value, pw: QParams, hint: str) -> Value:
        """y + c * colsum(dequantize(W_q)): the shift taken off the activation, put back with
        the weights the kernel used (so the result is asymmetric quantization's, exactly); the
        fp32 reference sees colsum(W), which is what it needs to recover x @ W."""
        f = self.f
        c = f.operands(shifted[0])[1]
        w_dq = self.dequantize(w_q, pw, "f32", f"{_name(f, w_q)}_dq")
        wt = f.type_of(w_dq)
        sums = wt.shape[:-2] + (1, wt.shape[-1])
        # After y, the dequantized kernel result, which comes after both W_q and c.
        # All three marked: they belong to the quantized op, which mplower.report.bisect returns to
        # f32 as a whole (dropping them), and are no candidates of their own.
        mark = {QUANT_MARK: ZERO_POINT}
        colsum = self.after("mp.reduce_sum", [w_dq], tensor(sums, "f32"),
                            {"axes": (wt.rank - 2,), "keepdims": True, **mark}, y[0],
                            f"{hint}_zp")
        corr = self.after("mp.mul", [colsum, c], tensor(sums, "f32"), dict(mark), colsum[0],
                          f"{hint}_zp")
        t = f.type_of(y)
        return self.after("mp.add", [y, corr], t, dict(mark), corr[0], f"{hint}_zp")

    def after(self, op: str, operands: list[Value], t: TensorType, attrs: dict, anchor: int,
              hint: str) -> Value:
        return (self.f.create_op(op, operands, [t], attrs, after=anchor, name_hint=hint), 0)


def _name(f: Function, v: Value) -> str:
    return f.value_name(v).lstrip("%").replace("#", "_")


def _error(f: Function, n: int, message: str) -> Diagnostic:
    return Diagnostic(f.data(n)["loc"], f"'{f.op(n)}' {message}")


def missing_range(f: Function, n: int, consts: ConstantValues) -> Diagnostic | None:
    """A diagnostic for the first activation operand of `n` without a calibrated range."""
    for i, v in enumerate(f.operands(n)[:2]):
        if v in consts or qat_params(f, v, consts) is not None:
            continue
        if (bad := nonfinite_of(f, v)) is not None:  # a mask's -inf: no integer holds it
            return _error(f, n, f"operand #{i} {f.value_name(v)} held {bad[0]} -inf, {bad[1]} "
                                f"+inf and {bad[2]} NaN values in calibration, which no "
                                f"integer format holds; keep this op out of i8 (an "
                                f"[[override]] with compute = \"f32\")")
        if range_of(f, v) is None:
            return _error(f, n, f"operand #{i} {f.value_name(v)} has no calibrated range "
                                f"(mp.range); run calibrate{{data=...}} first")
    return None


def quantize_w8a8(rw: _Rewriter, n: int, per_channel: bool, symmetric: bool) -> None:
    """Quantize one matmul/conv whose activations have ranges (see `missing_range`)."""
    f = rw.f
    op = f.op(n)
    ins = f.operands(n)
    is_weight = [v in rw.consts for v in ins[:2]]
    if all(is_weight):
        return
    params: list[QParams] = []
    sources = list(ins[:2])  # what is quantized: the operand, or the operand shifted by c
    shift: float | None = None
    shift_value: Value | None = None
    for i, v in enumerate(ins[:2]):
        trained = qat_params(f, v, rw.consts)
        if trained is not None:  # keep the grid of quantization-aware training
            v, fixed = trained
            sources[i] = v
            rw.ctx.stat("qat-grids-kept")
        if is_weight[i]:
            params.append(fixed if trained is not None else weight_qparams(
                rw.consts.get(v), weight_axis(op, i, f.type_of(v).rank, per_channel), 127, "i8"))
            rw.ctx.stat("weights-quantized")
            continue
        qp = fixed if trained is not None else activation_qparams(*range_of(f, v), symmetric)
        # A zero point: shift instead where the correction is a constant (x @ W, not conv,
        # whose zero padding would see the shift).
        if qp.zero_point and op == "mp.matmul" and i == 0 and is_weight[1]:
            # x - c with c = -zero_point * scale, on a zero point 0 grid, is the same grid as
            # x with that zero point: q = round(x / s) + z = round((x - c) / s).
            shift = float(np.float32(-qp.zero_point * np.float64(qp.scale)))
            qp = QParams("i8", qp.scale)
            sources[0] = shift_value = rw.shifted(v, shift)
        params.append(qp)
    qs = [rw.quantize(v, qp, f"{_name(f, v)}_q") for v, qp in zip(sources, params)]
    d = f.data(n)
    out_t = d["types"][0]
    out_elem = out_t.elem if FORMATS[out_t.elem].is_float else "f32"
    if any(qp.zero_point for qp in params):
        # QDQ form: no integer kernel takes a zero point here.
        for i, (q, qp) in enumerate(zip(qs, params)):
            f.set_operand(n, i, rw.dequantize(q, qp, f.type_of(ins[i]).elem,
                                              f"{_name(f, ins[i])}_dq"))
        # The report shows what was asked (i8) beside what runs (f32 on the grid), and why,
        # as legalize records a fallback.
        Plan.at(f, n)._replace(
            precision="f32", accum="f32", requested=Requested("i8", "i32"),
            fallback=(QDQ_ZERO_POINT,),
            reason="quantize w8a8: QDQ form (an activation zero point is not 0; "
                   "the integer kernel takes none)").write(f, n)
        rw.ctx.stat("ops-qdq")
        _erase_unused_fake_quants(f, ins[:2])
        return
    # The quantized kernel: integer operands, i32 result, one dequantize with the product scale
    # (at most one operand, the weight, has one scale per output channel).
    scale = _safe(params[0].scale.astype(np.float64) * params[1].scale.astype(np.float64))
    axis = None
    if scale.size > 1:
        axis = 1 if op == "mp.conv2d" else out_t.rank - (1 if is_weight[1] else 2)
    bias = ins[2] if len(ins) == 3 else None
    i32 = out_t.with_elem("i32")
    if bias is None:
        f.set_operand(n, 0, qs[0])
        f.set_operand(n, 1, qs[1])
        f.set_result_type(n, 0, i32)
        kernel = n
    else:  # conv with bias: the i32 kernel takes none; the float bias is added afterwards
        kernel = f.create_op(op, qs, [i32], dict(d["attrs"]), before=n, name_hint=d["name"])
    dq_params = QParams("i32", scale, 0, axis)
    dq = f.create_op("mp.dequantize", [(kernel, 0)], [out_t.with_elem(out_elem)],
                     dq_params.attrs(), after=kernel, name_hint=f"{d['name']}_dq")
    rw.ctx.stat("dequantize-ops")
    result: Value = (dq, 0)
    if shift is not None:
        result = rw.unshift(result, shift_value, qs[1], params[1], d["name"])
    if bias is not None:
        o = f.type_of(bias).shape[0]
        shaped = rw.after("mp.reshape", [bias], tensor((o, 1, 1), f.type_of(bias).elem), {},
                          dq, f"{_name(f, bias)}_chw")
        result = rw.after("mp.add", [result, shaped], out_t.with_elem(out_elem), {}, shaped[0],
                          f"{d['name']}_bias")
        f.replace_all_uses((n, 0), result)
        f.erase(n)
        f.rename(kernel, d["name"])  # the name a sheet's override or bisect refers to
    else:
        f.replace_all_uses((n, 0), result, exclude={dq})
    # The calibrated range describes the float result, which the kernel no longer produces.
    moved = {k: v for k, v in f.attrs_of(kernel).items() if k in CALIB_KEYS}
    set_value_attrs(f, result, moved)
    for k in moved:
        f.del_attr(kernel, k)
    plan = Plan.at(f, kernel)
    plan._replace(precision="i8", accum="i32",
                  reason="quantize w8a8" if plan.reason is None else plan.reason).write(f, kernel)
    rw.ctx.stat("ops-quantized")
    _erase_unused_fake_quants(f, ins[:2])


def _erase_unused_fake_quants(f: Function, values: list[Value]) -> None:
    """The fake_quant ops whose grid the quantized op took over, once nothing else uses them
    (and an LSQ scale constant with them)."""
    for v in values:
        if f.op(v[0]) in FAKE_QUANTS and not f.has_uses(v[0]):
            scales = [u for u, _ in f.operands(v[0])[1:]]
            f.erase(v[0])
            for u in scales:
                if f.op(u) == "mp.constant" and not f.has_uses(u):
                    f.erase(u)


def quantize_weight_only(rw: _Rewriter, n: int, elem: str, per_channel: bool,
                         group: int) -> None:
    """Quantize the weight of one matmul/conv group-wise and dequantize it to f32."""
    f = rw.f
    op = f.op(n)
    ins = f.operands(n)
    if ins[1] not in rw.consts or ins[0] in rw.consts:
        rw.ctx.stat("skipped-no-weight")
        return
    w_val = ins[1]
    w = rw.consts.get(w_val)
    wt = f.type_of(w_val)
    qmax = int(FORMATS[elem].max_finite)
    name = _name(f, w_val)
    detail = f"{elem} per-tensor"
    k = wt.shape[-2] if wt.rank >= 2 else 0
    grouped = (op == "mp.matmul" and per_channel and wt.rank == 2 and 0 < group < k
               and k % group == 0)
    if op == "mp.matmul" and per_channel and wt.rank == 2 and 0 < group < k and k % group:
        rw.ctx.stat("groups-not-dividing")
    if grouped:
        g, n_out = group, wt.shape[1]
        layout = w.reshape(k // g, g, n_out).transpose(1, 0, 2).reshape(g, k // g * n_out)
        qp = weight_qparams(layout, 1, qmax, elem)
        a = rw.after("mp.reshape", [w_val], tensor((k // g, g, n_out), wt.elem), {}, w_val[0],
                     f"{name}_groups")
        b = rw.after("mp.transpose", [a], tensor((g, k // g, n_out), wt.elem),
                     {"perm": (1, 0, 2)}, a[0], f"{name}_groups")
        c = rw.after("mp.reshape", [b], tensor((g, k // g * n_out), wt.elem), {}, b[0],
                     f"{name}_groups")
        q = rw.quantize(c, qp, f"{name}_q")
        dq = rw.dequantize(q, qp, "f32", f"{name}_dq")
        back = rw.after("mp.reshape", [dq], tensor((g, k // g, n_out), "f32"), {}, dq[0],
                        f"{name}_dq")
        back = rw.after("mp.transpose", [back], tensor((k // g, g, n_out), "f32"),
                        {"perm": (1, 0, 2)}, back[0], f"{name}_dq")
        result = rw.after("mp.reshape", [back], wt.with_elem("f32"), {}, back[0], f"{name}_dq")
        detail = f"{elem} group {g}"
    else:
        axis = (0 if op == "mp.conv2d" else wt.rank - 1) if per_channel and wt.rank >= 2 \
            else None
        qp = weight_qparams(w, axis, qmax, elem)
        result = rw.dequantize(rw.quantize(w_val, qp, f"{name}_q"), qp, "f32", f"{name}_dq")
        if axis is not None:
            detail = f"{elem} per-channel"
    act = f.type_of(ins[0]).elem
    if act != "f32" and PRECISION not in f.attrs_of(n):  # an unplanned narrow activation
        result = rw.after("mp.cast", [result], wt.with_elem(act), {}, result[0], f"{name}_{act}")
    f.set_operand(n, 1, result)
    f.set_attr(n, WEIGHT_QUANT, detail)
    rw.ctx.stat("weights-quantized")
    rw.ctx.stat("ops-quantized")


def quantized_weight(rw: _Rewriter, n: int, q: np.ndarray, scale: np.ndarray,
                     zero: np.ndarray, elem: str, detail: str) -> None:
    """Make the weight of matmul `n` the integers q (K, N) of an `elem` constant, turned back
    into f32 by one blocked mp.dequantize (axis 0, one scale and zero point per group of rows
    and column): what GPTQ, AWQ and asymmetric round-to-nearest computed, stored as computed.
    The fp32 reference dequantizes such a constant too (it never was a float), so `run`'s
    drift of this op is its activations' alone; its weight's error is `mp.weight_error`."""
    f = rw.f
    w_val = f.operands(n)[1]
    wt = f.type_of(w_val)
    name = _name(f, w_val)
    c = f.create_op("mp.constant", [], [wt.with_elem(elem)],
                    {"value": DenseAttr(q.astype(np.int64), tensor(q.shape, elem))},
                    before=n, name_hint=f"{name}_q")
    attrs: dict[str, Any] = {"scale": dense_f32(scale), "axis": 0,
                             "block_size": q.shape[0] // scale.shape[0]}
    if np.any(zero):
        attrs["zero_point"] = DenseAttr(zero.astype(np.int64), tensor(zero.shape, elem))
    result = rw.after("mp.dequantize", [(c, 0)], wt.with_elem("f32"), attrs, c, f"{name}_dq")
    rw.ctx.stat("dequantize-ops")
    act = f.type_of(f.operands(n)[0]).elem
    if act != "f32" and PRECISION not in f.attrs_of(n):  # an unplanned narrow activation
        result = rw.after("mp.cast", [result], wt.with_elem(act), {}, result[0], f"{name}_{act}")
    f.set_operand(n, 1, result)
    if f.op(w_val[0]) == "mp.constant" and not f.has_uses(w_val[0]):
        f.erase(w_val[0])
    f.set_attr(n, WEIGHT_QUANT, detail)
    rw.ctx.stat("weights-quantized")
    rw.ctx.stat("ops-quantized")


NORMS = ("mp.layer_norm", "mp.rms_norm")


def _channel_constants(rw: _Rewriter, n: int, x: Value) -> list[int] | None:
    """The operand positions of `n` that hold constant per-channel vectors along x's last axis
    and scale x linearly: a norm's gamma and beta, a mul's factor and an add's term (whose
    other operand is a mul by such a factor, used by the add alone); None where the
    producer is no such op."""
    f = rw.f
    k = f.type_of(x).shape[-1]
    op, ins = f.op(n), f.operands(n)

    def vector(v: Value) -> bool:
        return v in rw.consts and f.type_of(v).shape == (k,) and f.type_of(v).elem == "f32"

    if op in NORMS and all(vector(v) for v in ins[1:]) and \
            f.attrs_of(n).get("axis", -1) in (-1, f.type_of(x).rank - 1):
        return list(range(1, len(ins)))
    if op == "mp.mul" and vector(ins[1]) and ins[0] not in rw.consts:
        return [1]
    if op == "mp.add" and vector(ins[1]) and f.op(ins[0][0]) == "mp.mul" and \
            len(f.uses(ins[0])) == 1 and _channel_constants(rw, ins[0][0], ins[0]) == [1]:
        return [1]
    return None


def folded_input_scale(rw: _Rewriter, x: Value, inverse: np.ndarray, layers: list[int]
                       ) -> bool:
    """Fold x * inverse into x's producer where it is a per-channel affine op of constants
    that only these layers read (a norm's gamma and beta; a mul by a vector, and an add
    of one after it: a norm as the ONNX importer decomposes it): its
    vectors are multiplied by `inverse` in new inline constants. False where there is none."""
    f = rw.f
    n = x[0]
    if n in f.args or {u for u, _ in f.uses(x)} != set(layers):
        return False
    positions = _channel_constants(rw, n, x)
    if positions is None:
        return False
    todo = [(n, positions)]
    if f.op(n) == "mp.add":
        todo.append((f.operands(n)[0][0], [1]))
    for node, pos in todo:
        for i in pos:
            v = f.operands(node)[i]
            scaled = rw.consts.get(v).astype(np.float32) * inverse
            c = f.create_op("mp.constant", [], [tensor(scaled.shape, "f32")],
                            {"value": dense_f32(scaled)}, before=node,
                            name_hint=f"{_name(f, v)}_awq")
            f.set_operand(node, i, (c, 0))
            if f.op(v[0]) == "mp.constant" and not f.has_uses(v[0]):
                f.erase(v[0])
    rw.ctx.stat("awq-scales-folded")
    return True


def scaled_input(rw: _Rewriter, x: Value, inverse: np.ndarray) -> Value:
    """x * inverse (per input channel): AWQ's division of a layer's input by its scales, an
    explicit mp.mul after x's producer, shared by the layers that read x."""
    f = rw.f
    t = f.type_of(x)
    c = f.create_op("mp.constant", [], [tensor(inverse.shape, "f32")],
                    {"value": dense_f32(inverse)}, after=x[0],
                    name_hint=f"{_name(f, x)}_awq")
    rw.ctx.stat("awq-input-scales")
    return rw.after("mp.mul", [x, (c, 0)], t, {}, c, f"{_name(f, x)}_awq")


@register_pass
@dataclass
class Quantize(Pass):
    """Insert quantize/dequantize pairs and integer kernels from the calibrated ranges.

    w8a8: activations per tensor from `mp.range` (run calibrate first), weights per channel or
    per tensor; i8 x i8 -> i32 matmul/conv and one dequantize of the i32 result. Asymmetric
    activations use ORT's grid: ui8 where the range is one-sided; a zero point otherwise,
    written for `x @ W` as a shift of x and its constant correction (the kernel stays
    integer), elsewhere in QDQ form. w8a16 / w4a16: weights only, group-wise along the
    reduction axis, computed in the activation format; `method` rtn (round to nearest), gptq
    or awq (both read calibration `data`), the latter two stored as integer constants with a
    blocked dequantize, each layer's reconstruction error on `data` as `mp.weight_error`
    (docs/quantization.md). Honours a precision plan: with one,
    exactly the ops planned i8 (w8a8) or narrower than f32 (weight-only) are quantized;
    without one, every matmul and conv.
    """

    name: ClassVar[str] = "quantize"
    statistics: ClassVar[dict[str, str]] = {
        "ops-quantized": "matmul/conv ops quantized",
        "ops-qdq": "w8a8 ops written in QDQ form (an activation zero point)",
        "activations-shifted": "asymmetric activations quantized as x - c (c = -zero_point * scale)",
        "weights-quantized": "weight operands quantized",
        "quantize-ops": "mp.quantize ops inserted",
        "dequantize-ops": "mp.dequantize ops inserted",
        "groups-not-dividing": "weight-only ops quantized per channel: group does not divide K",
        "skipped-no-weight": "weight-only: matmul/conv without a constant weight operand",
        "qat-grids-kept": "operands quantized on the grid of their mp.fake_quant (prepare-qat)",
        "layers-gptq": "weight-only layers quantized by GPTQ",
        "layers-awq": "weight-only layers quantized by AWQ",
        "layers-rtn": "weight-only layers rounded to nearest with zero points (sym=false)",
        "layers-rtn-fallback": "gptq/awq/sym=false: weights that are no x @ W layer (a conv, "
                               "W @ x), rounded to nearest symmetrically",
        "awq-input-scales": "AWQ input scalings inserted (an mp.mul by 1/s per shared input)",
        "awq-scales-folded": "AWQ input scalings folded into the norm (or mul/add) before",
    }
    examples: ClassVar[tuple[str, ...]] = (
        "ir_examples/mlp.ir --pass='calibrate{data=ir_examples/mlp_inputs.npz}' --pass=quantize",
        "ir_examples/mlp.ir --pass='quantize{scheme=w8a16}'",
        ("ir_examples/mlp.ir --pass='quantize{scheme=w4a16 method=gptq group=16 sym=false "
        "data=ir_examples/mlp_inputs.npz}'"),
    )
    scheme: str = option("w8a8", "w8a8 (static int8), w8a16 or w4a16 (weight-only)")
    weights: str = option("per-channel", "weight scales: per-channel or per-tensor")
    activations: str = option("per-tensor", "activation scales: per-tensor (static)")
    symmetric: bool = option(False, "activations: false (default, ORT's grid): ui8 for "
                                    "one-sided ranges, else a zero point; true: symmetric i8")
    group: int = option(128, "weight-only: group size along the reduction axis (0: per channel)")
    method: str = option("rtn", "weight-only: rtn (round to nearest), gptq or awq (need data)")
    sym: bool = option(True, "weight-only: symmetric grid (true) or one zero point per group")
    data: str = option("", "weight-only: calibration .npz (as calibrate's) for gptq / awq, "
                           "and for the reconstruction error of each layer")
    damp: float = option(0.01, "gptq: damping, this fraction of mean(diag(H)) added to diag(H)")
    act_order: bool = option(False, "gptq: columns by decreasing diag(H) (static groups)")
    block: int = option(128, "gptq: columns per lazy batch update")
    ops: tuple[str, ...] = option(tuple(sorted(QUANTIZABLE)), "weight-only: the ops whose weights are "
                                                       "quantized (e.g. mp.matmul alone)")
    clip: bool = option(True, "awq: search a clipping range per group after the scales")
    grid: int = option(20, "awq: grid points of alpha in [0, 1) (and of the clipping search)")

    def run(self, module: Module, ctx: PassContext) -> None:
        loc = module.loc
        if self.scheme == "w4a8":
            raise DiagnosticError.at(loc, "quantize: scheme w4a8 is not supported: no kernel "
                                          "takes 4-bit weights against int8 activations; use "
                                          "w4a16 (weight-only) or w8a8")
        if self.scheme not in SCHEMES:
            raise DiagnosticError.at(loc, f"quantize: unknown scheme '{self.scheme}'; expected "
                                          f"one of {', '.join(SCHEMES)}")
        if self.weights not in ("per-channel", "per-tensor"):
            raise DiagnosticError.at(loc, f"quantize: weights must be per-channel or "
                                          f"per-tensor, got '{self.weights}'")
        if self.activations != "per-tensor":
            raise DiagnosticError.at(loc, f"quantize: activations must be per-tensor (static "
                                          f"ranges), got '{self.activations}'")
        self._check_weight_only(loc)
        per_channel = self.weights == "per-channel"
        work = []
        for f in module.functions.values():
            targets = quantized_targets(f, self.scheme)
            if targets:
                work.append((f, targets, ConstantValues(module, f, ctx.weights_path)))
        if self.scheme == "w8a8":  # check everything first: a failing pass changes nothing
            errors = [d for f, targets, consts in work for n in targets
                      if (d := missing_range(f, n, consts)) is not None]
            if errors:
                raise DiagnosticError(*errors)
        for f, targets, consts in work:
            rw = _Rewriter(f, ctx, consts)
            if self.scheme != "w8a8":
                self._weight_only(module, rw, targets, per_channel)
                continue
            for n in targets:
                quantize_w8a8(rw, n, per_channel, self.symmetric)

    def _check_weight_only(self, loc: Any) -> None:
        if self.method not in METHODS:
            raise DiagnosticError.at(loc, f"quantize: unknown method '{self.method}'; expected "
                                          f"one of {', '.join(METHODS)}")
        bad = [op for op in self.ops if op not in QUANTIZABLE]
        if bad:
            raise DiagnosticError.at(loc, f"quantize: ops {', '.join(bad)} take no quantized "
                                          f"weight (ops: {', '.join(sorted(QUANTIZABLE))})")
        if self.method == "rtn" and self.sym:
            return
        what = f"method={self.method}" if self.method != "rtn" else "sym=false"
        if self.scheme == "w8a8":
            raise DiagnosticError.at(loc, f"quantize: {what} quantizes weights only; use "
                                          f"scheme=w8a16 or w4a16")
        if self.weights != "per-channel":
            raise DiagnosticError.at(loc, f"quantize: {what} takes per-channel (group-wise) "
                                          f"weight scales, not {self.weights}")
        if self.method != "rtn" and not self.data:
            raise DiagnosticError.at(loc, f"quantize: {what} needs calibration data "
                                          f"(data=CALIB.npz, keyed by argument name)")
        if not (0 <= self.damp and self.block > 0 and self.grid > 0):
            raise DiagnosticError.at(loc, "quantize: damp must be >= 0, block and grid > 0")

    def _weight_only(self, module: Module, rw: _Rewriter, targets: list[int],
                     per_channel: bool) -> None:
        """The weight-only schemes: round-to-nearest in the graph (a quantize/dequantize chain
        of the float weight) where method=rtn and sym=true, otherwise the integers each layer's
        algorithm computed (`quantized_weight`); with data, each layer's reconstruction error
        on it as `mp.weight_error`."""
        f, ctx, elem = rw.f, rw.ctx, SCHEMES[self.scheme]
        # An op whose weight a quantize already stored stays as it is: the pass is idempotent.
        targets = [n for n in targets if f.op(n) in self.ops and WEIGHT_QUANT not in f.attrs_of(n)]
        bits = FORMATS[elem].bits
        rtn_chain = self.method == "rtn" and self.sym
        groups = layer_groups(f, targets, rw.consts) if self.data or not rtn_chain else {}
        if self.method == "awq":  # the input scaling is an f32 mul (scaled_input)
            groups = {x: ns for x, ns in groups.items() if f.type_of(x).elem == "f32"}
        stats: dict[Value, LayerStats] = {}
        if self.data and groups:
            stats = self._layer_stats(module, f, list(groups), ctx)
        layers = {n: x for x, ns in groups.items() for n in ns}
        if not rtn_chain:  # as round-to-nearest counts them: per channel instead
            k_of = {n: f.type_of(x).shape[-1] for n, x in layers.items()}
            ctx.stat("groups-not-dividing", sum(0 < self.group < k and k % self.group > 0
                                                for k in k_of.values()))
        originals = {n: rw.consts.get(f.operands(n)[1]).astype(np.float64) for n in layers}
        for n in targets:
            if rtn_chain or n not in layers:
                if not rtn_chain and f.operands(n)[1] in rw.consts:
                    ctx.stat("layers-rtn-fallback")
                quantize_weight_only(rw, n, elem, per_channel, self.group)
        inverse: dict[int, np.ndarray] = {}
        for x, ns in ({} if rtn_chain else groups).items():
            opts = {"bits": bits, "group": self.group, "sym": self.sym}
            grid = "sym" if self.sym else "asym"
            if self.method == "awq":
                widths = [originals[n].shape[1] for n in ns]
                q, scale, zero, s = awq_quantize(np.concatenate([originals[n] for n in ns], 1),
                                                 stats[x], grid=self.grid, clip=self.clip,
                                                 **opts)
                inv = (np.float32(1) / s).astype(np.float32)
                if not folded_input_scale(rw, x, inv, ns):
                    xs = scaled_input(rw, x, inv)
                    for n in ns:
                        f.set_operand(n, 0, xs)
                cuts = np.cumsum([0, *widths])
                for n, a, b in zip(ns, cuts[:-1], cuts[1:]):
                    inverse[n] = inv
                    quantized_weight(rw, n, q[:, a:b], scale[:, a:b], zero[:, a:b], elem,
                                     f"{elem} {_group_text(q, scale)} {grid} awq")
                ctx.stat("layers-awq", len(ns))
                continue
            factor = None
            for n in ns:
                if self.method == "gptq":
                    try:  # factored once for the layers that read x (q, k, v; gate, up)
                        if factor is None:
                            factor = gptq_factor(stats[x].hessian, damp=self.damp,
                                                 act_order=self.act_order)
                    except ValueError as e:  # the damped Hessian is singular (damp=0)
                        raise DiagnosticError(_error(f, n, f"GPTQ: {e} (the Hessian of this "
                                                           f"layer's input, damped by damp="
                                                           f"{self.damp}); raise damp")) from None
                    q, scale, zero = gptq_quantize(originals[n], None, factor=factor,
                                                   act_order=self.act_order, block=self.block,
                                                   **opts)
                else:
                    q, scale, zero = rtn_quantize(originals[n], **opts)
                quantized_weight(rw, n, q, scale, zero, elem,
                                 f"{elem} {_group_text(q, scale)} {grid} {self.method}")
            ctx.stat(f"layers-{self.method}", len(ns))
        if not stats:
            return
        computed = ConstantValues(module, f, ctx.weights_path)  # the weights as the plan has them
        for n, x in layers.items():
            w_hat = computed.get(f.operands(n)[1]).astype(np.float64)
            if n in inverse:
                w_hat = w_hat * inverse[n].astype(np.float64)[:, None]
            f.set_attr(n, WEIGHT_ERROR, reconstruction_error(originals[n], w_hat,
                                                             stats[x].hessian))

    def _layer_stats(self, module: Module, f: Function, inputs: list[Value],
                     ctx: PassContext) -> dict[Value, LayerStats]:
        data_loc = Location(self.data, 0, 0)
        arrays = read_npz(Path(self.data), data_loc, "calibration data")
        batches, last_rows = split_samples(f, arrays, data_loc)
        if ctx.runner is None:
            raise DiagnosticError.at(module.loc, "quantize: data= needs a PassContext with a "
                                                 "runner (mplower.backend.executor."
                                                 "reference_runner; the mplower CLI has one)")
        return collect_layer_stats(module, f.name, inputs, batches, last_rows, ctx.runner,
                                   ctx.weights_path, ctx.executor)


def _group_text(q: np.ndarray, scale: np.ndarray) -> str:
    return "per-channel" if scale.shape[0] == 1 else f"group {q.shape[0] // scale.shape[0]}"
