"""ONNX export emitters of the core mp ops (one per op or op group, in `EMITTERS`)."""

from __future__ import annotations

from onnx import TensorProto

from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.types import TensorType
from mplower.onnx.exporter.core import (
    _SIMPLE,
    _Exporter,
    emitter,
)


@emitter(*_SIMPLE)
def _simple(self: _Exporter, op: str, a: dict, ins: list[str],
            in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node(_SIMPLE[op], ins, hint)


@emitter("mp.rsqrt")
def _rsqrt(self: _Exporter, op: str, a: dict, ins: list[str],
           in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("Reciprocal", [self.node("Sqrt", ins, f"{hint}_sqrt")], hint)


@emitter("mp.gelu")
def _gelu(self: _Exporter, op: str, a: dict, ins: list[str],
          in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("Gelu", ins, hint, approximate=a["approximate"])


@emitter("mp.softmax", "mp.log_softmax")
def _softmax(self: _Exporter, op: str, a: dict, ins: list[str],
             in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("Softmax" if op == "mp.softmax" else "LogSoftmax", ins, hint,
                     axis=a["axis"])


@emitter("mp.layer_norm")
def _layer_norm(self: _Exporter, op: str, a: dict, ins: list[str],
                in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("LayerNormalization", ins, hint, axis=a["axis"],
                     epsilon=a["epsilon"])


@emitter("mp.rms_norm")
def _rms_norm(self: _Exporter, op: str, a: dict, ins: list[str],
              in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self._rms_norm(a, ins, in_types[0], hint)


@emitter("mp.reduce_sum", "mp.reduce_mean", "mp.reduce_max")
def _reduce_sum(self: _Exporter, op: str, a: dict, ins: list[str],
                in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    onnx_op = {"mp.reduce_sum": "ReduceSum", "mp.reduce_mean": "ReduceMean",
               "mp.reduce_max": "ReduceMax"}[op]
    axes = [self.ints(a["axes"], f"{hint}_axes")] if a["axes"] else []
    return self.node(onnx_op, ins + axes, hint, keepdims=int(a["keepdims"]))


@emitter("mp.argmax")
def _argmax(self: _Exporter, op: str, a: dict, ins: list[str],
            in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    idx = self.node("ArgMax", ins, f"{hint}_i64", axis=a["axis"],
                    keepdims=int(a["keepdims"]))
    return self.node("Cast", [idx], hint, to=TensorProto.INT32)


@emitter("mp.reshape")
def _reshape(self: _Exporter, op: str, a: dict, ins: list[str],
             in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    extra = {"allowzero": 1} if 0 in out_t.shape else {}  # a 0 is a zero dim, not "copy"
    return self.node("Reshape", [ins[0], self.ints(out_t.shape, f"{hint}_shape")], hint,
                     **extra)


@emitter("mp.transpose")
def _transpose(self: _Exporter, op: str, a: dict, ins: list[str],
               in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    perm = a.get("perm", tuple(reversed(range(in_types[0].rank))))
    return self.node("Transpose", ins, hint, perm=list(perm))


@emitter("mp.concat")
def _concat(self: _Exporter, op: str, a: dict, ins: list[str],
            in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("Concat", ins, hint, axis=a["axis"])


@emitter("mp.slice")
def _slice(self: _Exporter, op: str, a: dict, ins: list[str],
           in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    rank = in_types[0].rank
    steps = a.get("steps", (1,) * rank)
    return self.node("Slice", [ins[0], self.ints(a["starts"], f"{hint}_starts"),
                               self.ints(a["ends"], f"{hint}_ends"),
                               self.ints(range(rank), f"{hint}_axes"),
                               self.ints(steps, f"{hint}_steps")], hint)


@emitter("mp.flatten")
def _flatten(self: _Exporter, op: str, a: dict, ins: list[str],
             in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("Flatten", ins, hint, axis=a["axis"])


@emitter("mp.sparse_encode")
def _sparse_encode(self: _Exporter, op: str, a: dict, ins: list[str],
                   in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("Identity", ins, hint)


@emitter("mp.max_pool2d", "mp.avg_pool2d")
def _max_pool2d(self: _Exporter, op: str, a: dict, ins: list[str],
                in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    extra = {} if op == "mp.max_pool2d" else {"count_include_pad": 0}
    return self.node("MaxPool" if op == "mp.max_pool2d" else "AveragePool", ins, hint,
                     kernel_shape=list(a["kernel"]), strides=list(a["strides"]),
                     pads=list(a["padding"]), **extra)


@emitter("mp.matmul")
def _matmul(self: _Exporter, op: str, a: dict, ins: list[str],
            in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("MatMul", ins, hint)


@emitter("mp.conv2d")
def _conv2d(self: _Exporter, op: str, a: dict, ins: list[str],
            in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("Conv", ins, hint, strides=list(a["strides"]),
                     pads=list(a["padding"]), dilations=list(a["dilations"]),
                     group=a["groups"])


@emitter("mp.lrn")
def _lrn(self: _Exporter, op: str, a: dict, ins: list[str],
         in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("LRN", ins, hint, size=a["size"], alpha=a["alpha"],
                     beta=a["beta"], bias=a["bias"])


@emitter("mp.gather", "mp.gather_elements")
def _gather(self: _Exporter, op: str, a: dict, ins: list[str],
            in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    ins = [ins[0], self.index(ins[1], in_types[1], ("i32", "i64"))]
    return self.node("Gather" if op == "mp.gather" else "GatherElements", ins, hint,
                     axis=a["axis"])


@emitter("mp.gather_nd")
def _gather_nd(self: _Exporter, op: str, a: dict, ins: list[str],
               in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    ins = [ins[0], self.index(ins[1], in_types[1], ("i64",))]
    return self.node("GatherND", ins, hint, batch_dims=a["batch_dims"])


@emitter("mp.scatter_elements_add")
def _scatter_elements_add(self: _Exporter, op: str, a: dict, ins: list[str],
                          in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    ins = [ins[0], self.index(ins[1], in_types[1], ("i32", "i64")), ins[2]]
    return self.node("ScatterElements", ins, hint, axis=a["axis"], reduction="add")


@emitter("mp.scatter_nd_add")
def _scatter_nd_add(self: _Exporter, op: str, a: dict, ins: list[str],
                    in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    if a["batch_dims"] == 0:  # ScatterND has no batch dims
        ins = [ins[0], self.index(ins[1], in_types[1], ("i64",)), ins[2]]
        return self.node("ScatterND", ins, hint, reduction="add")
    raise DiagnosticError.at(self.loc, f"'{op}' has no ONNX export")


@emitter("mp.isinf")
def _isinf(self: _Exporter, op: str, a: dict, ins: list[str],
           in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("IsInf", ins, hint, detect_negative=int(a["detect_negative"]),
                     detect_positive=int(a["detect_positive"]))


@emitter("mp.expand")
def _expand(self: _Exporter, op: str, a: dict, ins: list[str],
            in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("Expand", [ins[0], self.ints(out_t.shape, f"{hint}_shape")], hint)


@emitter("mp.trilu")
def _trilu(self: _Exporter, op: str, a: dict, ins: list[str],
           in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("Trilu", [ins[0], self.ints(a["k"], f"{hint}_k")], hint,
                     upper=int(a["upper"]))


@emitter("mp.cumsum")
def _cumsum(self: _Exporter, op: str, a: dict, ins: list[str],
            in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    return self.node("CumSum", [ins[0], self.ints(a["axis"], f"{hint}_axis")], hint,
                     exclusive=int(a["exclusive"]), reverse=int(a["reverse"]))
