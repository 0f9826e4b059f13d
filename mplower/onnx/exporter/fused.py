"""ONNX export emitters of the fused ops of the `fuse` pass (mplower.dialect.fused and
fused_conv): each exports as the nodes of the ops it fuses, each rounded to its format as the
unfused export rounds it, so the graph computes each fused op's reference, the composition of
those ops' references."""

from __future__ import annotations

from mplower.ir.opdef import attr_type
from mplower.ir.types import TensorType
from mplower.onnx.exporter.core import _Exporter, _quant_params, emitter


@emitter("mp.add_relu")
def _add_relu(self: _Exporter, op: str, a: dict, ins: list[str],
              in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    s = self._emit("mp.add", {}, ins, in_types, out_t, f"{hint}_add_f32")
    s = self.rounded_wide(s, out_t, f"{hint}_add")
    return self._emit("mp.relu", {}, [s], [out_t], out_t, hint)


@emitter("mp.fused_matmul")
def _fused_matmul(self: _Exporter, op: str, a: dict, ins: list[str],
                  in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    addends = list(zip(ins[2:], in_types[2:]))
    last = hint if not addends else f"{hint}_mm"
    if "scale" in a:  # i8 x i8 -> exact i32 sums, dequantized to f32 (zero point 0)
        acc = self.node("MatMulInteger", ins[:2], f"{hint}_acc")
        scale, zp, axis = _quant_params({"scale": a["scale"], "zero_point": 0, "axis": -1})
        y = self._qdq("mp.dequantize", acc, out_t.with_elem("i32"), out_t, scale,
                      zp, "i32", axis, last)
    else:
        y = self._emit("mp.matmul", {}, ins[:2], in_types[:2], out_t, f"{last}_f32")
    # What the product and each add round to; _op rounds the last add, to the result type.
    steps = [out_t.with_elem(e) for e in a.get("formats") or (out_t.elem,) * len(addends)]
    steps.append(out_t)
    for i, (b, b_t) in enumerate(addends):
        self._note_type(steps[i])
        y = self.rounded_wide(y, steps[i], last if i == 0 else f"{hint}_add{i}")
        y = self._emit("mp.add", {}, [y, b], [steps[i], b_t], steps[i + 1],
                       hint if i == len(addends) - 1 else f"{hint}_add{i + 1}_f32")
    return y


@emitter("mp.fused_conv2d")
def _fused_conv2d(self: _Exporter, op: str, a: dict, ins: list[str],
                  in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    x, w = ins[:2]
    x_t = in_types[0]
    if a["shuffle"] > 1:  # ShuffleNet's reshape, swap, reshape
        n, c, h, wd = x_t.shape
        g = a["shuffle"]
        x = self.node("Reshape", [x, self.ints((n, g, c // g, h, wd), f"{hint}_groups")],
                      f"{hint}_split")
        x = self.node("Transpose", [x], f"{hint}_swap", perm=[0, 2, 1, 3, 4])
        x = self.node("Reshape", [x, self.ints(x_t.shape, f"{hint}_shape")], f"{hint}_shuffled")
    geometry = {"strides": list(a["strides"]), "pads": list(a["padding"]),
                "dilations": list(a["dilations"]), "group": a["groups"]}
    f32 = out_t.with_elem("f32")
    if "scale" in a:  # 8-bit operands: exact i32 sums, dequantized (zero point 0)
        acc = self.node("ConvInteger", [x, w], f"{hint}_acc", **geometry)
        scale, zp, axis = _quant_params({"scale": a["scale"], "zero_point": 0, "axis": 1})
        y = self._qdq("mp.dequantize", acc, out_t.with_elem("i32"), f32, scale, zp, "i32",
                      axis, f"{hint}_dq")
    else:
        y = self.node("Conv", [x, w], f"{hint}_conv", **geometry)
    if len(ins) == 3:  # one value per channel, added in FLOAT
        bias = self.node("Reshape", [ins[2], self.ints((1, -1, 1, 1), f"{hint}_bshape")],
                         f"{hint}_bias")
        y = self.node("Add", [y, bias], f"{hint}_biased")
    if a["relu"]:  # before the rounding to the result type (RELU_BEFORE_ROUNDING): the same
        y = self.node("Relu", [y], f"{hint}_relu")
    if "out_dtype" in a:
        q = attr_type(a["out_dtype"])
        scale, zp, axis = _quant_params({"scale": a["out_scale"],
                                         "zero_point": a["out_zero_point"], "axis": 1})
        y = self._qdq("mp.quantize" if out_t.elem == q else "mp.fake_quant", y, f32, out_t,
                      scale, zp, q, axis, hint)
    return y


_BINARY = {"add": "mp.add", "sub": "mp.sub", "mul": "mp.mul"}


@emitter("mp.fused_binary")
def _fused_binary(self: _Exporter, op: str, a: dict, ins: list[str],
                  in_types: list[TensorType], out_t: TensorType, hint: str) -> str:
    # The op in FLOAT, rounded to its format and read back; the walk rounds to the result's.
    inner = out_t.with_elem(attr_type(a["formats"][0]))
    y = self._emit(_BINARY[a["kind"]], {}, ins, in_types, inner, f"{hint}_op")
    return self.rounded_wide(y, inner, f"{hint}_{inner.elem}")
