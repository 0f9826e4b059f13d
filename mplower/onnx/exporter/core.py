"""Lowered mplower modules to ONNX models that onnx.checker accepts and onnxruntime runs.

The exported graph computes what mplower's executor computes. Every tensor keeps the element
type the IR gives it (BFLOAT16, FLOAT16, FLOAT8E4M3FN, FLOAT8E5M2, INT8, ...), so the bytes that
cross each op boundary are exactly the narrow format; `mp.cast` becomes an ONNX Cast and
`mp.quantize`/`mp.dequantize` become QuantizeLinear/DequantizeLinear. Arithmetic on a narrow
float is emitted as the executor runs it: the operands are Cast to FLOAT, the op computes in
FLOAT, and a Cast rounds the result back to the narrow result type. That is also the only form
onnxruntime's CPU provider can run (it has no bf16 or fp8 MatMul); a product of two narrow
values is exact in f32, so a bf16 x bf16 -> f32 matmul loses nothing. Integer contractions
become MatMulInteger/ConvInteger (exact int32 accumulation, as mplower's executor). Weights
become initializers in the type the IR declares, rounded by mplower's own rounding kernels.

What ONNX cannot say is handled as documented in docs/onnx.md and reported as notes: tf32 has
no ONNX type (its tensors are exported as FLOAT with the tf32 rounding dropped), f16
accumulation (`mp.accum = f16`) is exported as f32 accumulation, and sparse encodings are
exported dense.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mplower.dialect.mp import CONTRACTIONS, CONVERSIONS
from mplower.dialect.plan import ACCUM, check_materialized
from mplower.io.npz import WeightStore
from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.ir.graph import RETURN, Function, Module
from mplower.ir.opdef import OPS, Trait, attr_array, attr_type, check_attrs
from mplower.ir.types import DenseAttr, TensorType
from mplower.numerics.formats import (
    FORMATS,
    NARROW_FLOATS,
    QUANT_FLOATS,
    QUANT_INTS,
    QUANT_STORAGE,
    QUANT_WIDE,
)

OPSET = 21  # INT4 (21), Gelu (20), Cast saturate and float8 (19)
IR_VERSION = 10  # the IR version of opset 21; onnxruntime 1.18+ reads it
# Element types ONNX has but onnxruntime cannot run: an export that nothing here can run or
# check is an error, not a file (FLOAT4E2M1, opset 23: onnxruntime 1.32's CPU provider has no
# QuantizeLinear, DequantizeLinear or Cast kernel for it).
_NO_RUNTIME = {"f4E2M1FN": "FLOAT4E2M1 (ONNX opset 23), for which onnxruntime has no CPU kernel "
                           "(QuantizeLinear, DequantizeLinear, Cast)"}

ONNX_TYPE = {
    "f64": TensorProto.DOUBLE, "f32": TensorProto.FLOAT, "tf32": TensorProto.FLOAT,
    "f16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16,
    "f8E4M3FN": TensorProto.FLOAT8E4M3FN, "f8E5M2": TensorProto.FLOAT8E5M2,
    "i32": TensorProto.INT32, "i8": TensorProto.INT8, "ui8": TensorProto.UINT8,
    "i4": TensorProto.INT4, "i1": TensorProto.BOOL, "i64": TensorProto.INT64,
    "i16": TensorProto.INT16, "ui16": TensorProto.UINT16, "ui32": TensorProto.UINT32,
    "ui64": TensorProto.UINT64,
}
# Narrow floats (NARROW_FLOATS) compute by upcasting to FLOAT, as the executor computes in f32
# and rounds; data movement and conversions are emitted in the operand type.
# onnxruntime's CPU provider moves these only after a Cast (to FLOAT, or INT8 for INT4).
_NO_NATIVE_MOVES = frozenset({"f8E4M3FN", "f8E5M2", "i4"})

_SIMPLE = {
    "mp.add": "Add", "mp.sub": "Sub", "mp.mul": "Mul", "mp.div": "Div", "mp.maximum": "Max",
    "mp.minimum": "Min", "mp.neg": "Neg", "mp.relu": "Relu", "mp.sigmoid": "Sigmoid",
    "mp.tanh": "Tanh", "mp.exp": "Exp", "mp.log": "Log", "mp.sqrt": "Sqrt", "mp.erf": "Erf",
    "mp.global_avg_pool": "GlobalAveragePool", "mp.where": "Where", "mp.pow": "Pow",
    "mp.equal": "Equal", "mp.less": "Less", "mp.less_equal": "LessOrEqual",
    "mp.greater": "Greater", "mp.greater_equal": "GreaterOrEqual", "mp.logical_and": "And",
    "mp.logical_or": "Or", "mp.logical_xor": "Xor", "mp.logical_not": "Not",
    "mp.isnan": "IsNaN",
}


@dataclass
class Exported:
    model: onnx.ModelProto
    notes: list[str] = field(default_factory=list)


# Element types onnxruntime's Python API cannot exchange as numpy arrays, and the type a graph
# input or output of that element type is exchanged as (exactly: every value converts).
_IO_AS = {"bf16": "f32", "f8E4M3FN": "f32", "f8E5M2": "f32", "i4": "i8"}


def export_module(module: Module, func: str | None = None, weights: str | None = None,
                  narrow_io: bool = False, weight_only: str = "matmulnbits") -> Exported:
    """The ONNX model of one function of a (lowered) module; see the module docstring.

    Graph inputs and outputs of bf16, fp8 and i4 are exchanged as FLOAT (INT8 for i4) with a
    Cast right inside, because onnxruntime's Python API has no numpy type for them; an input
    is rounded to its declared type there, as mplower's executor rounds its arguments.
    `narrow_io` keeps the declared types at the boundary instead. The module is exported as it
    is and not changed; a plan that is only annotations is an error (run insert-casts first).
    `weight_only` is how weight-only matmuls are written: "matmulnbits" (onnxruntime's
    com.microsoft.MatMulNBits, mplower.onnx.exporter.nbits) or "qdq" (DequantizeLinear + MatMul).
    """
    from mplower.onnx.exporter.nbits import WEIGHT_ONLY_FORMS, NBitsPlan, plan_nbits

    if weight_only not in WEIGHT_ONLY_FORMS:
        raise ValueError(f"weight_only must be one of {WEIGHT_ONLY_FORMS}, got {weight_only!r}")
    f = module.function(func)
    check_materialized(f)
    nbits = plan_nbits(module, f, weights) if weight_only == "matmulnbits" else \
        NBitsPlan({}, set(), [])
    exporter = _Exporter(f, WeightStore(module, weights), Location(module.path, 0, 0),
                         narrow_io, nbits)
    model = exporter.run(module.name or f.name)
    return Exported(model, sorted(set(exporter.notes)))


def check_and_serialize(model: onnx.ModelProto, loc: Location) -> bytes:
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise DiagnosticError.at(loc, f"internal: the exported model fails onnx.checker: "
                                      f"{str(e).strip().splitlines()[0][:300]}") from None
    data = model.SerializeToString()
    if len(data) >= 2 ** 31:
        raise DiagnosticError.at(loc, "the exported model is over protobuf's 2 GB limit")
    return data


class _Exporter:
    def __init__(self, f: Function, weights, loc: Location, narrow_io: bool, nbits):
        self.f = f
        self.narrow_io = narrow_io
        self.weights = weights
        self.loc = loc
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.names: dict[tuple[int, int], str] = {}
        self.used: set[str] = set()
        self.wide: dict[str, str] = {}  # narrow tensor -> its FLOAT copy
        self.nbits = nbits  # the weight-only matmuls written as MatMulNBits (NBitsPlan)
        self.notes: list[str] = list(nbits.notes)

    # ---- names and helpers ---------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        name, k = hint, 1
        while name in self.used:
            name = f"{hint}_{k}"
            k += 1
        self.used.add(name)
        return name

    def node(self, op: str, inputs: list[str], hint: str, **attrs) -> str:
        out = self.fresh(hint)
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def init(self, arr: np.ndarray, hint: str) -> str:
        name = self.fresh(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def ints(self, values, hint: str) -> str:
        return self.init(np.asarray(values, np.int64), hint)

    def error(self, n: int, message: str) -> DiagnosticError:
        return DiagnosticError.at(self.f.data(n)["loc"], message)

    def index(self, name: str, t: TensorType, takes: tuple[str, ...]) -> str:
        """An index operand in a type the ONNX op `takes` (Gather: INT32/INT64, GatherND and
        ScatterND: INT64): any other integer type is Cast to INT64, which holds its values."""
        if t.elem in takes:
            return name
        return self.node("Cast", [name], f"{name}_i64", to=TensorProto.INT64)

    def as_float(self, name: str, t: TensorType) -> str:
        """The FLOAT copy of a narrow float tensor (one Cast per tensor)."""
        if not _rounds(t.elem):
            return name
        if name not in self.wide:
            self.wide[name] = self.node("Cast", [name], f"{name}_f32", to=TensorProto.FLOAT)
        return self.wide[name]

    # ---- the walk ------------------------------------------------------------------------
    def run(self, graph_name: str) -> onnx.ModelProto:
        f = self.f
        inputs = []
        for a in f.args:
            t = f.types(a)[0]
            why = _unexportable(t.elem)
            if why is not None:
                raise self.error(a, f"argument %{f.data(a)['name']} has type {t}: "
                                    f"{t.elem}{why}; not exported")
            self._note_type(t)
            name = self.fresh(f.data(a)["name"])
            io = _IO_AS.get(t.elem)
            if io is None or self.narrow_io:
                inputs.append(_value_info(name, t))
                self.names[(a, 0)] = name
                continue
            outer = self.fresh(f"{name}_{io}")
            inputs.append(_value_info(outer, t.with_elem(io)))
            # The executor keeps an argument's NaN and infinities (an inf is inf in f8E5M2,
            # NaN in f8E4M3FN); ONNX's saturating float8 Cast would make an inf the largest
            # finite value. A finite value out of range is the executor's error.
            extra = {"saturate": 0} if t.elem.startswith("f8") else {}
            self.nodes.append(helper.make_node("Cast", [outer], [name], name=name,
                                               to=ONNX_TYPE[t.elem], **extra))
            self.names[(a, 0)] = name
        outputs = []
        for n in f.ops():
            d = f.data(n)
            if d["op"] == RETURN:
                for i, v in enumerate(f.operands(n)):
                    src = self.names[v]
                    t = f.type_of(v)
                    # A graph output needs its own name: not an input, initializer or repeat.
                    io = None if self.narrow_io else _IO_AS.get(t.elem)
                    if io is not None:
                        src = self.node("Cast", [src], f"{src}_{io}", to=ONNX_TYPE[io])
                        t = t.with_elem(io)
                    elif src in {i.name for i in inputs} or \
                            src in {x.name for x in self.inits} or \
                            src in {o.name for o in outputs}:
                        src = self.node("Identity", [src], f"output_{i}")
                    outputs.append(_value_info(src, t))
                continue
            self._op(n)
        self._note_weight_only_matmuls()
        graph = helper.make_graph(self.nodes, graph_name, inputs, outputs, self.inits)
        opsets = [helper.make_opsetid("", OPSET)]
        if self.nbits.layers:
            from mplower.onnx.exporter.nbits import MS_DOMAIN

            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        model = helper.make_model(graph, opset_imports=opsets,
                                  ir_version=IR_VERSION, producer_name="mplower")
        if self.notes:
            model.doc_string = "; ".join(sorted(set(self.notes)))
        return model

    def _note_weight_only_matmuls(self) -> None:
        """A float activation times a dequantized constant weight is what onnxruntime's
        default optimizations turn into MatMulNBits, which quantizes the activation too."""
        inits = {t.name for t in self.inits}
        dq_of_const = {n.output[0] for n in self.nodes
                       if n.op_type == "DequantizeLinear" and n.input[0] in inits}
        dq = {n.output[0] for n in self.nodes if n.op_type == "DequantizeLinear"}
        for n in self.nodes:
            if n.op_type == "MatMul" and n.input[1] in dq_of_const and n.input[0] not in dq:
                self.notes.append(
                    "weight-only int8 matmuls: onnxruntime's default graph optimizations fuse "
                    "them into MatMulNBits, which also quantizes the activations; set the "
                    "session option session.disable_quant_qdq=1 to run them as exported")
                return

    def _note_type(self, t: TensorType) -> None:
        if t.elem == "tf32":
            self.notes.append("tf32 has no ONNX type: tf32 tensors are exported as FLOAT and "
                              "their tf32 rounding is dropped")

    def _op(self, n: int) -> None:
        if n in self.nbits.absorbed:
            return
        f = self.f
        d = f.data(n)
        if n in self.nbits.layers:  # its weight operand was never exported
            from mplower.onnx.exporter.nbits import emit_nbits

            x = self.names[f.operands(n)[0]]
            self.names[(n, 0)] = emit_nbits(self, self.nbits.layers[n], x, d["name"])
            return
        op = d["op"]
        opdef = OPS.get(op)
        if opdef is None:
            raise self.error(n, f"'{op}' has no ONNX export")
        attrs = check_attrs(opdef, d["attrs"])
        out_t = d["types"][0]
        self._note_type(out_t)
        q_elem = attr_type(attrs["dtype"]) if op == "mp.fake_quant" else None
        for elem in (out_t.elem, q_elem, *(t.elem for t in f.operand_types(n))):
            why = None if elem is None else _unexportable(elem)
            if why is not None:
                raise self.error(n, f"'{op}' uses {elem}{why}; not exported")
        ins = [self.names[v] for v in f.operands(n)]
        in_types = f.operand_types(n)
        hint = d["name"]
        if op == "mp.constant":
            self.names[(n, 0)] = self.init(self._constant(n, attrs, out_t), hint)
            return
        if op == "mp.split":
            self._split(n, attrs, ins[0], in_types[0], len(d["types"]), hint)
            return
        if attrs.get(ACCUM) is not None and attr_type(attrs[ACCUM]) == "f16":
            self.notes.append("f16 accumulation has no ONNX form: exported with f32 "
                              "accumulation")
        if op == "mp.sparse_encode":
            self.notes.append("sparse encodings are exported as dense tensors")
        if op == "mp.scaled_quant":
            self.names[(n, 0)] = self._scaled_quant(n, attrs, ins[0], in_types[0], out_t, hint)
            return
        if op in CONVERSIONS:
            self.names[(n, 0)] = self._conversion(n, op, attrs, ins[0], in_types[0], out_t,
                                                  hint)
            return
        if op in CONTRACTIONS and FORMATS[in_types[0].elem].is_int:
            self.names[(n, 0)] = self._integer_contraction(n, op, attrs, ins, in_types, hint)
            return
        # Asked of the op, not of a set taken when the dialect loaded: an op defined later moves.
        moves = Trait.DATA_MOVEMENT in opdef.traits
        if moves and out_t.elem not in _NO_NATIVE_MOVES:
            self.names[(n, 0)] = self._emit(op, attrs, ins, in_types, out_t, hint)
            return
        if moves and out_t.elem == "i4":
            wide = [self.node("Cast", [x], f"{x}_i8", to=TensorProto.INT8) for x in ins]
            y = self._emit(op, attrs, wide, in_types, out_t, f"{hint}_i8")
            self.names[(n, 0)] = self.node("Cast", [y], hint, to=TensorProto.INT4)
            return
        # Arithmetic: narrow floats compute in FLOAT and round back, as the executor does.
        wide_ins = [self.as_float(x, t) for x, t in zip(ins, in_types)]
        y = self._emit(op, attrs, wide_ins, in_types, out_t,
                       f"{hint}_f32" if _rounds(out_t.elem) else hint)
        self.names[(n, 0)] = self.round_to(y, out_t.elem, hint)

    def round_to(self, y: str, elem: str, hint: str) -> str:
        """A FLOAT result `y` of arithmetic in element type `elem`: Cast to `elem` where that
        is a narrow float (the one rounding the executor does), else `y` itself. The executor
        rounds arithmetic without saturating (an fp8 overflow is inf or NaN, as IEEE rounding
        gives), where ONNX's Cast to float8 saturates unless told not to."""
        if not _rounds(elem):
            return y
        extra = {"saturate": 0} if elem.startswith("f8") else {}
        return self.node("Cast", [y], hint, to=ONNX_TYPE[elem], **extra)

    def rounded_wide(self, y: str, t: TensorType, hint: str) -> str:
        """A FLOAT result `y` of arithmetic rounded to `t`'s element type and read back as FLOAT,
        exactly what an op of result type `t` hands the next op in the unfused export."""
        return self.as_float(self.round_to(y, t.elem, hint), t)

    def _split(self, n: int, a: dict, x: str, in_t: TensorType, parts: int, hint: str) -> None:
        """ONNX Split with its `split` input (opset >= 13), one output per result. Split has
        no float8 or int4 kernel: those split in the type `_IO_AS` widens them to and cast
        back, as the other moves do."""
        wide = _IO_AS.get(in_t.elem) if in_t.elem in _NO_NATIVE_MOVES else None
        if wide is not None:
            x = self.node("Cast", [x], f"{x}_{wide}", to=ONNX_TYPE[wide])
        outs = [self.fresh(f"{hint}_{k}_{wide}" if wide else f"{hint}_{k}")
                for k in range(parts)]
        self.nodes.append(helper.make_node(
            "Split", [x, self.ints(a["sizes"], f"{hint}_sizes")], outs, name=outs[0],
            axis=a["axis"]))
        for k, y in enumerate(outs):
            self.names[(n, k)] = y if wide is None else \
                self.node("Cast", [y], f"{hint}_{k}", to=ONNX_TYPE[in_t.elem])

    # ---- one op --------------------------------------------------------------------------
    def _emit(self, op: str, a: dict, ins: list[str], in_types: list[TensorType],
              out_t: TensorType, hint: str) -> str:
        emit = EMITTERS.get(op)
        if emit is None:
            raise DiagnosticError.at(self.loc, f"'{op}' has no ONNX export")
        return emit(self, op, a, ins, in_types, out_t, hint)

    def _rms_norm(self, a: dict, ins: list[str], x_t: TensorType, hint: str) -> str:
        x, gamma = ins
        axes = self.ints(range(a["axis"] % x_t.rank, x_t.rank), f"{hint}_axes")
        sq = self.node("Mul", [x, x], f"{hint}_sq")
        ms = self.node("ReduceMean", [sq, axes], f"{hint}_ms", keepdims=1)
        eps = self.init(np.array(a["epsilon"], np.float64 if x_t.elem == "f64" else np.float32),
                        f"{hint}_eps")
        root = self.node("Sqrt", [self.node("Add", [ms, eps], f"{hint}_ms_eps")],
                         f"{hint}_rms")
        return self.node("Mul", [self.node("Div", [x, root], f"{hint}_normed"), gamma], hint)

    def _conversion(self, n: int, op: str, a: dict, x: str, in_t: TensorType,
                    out_t: TensorType, hint: str) -> str:
        if op == "mp.cast":
            return self._cast(a, x, in_t, out_t, hint)
        scale, zp, axis = _quant_params(a)
        if op == "mp.dequantize":
            q_elem = in_t.elem
        elif op == "mp.quantize":
            q_elem = out_t.elem
        else:
            q_elem = attr_type(a["dtype"])
        codes = QUANT_STORAGE if op == "mp.dequantize" else QUANT_INTS
        if q_elem not in codes + QUANT_WIDE + QUANT_FLOATS:
            raise self.error(n, f"{op} to {q_elem} has no ONNX QuantizeLinear form")
        return self._qdq(op, x, in_t, out_t, scale, zp, q_elem, axis, hint)

    def _qdq(self, op: str, x: str, in_t: TensorType, out_t: TensorType, scale: np.ndarray,
             zp: np.ndarray, q_elem: str, axis: dict, hint: str) -> str:
        """QuantizeLinear and/or DequantizeLinear with constant scale and zero point."""
        s = self.init(scale, f"{hint}_scale")
        z = self.init(zp.astype(helper.tensor_dtype_to_np_dtype(ONNX_TYPE[q_elem])),
                      f"{hint}_zero_point")
        if op in ("mp.quantize", "mp.fake_quant", "mp.scaled_quant"):
            q = self.node("QuantizeLinear", [self.as_float(x, in_t), s, z],
                          hint if op == "mp.quantize" else f"{hint}_q", **axis)
            if op == "mp.quantize":
                return q
            x = q
        wide = _rounds(out_t.elem) and op != "mp.scaled_quant"
        y = self.node("DequantizeLinear", [x, s, z], f"{hint}_f32" if wide else hint, **axis)
        return self.node("Cast", [y], hint, to=ONNX_TYPE[out_t.elem]) if wide else y

    def _scaled_quant(self, n: int, a: dict, x: str, in_t: TensorType, out_t: TensorType,
                      hint: str) -> str:
        """A QuantizeLinear/DequantizeLinear pair with the recipe's scales: constants for the
        static recipe and for a constant operand (a weight, whose scales are computed now),
        computed in the graph from the tensor's amax for the current recipe. The result is the
        FLOAT tensor of the scaled values, which the consuming GEMM reads as it is."""
        from mplower.numerics import mx

        elem, recipe = out_t.elem, a["recipe"]
        src = self.f.operands(n)[0][0]
        weight = self.f.op(src) == "mp.constant"
        if recipe == "current" and not weight:
            y = self._current_scaled(a, x, in_t, out_t, hint)
            self.wide[y] = y
            return y
        if recipe != "static" and not weight:
            raise self.error(n, (
                f"mp.scaled_quant with recipe \"{recipe}\" computes its scales from the data "
                f"at run time{' and its history' if recipe == 'delayed' else ' per block'}, "
                f"which the exported graph cannot; export recipe \"static\" (calibrate, "
                f"then scale-recipes{{recipe=static}}) or \"current\""))
        w = self._constant(src, check_attrs(OPS["mp.constant"], self.f.attrs_of(src)),
                           in_t).astype(np.float32) if weight else None
        zero = np.zeros((), np.float32)
        if recipe != "block":
            amax = a["amax"] if w is None else float(np.max(np.abs(w))) if w.size else 0.0
            sf = np.float32(mx.encode_factor(amax, elem, a["margin"], pow2=a["pow2"]))
            scale = np.float32(1) / sf
            y = self._qdq("mp.scaled_quant", x, in_t, out_t, np.array(scale), zero, elem, {},
                          hint)
        else:
            block = tuple(a["block"])
            r = mx.quantize_blocked(w, elem, block, a["scale_format"])
            kept = [i for i, (b, d) in enumerate(zip(block, w.shape)) if b < d]
            if a["scale_format"] == "f32" and len(kept) == 1 and block[kept[0]] == 1:
                # One block per slice along one axis (per-channel weights): ONNX's per-axis
                # QuantizeLinear with a 1-D scale, as TensorRT's explicit fp8 quantization
                # takes it.
                y = self._qdq("mp.scaled_quant", x, in_t, out_t, r.scales.reshape(-1),
                              np.zeros(r.scales.size, np.float32), elem, {"axis": kept[0]},
                              hint)
            else:
                axes = [i for i, b in enumerate(block) if b > 1] or [w.ndim - 1]
                axis = axes[0]
                scales = r.scales  # one per block; a 2-D block repeats along its other axes
                for i in axes[1:]:
                    scales = np.repeat(scales, block[i], axis=i)[tuple(
                        slice(0, d) if j == i else slice(None) for j, d in enumerate(w.shape))]
                y = self._qdq("mp.scaled_quant", x, in_t, out_t, scales.astype(np.float32),
                              np.zeros(scales.shape, np.float32), elem,
                              {"axis": axis, "block_size": block[axis]}, hint)
        self.wide[y] = y  # already FLOAT: the GEMM needs no Cast
        return y

    def _current_scaled(self, a: dict, x: str, in_t: TensorType, out_t: TensorType,
                        hint: str) -> str:
        """Current scaling in the graph: sf = fmt_max / amax / 2^margin (1 where amax is 0 or
        not finite), QuantizeLinear / DequantizeLinear with the scale 1 / sf."""
        x = self.as_float(x, in_t)
        f32 = np.float32
        amax = self.node("ReduceMax", [self.node("Abs", [x], f"{hint}_abs")], f"{hint}_amax",
                         keepdims=0)
        top = self.init(np.array(FORMATS[out_t.elem].max_finite, f32), f"{hint}_fmax")
        sf = self.node("Div", [top, amax], f"{hint}_sf")
        if a["margin"]:
            sf = self.node("Div", [sf, self.init(np.array(2.0 ** a["margin"], f32),
                                                 f"{hint}_margin")], f"{hint}_sf_margin")
        zero, one = self.init(np.array(0, f32), f"{hint}_zero"), self.init(
            np.array(1, f32), f"{hint}_one")
        ok = self.node("And", [self.node("Greater", [amax, zero], f"{hint}_positive"),
                               self.node("Not", [self.node("IsInf", [amax], f"{hint}_inf")],
                                         f"{hint}_finite")], f"{hint}_usable")
        if a["pow2"]:  # 2^floor(log2 sf), corrected by one step where Log rounded across
            two = self.init(np.array(2, f32), f"{hint}_two")
            e = self.node("Floor", [self.node("Div", [
                self.node("Log", [sf], f"{hint}_ln"),
                self.init(np.array(np.log(2), f32), f"{hint}_ln2")], f"{hint}_log2")],
                f"{hint}_exp")
            p = self.node("Pow", [two, e], f"{hint}_p")
            up = self.node("Mul", [p, two], f"{hint}_p2")
            p = self.node("Where", [self.node("LessOrEqual", [up, sf], f"{hint}_low"), up, p],
                          f"{hint}_p_up")
            half = self.node("Div", [p, two], f"{hint}_p_half")
            sf = self.node("Where", [self.node("Greater", [p, sf], f"{hint}_high"), half, p],
                           f"{hint}_pow2")
        sf = self.node("Where", [ok, sf, one], f"{hint}_encode")
        s = self.node("Div", [one, sf], f"{hint}_scale")
        z = self.init(np.zeros((), helper.tensor_dtype_to_np_dtype(ONNX_TYPE[out_t.elem])),
                      f"{hint}_zero_point")
        q = self.node("QuantizeLinear", [x, s, z], f"{hint}_q")
        return self.node("DequantizeLinear", [q, s, z], hint)

    def _cast(self, a: dict, x: str, in_t: TensorType, out_t: TensorType, hint: str) -> str:
        src, dst = in_t.elem, out_t.elem
        if ONNX_TYPE[src] == ONNX_TYPE[dst]:  # f32 <-> tf32
            return self.node("Identity", [x], hint)
        attrs = {}
        if dst.startswith("f8"):
            attrs["saturate"] = int(a.get("saturate", True))
        if src in NARROW_FLOATS and dst != "f32":
            x = self.as_float(x, in_t)  # a narrow value is exact in FLOAT: one rounding
        if FORMATS[src].is_float and FORMATS[dst].is_int and dst != "i1":
            # mplower saturates out-of-range values (ONNX leaves them undefined): clip first.
            fmt = FORMATS[dst]
            dtype = np.float64 if src == "f64" else np.float32
            x = self.as_float(x, in_t)
            lo = self.init(np.array(fmt.min_value, dtype), f"{hint}_lo")
            hi = self.init(np.array(fmt.max_finite, dtype), f"{hint}_hi")
            x = self.node("Clip", [x, lo, hi], f"{hint}_clipped")
        return self.node("Cast", [x], hint, to=ONNX_TYPE[dst], **attrs)

    def _integer_contraction(self, n: int, op: str, a: dict, ins: list[str],
                             in_types: list[TensorType], hint: str) -> str:
        out_t = self.f.types(n)[0]
        if out_t.elem != "i32" or any(t.elem not in ("i8", "ui8") for t in in_types[:2]):
            raise self.error(n, f"{op} on {in_types[0].elem} x {in_types[1].elem} -> "
                                f"{out_t.elem} has no ONNX form (MatMulInteger/ConvInteger "
                                f"give i32 from 8-bit operands)")
        if op == "mp.matmul":
            return self.node("MatMulInteger", ins[:2], hint)
        y = self.node("ConvInteger", ins[:2], hint if len(ins) == 2 else f"{hint}_nobias",
                      strides=list(a["strides"]), pads=list(a["padding"]),
                      dilations=list(a["dilations"]), group=a["groups"])
        if len(ins) == 3:
            bias = ins[2]
            if in_types[2].elem != "i32":
                bias = self.node("Cast", [bias], f"{hint}_bias_i32", to=TensorProto.INT32)
            shaped = self.node("Reshape", [bias, self.ints((1, -1, 1, 1), f"{hint}_bshape")],
                               f"{hint}_bias")
            y = self.node("Add", [y, shaped], hint)
        return y

    def _constant(self, n: int, a: dict, t: TensorType) -> np.ndarray:
        if isinstance(a.get("value"), DenseAttr):
            raw = a["value"].array
        else:
            raw = self.weights.get(a["name"], t.shape, self.f.data(n)["loc"])
        return _in_onnx_type(raw, t.elem)


# ---------------------------------------------------------------------------------------------
# Emitters: one per mp op, keyed by op name as the importer's handlers are keyed by ONNX op
# type. Each gets the exporter (as `self`: they are its methods in all but place), the op name,
# its checked attributes, the ONNX names and types of its operands (FLOAT copies where the op
# computes on a narrow float) and its result type, and returns the name of its ONNX result.
# An op without one is an error naming it; a new op registers here, not in a branch of _emit.

Emitter = Callable[["_Exporter", str, dict, list[str], list[TensorType], TensorType, str], str]
EMITTERS: dict[str, Emitter] = {}


def emitter(*ops: str) -> Callable[[Emitter], Emitter]:
    def register(fn: Emitter) -> Emitter:
        for op in ops:
            EMITTERS[op] = fn
        return fn
    return register


def _in_onnx_type(raw: np.ndarray, elem: str) -> np.ndarray:
    """Constant values in the numpy dtype of the ONNX type of `elem`, rounded exactly as
    mplower's executor rounds a constant of that type."""
    fmt = FORMATS[elem]
    if fmt.is_float and elem not in ("f64", "f32", "tf32"):
        from mplower.numerics.rounding import round_to

        vals = round_to(np.ascontiguousarray(raw, dtype=np.float32), elem)[0]
        return vals.astype(helper.tensor_dtype_to_np_dtype(ONNX_TYPE[elem]))
    if elem == "tf32":
        from mplower.numerics.rounding import round_to

        return round_to(np.ascontiguousarray(raw, dtype=np.float32), elem)[0]
    dtype = helper.tensor_dtype_to_np_dtype(ONNX_TYPE[elem])
    if fmt.is_int and elem != "i1":
        return np.clip(raw, fmt.min_value, fmt.max_finite).astype(dtype)
    return np.asarray(raw).astype(dtype)


def _quant_params(a: dict) -> tuple[np.ndarray, np.ndarray, dict]:
    """The scale, zero point and axis attributes of the QuantizeLinear/DequantizeLinear of a
    conversion with attributes `a`."""
    scale = attr_array(a["scale"]).astype(np.float32)
    zp = attr_array(a.get("zero_point", 0))
    axis = {}
    if a.get("block_size"):  # ONNX 21 blocked: both of x's rank, ceil(D / B) on axis
        shape = scale.shape if scale.size > 1 else zp.shape
        scale, zp = (np.broadcast_to(v, shape) for v in (scale, zp))
        axis = {"axis": a["axis"], "block_size": a["block_size"]}
    elif max(scale.size, zp.size) > 1:  # per axis: ONNX wants both as 1-D of one length
        size = max(scale.size, zp.size)
        scale, zp = (np.broadcast_to(v.reshape(-1), (size,)) for v in (scale, zp))
        axis = {"axis": a["axis"]}
    return scale, zp, axis


def _rounds(elem: str) -> bool:
    """Whether arithmetic in `elem` computes in FLOAT and is Cast back (tf32 has no ONNX type:
    its rounding is dropped with a note)."""
    return elem in NARROW_FLOATS and elem != "tf32"


def _unexportable(elem: str) -> str | None:
    """Why a value of element type `elem` cannot be exported (the clause that follows the
    type's name in a message), or None when it can."""
    if elem in _NO_RUNTIME:
        return f": it would be exported as {_NO_RUNTIME[elem]}"
    if elem == "f8E8M0FNU":  # a block-scale type; ONNX's FLOAT8E8M0 came with opset 24
        return (f", which has no ONNX type at opset {OPSET} (FLOAT8E8M0 needs opset 24, "
                f"which onnxruntime's CPU provider does not run)")
    if elem not in ONNX_TYPE:
        return ", which has no ONNX type (ONNX has FLOAT8 and FLOAT4E2M1, no 6-bit float)"
    return None


def _value_info(name: str, t: TensorType) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, ONNX_TYPE[t.elem], list(t.shape))

