"""ONNX import handlers: LSTM, GRU and RNN, unrolled over their static sequence length.

A recurrent node becomes the ops the precision passes already know (mp.matmul, mp.add, mp.mul,
mp.sigmoid, mp.tanh, mp.slice, mp.concat, ...), so its matmuls take a precision like any other
matmul of the plan. Per direction, the input projection of every time step is one mp.matmul of
the whole sequence with W^T (plus the biases), and each step adds one matmul of the previous
hidden state with R^T, the gates and their activations. The state is carried as a (1, batch,
hidden) tensor, so Y is the steps' states concatenated on axis 0 with no reshape per step.

Semantics are ONNX's (docs/Operators.md, LSTM/GRU/RNN) where they are written down and
onnxruntime's where the spec is silent: activation_alpha/beta are consumed, in order, only by
the activations that take a parameter (a missing one takes the default of the ONNX op of that
name, as the spec says; onnxruntime reads uninitialized values for Affine and ScaledTanh and
uses a smaller threshold for ThresholdedRelu, so the tests give these parameters); `clip`
bounds the input of every gate activation, not that of LSTM's h(C); the steps of a sequence
past its `sequence_lens` entry leave the state unchanged and write zeros to Y, and a sequence
of length 0 ends in zero states (not its initial ones); `input_forget` makes the forget gate
1 - i. A state known to be zero (no initial_h/initial_c) is `None` here, which drops the terms
it would multiply from the first step exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.types import tensor
from mplower.numerics.formats import FORMATS
from mplower.onnx.importer.core import Const, Run, _attrs, _Importer, handler

# ONNX's activation functions for recurrent ops, with the defaults of the ONNX ops of the same
# name for (alpha, beta); None where the function takes no parameter.
_ACTIVATIONS: dict[str, tuple[float | None, float | None]] = {
    "relu": (None, None), "tanh": (None, None), "sigmoid": (None, None),
    "affine": (1.0, 0.0), "leakyrelu": (0.01, None), "thresholdedrelu": (1.0, None),
    "scaledtanh": (1.0, 1.0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, None),
    "softsign": (None, None), "softplus": (None, None),
}
_DEFAULTS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"), "RNN": ("Tanh",)}
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


class _Ops:
    """Emits the arithmetic of one recurrent node; None stands for an exact zero."""

    def __init__(self, imp: _Importer, like: Run):
        self.imp = imp
        self.onnx_type = like.onnx_type
        self.dtype = helper.tensor_dtype_to_np_dtype(like.onnx_type)
        self.elem = like.type.elem
        self.hint = ""  # names the values after the direction and step they belong to

    def emit(self, op: str, operands: Sequence[Run], attrs: dict | None = None,
             hint: str = "") -> Run:
        return self.imp.emit(op, operands, attrs, hint=hint or self.hint,
                             onnx_type=self.onnx_type)

    def scalar(self, value: float, hint: str = "scalar") -> Run:
        return self.imp.constant(np.array(value, self.dtype), hint)

    def add(self, a: Run | None, b: Run | None) -> Run | None:
        if a is None or b is None:
            return b if a is None else a
        return self.emit("mp.add", [a, b])

    def mul(self, a: Run | None, b: Run | None) -> Run | None:
        if a is None or b is None:
            return None
        return self.emit("mp.mul", [a, b])

    def matmul(self, a: Run | None, b: Run) -> Run | None:
        return None if a is None else self.emit("mp.matmul", [a, b])

    def gate(self, x: Run | None, k: int, size: int) -> Run | None:
        """Gate k of a (1, batch, gates * size) tensor."""
        if x is None:
            return None
        _, b, _ = x.type.shape
        return self.emit("mp.slice", [x], {"starts": (0, 0, k * size),
                                           "ends": (1, b, (k + 1) * size)})

    def zeros(self, shape: tuple[int, ...]) -> Run:
        return self.imp.constant(np.zeros(shape, self.dtype), "zeros")

    def clip(self, x: Run, bound: float | None) -> Run:
        if bound is None:
            return x
        x = self.emit("mp.maximum", [x, self.scalar(-bound, "clip_low")])
        return self.emit("mp.minimum", [x, self.scalar(bound, "clip_high")])

    def activation(self, fn: tuple[str, float | None, float | None], x: Run) -> Run:
        """ONNX's recurrent activation `fn` = (lower-case name, alpha, beta), composed of mp
        ops that compute it exactly as written in the spec."""
        name, alpha, beta = fn
        if name in ("relu", "tanh", "sigmoid"):
            return self.emit(f"mp.{name}", [x])
        if name == "affine":
            return self.emit("mp.add", [self.emit("mp.mul", [x, self.scalar(alpha)]),
                                        self.scalar(beta)])
        if name == "scaledtanh":
            inner = self.emit("mp.tanh", [self.emit("mp.mul", [x, self.scalar(beta)])])
            return self.emit("mp.mul", [inner, self.scalar(alpha)])
        if name == "hardsigmoid":
            lin = self.emit("mp.add", [self.emit("mp.mul", [x, self.scalar(alpha)]),
                                       self.scalar(beta)])
            return self.emit("mp.minimum", [self.emit("mp.maximum", [lin, self.scalar(0.0)]),
                                            self.scalar(1.0)])
        negative = self.imp.emit("mp.less", [x, self.scalar(0.0)], hint="negative")
        if name == "leakyrelu":
            return self.emit("mp.where", [negative, self.emit("mp.mul", [x, self.scalar(alpha)]),
                                          x])
        if name == "elu":
            em1 = self.emit("mp.sub", [self.emit("mp.exp", [x]), self.scalar(1.0)])
            return self.emit("mp.where", [negative, self.emit("mp.mul", [em1, self.scalar(alpha)]),
                                          x])
        absx = self.emit("mp.where", [negative, self.emit("mp.neg", [x]), x])
        if name == "softsign":
            return self.emit("mp.div", [x, self.emit("mp.add", [absx, self.scalar(1.0)])])
        if name == "softplus":
            # log(1 + e^x) as relu(x) + log(1 + e^-|x|): equal in real arithmetic, and e^x of a
            # large x does not overflow to inf.
            tail = self.emit("mp.log", [self.emit("mp.add", [
                self.emit("mp.exp", [self.emit("mp.neg", [absx])]), self.scalar(1.0)])])
            return self.emit("mp.add", [self.emit("mp.relu", [x]), tail])
        # thresholdedrelu: x if x >= alpha else 0, as the recurrent ops define it
        above = self.imp.emit("mp.greater_equal", [x, self.scalar(alpha)], hint="above")
        return self.emit("mp.where", [above, x, self.scalar(0.0)])


def _activations(imp: _Importer, node: onnx.NodeProto, dirs: int) -> list[list[tuple]]:
    """Per direction, the activation functions as (lower-case name, alpha, beta)."""
    a = _attrs(node)
    per_dir = len(_DEFAULTS[node.op_type])
    names = [n.decode() if isinstance(n, bytes) else str(n)
             for n in a.get("activations", _DEFAULTS[node.op_type] * dirs)]
    if len(names) != per_dir * dirs:
        raise imp.error(f"'activations' lists {len(names)} function(s); {node.op_type} with "
                        f"{dirs} direction(s) takes {per_dir * dirs} (per direction, in order)")
    alphas = list(a.get("activation_alpha", []))
    betas = list(a.get("activation_beta", []))
    out = []
    for name in names:
        key = name.lower()
        if key not in _ACTIVATIONS:
            raise imp.error(f"activation '{name}' is not one ONNX defines for {node.op_type} "
                            f"(it defines {', '.join(sorted(_ACTIVATIONS))})")
        alpha, beta = _ACTIVATIONS[key]
        if alpha is not None and alphas:
            alpha = float(alphas.pop(0))
        if beta is not None and betas:
            beta = float(betas.pop(0))
        out.append((key, alpha, beta))
    return [out[d * per_dir:(d + 1) * per_dir] for d in range(dirs)]


class _Operands:
    """The node's inputs per direction, in the shapes one step uses: weights transposed to
    (in, out), vectors 1-D, states (1, batch, hidden). Constants are cut at import time."""

    def __init__(self, imp: _Importer, ops: _Ops, node: onnx.NodeProto, layout: int):
        self.imp, self.ops, self.node, self.layout = imp, ops, node, layout

    def present(self, i: int) -> bool:
        return i < len(self.node.input) and bool(self.node.input[i])

    def matrix(self, i: int, d: int, lo: int, hi: int) -> Run:
        """input_i[d, lo:hi, :]^T."""
        v = self.imp.need_tensor(i)
        hint = f"{self.node.input[i]}_{d}_t"
        if isinstance(v, Const):
            arr = np.ascontiguousarray(v.array[d, lo:hi, :].T.astype(self.ops.dtype))
            return self.imp.constant(arr, hint)
        _, _, cols = v.type.shape
        part = self.ops.emit("mp.slice", [v], {"starts": (d, lo, 0), "ends": (d + 1, hi, cols)},
                             hint=hint)
        part = self.imp.emit("mp.reshape", [part], declared=tensor((hi - lo, cols), v.type.elem),
                             hint=hint, onnx_type=v.onnx_type)
        return self.ops.emit("mp.transpose", [part], {"perm": (1, 0)}, hint=hint)

    def vector(self, i: int, d: int, lo: int, hi: int) -> Run | None:
        """input_i[d, lo:hi] (None when the input is absent or a constant zero)."""
        if not self.present(i):
            return None
        v = self.imp.need_tensor(i)
        hint = f"{self.node.input[i]}_{d}"
        if isinstance(v, Const):
            arr = v.array[d, lo:hi].astype(self.ops.dtype)
            return None if not arr.any() else self.imp.constant(arr, hint)
        part = self.ops.emit("mp.slice", [v], {"starts": (d, lo), "ends": (d + 1, hi)},
                             hint=hint)
        return self.imp.emit("mp.reshape", [part], declared=tensor((hi - lo,), v.type.elem),
                             hint=hint, onnx_type=v.onnx_type)

    def state(self, i: int, d: int, batch: int, hidden: int) -> Run | None:
        """Initial state of direction d as (1, batch, hidden); None when absent."""
        if not self.present(i):
            return None
        v = self.imp.need_tensor(i)
        hint = f"{self.node.input[i]}_{d}"
        if isinstance(v, Const):
            arr = v.array[:, d] if self.layout else v.array[d]
            return self.imp.constant(arr.reshape(1, batch, hidden).astype(self.ops.dtype), hint)
        if self.layout:  # (batch, dirs, hidden)
            part = self.ops.emit("mp.slice", [v], {"starts": (0, d, 0),
                                                   "ends": (batch, d + 1, hidden)}, hint=hint)
            return self.ops.emit("mp.transpose", [part], {"perm": (1, 0, 2)}, hint=hint)
        return self.ops.emit("mp.slice", [v], {"starts": (d, 0, 0),
                                               "ends": (d + 1, batch, hidden)}, hint=hint)


@handler("LSTM", "GRU", "RNN")
def _recurrent(imp: _Importer, node: onnx.NodeProto) -> list:
    a = _attrs(node)
    kind = node.op_type
    x = imp.run_input(0)
    if not FORMATS[x.type.elem].is_float or x.type.rank != 3:
        raise imp.error(f"X must be a 3-D float tensor, got {x.type}")
    layout = int(a.get("layout", 0))
    if layout not in (0, 1):
        raise imp.error(f"layout {layout} is not 0 or 1")
    direction = a.get("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise imp.error(f"direction '{direction}' is not forward, reverse or bidirectional")
    dirs = 2 if direction == "bidirectional" else 1
    w = imp.need_tensor(1)
    gates = _GATES[kind]
    w_shape = w.array.shape if isinstance(w, Const) else w.type.shape
    if len(w_shape) != 3 or w_shape[0] != dirs or w_shape[1] % gates:
        raise imp.error(f"W has shape {list(w_shape)}; {kind} with {dirs} direction(s) takes "
                        f"[{dirs}, {gates} * hidden_size, input_size]")
    hidden = int(a.get("hidden_size", w_shape[1] // gates))
    if w_shape[1] != gates * hidden:
        raise imp.error(f"W has {w_shape[1]} rows; hidden_size {hidden} takes {gates * hidden}")
    ops = _Ops(imp, x)
    if layout:
        x = ops.emit("mp.transpose", [x], {"perm": (1, 0, 2)}, hint=f"{node.input[0]}_tbi")
    steps, batch, _ = x.type.shape
    if steps == 0:
        raise imp.error("X has no time steps; mplower has no empty sequence to unroll")
    lens = imp.const(4, "sequence_lens") if len(node.input) > 4 and node.input[4] else None
    masks = _masks(imp, lens, steps, batch)
    clip = float(a["clip"]) if "clip" in a else None
    if clip is not None and clip < 0:
        raise imp.error(f"clip {clip} is negative")
    fns = _activations(imp, node, dirs)
    operands = _Operands(imp, ops, node, layout)
    cell = {"LSTM": _lstm_direction, "GRU": _gru_direction, "RNN": _rnn_direction}[kind]
    ys, hs, cs = [], [], []
    for d in range(dirs):
        reverse = direction == "reverse" or d == 1
        order = range(steps - 1, -1, -1) if reverse else range(steps)
        ops.hint = f"{node.name or kind.lower()}_{'rev' if reverse else 'fwd'}"
        y, h, c = cell(ops, operands, node, x, d, hidden, list(order), masks, clip, fns[d])
        ops.hint = ""
        ys.append(y)
        hs.append(h)
        cs.append(c)
    outputs = node.output
    result: list = [None] * len(outputs)
    if len(outputs) > 0 and outputs[0]:
        parts = []
        for per_step in ys:  # each step's (1, batch, hidden), to (steps, 1, batch, hidden)
            y = _stack(ops, per_step, masks)
            parts.append(imp.emit("mp.reshape", [y], declared=tensor(
                (steps, 1, batch, hidden), y.type.elem), hint="Y", onnx_type=y.onnx_type))
        y = parts[0] if dirs == 1 else ops.emit("mp.concat", parts, {"axis": 1}, hint="Y")
        result[0] = ops.emit("mp.transpose", [y], {"perm": (2, 0, 1, 3)}) if layout else y
    for k, finals in ((1, hs), (2, cs)):
        if len(outputs) > k and outputs[k]:
            if kind != "LSTM" and k == 2:
                raise imp.error(f"{kind} has no output #2")
            finals = [f if f is not None else ops.zeros((1, batch, hidden)) for f in finals]
            if lens is not None and not np.asarray(lens).all():  # onnxruntime: zero, not h0
                ran = imp.constant(np.asarray(lens).reshape(1, batch, 1) > 0, "nonempty")
                finals = [ops.emit("mp.where", [ran, f, ops.scalar(0.0)]) for f in finals]
            v = finals[0] if dirs == 1 else ops.emit("mp.concat", finals, {"axis": 0})
            result[k] = ops.emit("mp.transpose", [v], {"perm": (1, 0, 2)}) if layout else v
    return result


def _masks(imp: _Importer, lens: np.ndarray | None, steps: int,
           batch: int) -> list[Run] | None:
    """Per step, a (1, batch, 1) i1 constant: which sequences are still running; None when
    every sequence runs the whole length."""
    if lens is None:
        return None
    lens = np.asarray(lens).reshape(-1)
    if lens.shape != (batch,):
        raise imp.error(f"sequence_lens has {lens.size} entries; the batch is {batch}")
    if (lens < 0).any() or (lens > steps).any():
        raise imp.error(f"sequence_lens {lens.tolist()} must lie in [0, {steps}]")
    if (lens == steps).all():
        return None
    return [imp.constant((t < lens).reshape(1, batch, 1), f"running_{t}") for t in range(steps)]


def _projection(ops: _Ops, operands: _Operands, x: Run, d: int, rows: int,
                bias: Run | None) -> Run:
    """X @ W[d]^T + bias over every step at once: (steps, batch, rows)."""
    xw = ops.emit("mp.matmul", [x, operands.matrix(1, d, 0, rows)], hint="xw")
    return ops.add(xw, bias)


def _step_input(ops: _Ops, xw: Run, t: int) -> Run:
    _, batch, width = xw.type.shape
    return ops.emit("mp.slice", [xw], {"starts": (t, 0, 0), "ends": (t + 1, batch, width)},
                    hint=f"xw_{t}")


def _advance(ops: _Ops, masks: list[Run] | None, t: int, new: Run, old: Run | None) -> Run:
    """The state after step t: `new` where the sequence still runs, else `old`."""
    if masks is None:
        return new
    old = old if old is not None else ops.zeros(new.type.shape)
    return ops.emit("mp.where", [masks[t], new, old], hint="state")


def _stack(ops: _Ops, per_step: dict[int, Run], masks: list[Run] | None) -> Run:
    """Y of one direction, (steps, batch, hidden): each step's new state in time order, zero
    where the sequence has ended."""
    parts = [per_step[t] if masks is None else
             ops.emit("mp.where", [masks[t], per_step[t], ops.scalar(0.0)], hint="y")
             for t in sorted(per_step)]
    return parts[0] if len(parts) == 1 else ops.emit("mp.concat", parts, {"axis": 0}, hint="y")


def _bias_sum(ops: _Ops, operands: _Operands, d: int, rows: int, rb_rows: int) -> Run | None:
    """Wb[:rows] + Rb[:rb_rows] (zero beyond) of direction d: the biases that add to the
    input projection. B holds Wb then Rb, each `rows` long."""
    if not operands.present(3):
        return None
    b = operands.imp.need_tensor(3)
    if isinstance(b, Const):
        arr = b.array[d].astype(ops.dtype)
        both = arr[:rows].copy()
        both[:rb_rows] += arr[rows:rows + rb_rows]
        return None if not both.any() else ops.imp.constant(both, f"{operands.node.input[3]}_{d}")
    wb, rb = operands.vector(3, d, 0, rows), operands.vector(3, d, rows, rows + rb_rows)
    if rb_rows < rows:
        rb = ops.emit("mp.concat", [rb, ops.zeros((rows - rb_rows,))], {"axis": 0}, hint="bias")
    return ops.add(wb, rb)


def _lstm_direction(ops: _Ops, operands: _Operands, node: onnx.NodeProto, x: Run, d: int,
                    hidden: int, order: list[int], masks: list[Run] | None, clip: float | None,
                    fns: list[tuple]) -> tuple[dict[int, Run], Run | None, Run | None]:
    f, g, h = fns
    _, batch, _ = x.type.shape
    rows = 4 * hidden
    xw = _projection(ops, operands, x, d, rows, _bias_sum(ops, operands, d, rows, rows))
    r = operands.matrix(2, d, 0, rows)
    p_i, p_o, p_f = (operands.vector(7, d, k * hidden, (k + 1) * hidden) for k in range(3))
    coupled = bool(_attrs(node).get("input_forget", 0))
    state_h, state_c = operands.state(5, d, batch, hidden), operands.state(6, d, batch, hidden)
    ys: dict[int, Run] = {}
    stem = ops.hint
    for t in order:
        ops.hint = f"{stem}_t{t}"
        pre = ops.add(_step_input(ops, xw, t), ops.matmul(state_h, r))
        i = ops.activation(f, ops.clip(ops.add(ops.gate(pre, 0, hidden),
                                               ops.mul(p_i, state_c)), clip))
        if coupled:
            fg = ops.emit("mp.sub", [ops.scalar(1.0), i], hint="forget")
        else:
            fg = ops.activation(f, ops.clip(ops.add(ops.gate(pre, 2, hidden),
                                                    ops.mul(p_f, state_c)), clip))
        cand = ops.activation(g, ops.clip(ops.gate(pre, 3, hidden), clip))
        c_new = ops.add(ops.mul(fg, state_c), ops.mul(i, cand))
        o = ops.activation(f, ops.clip(ops.add(ops.gate(pre, 1, hidden), ops.mul(p_o, c_new)),
                                       clip))
        h_new = ops.mul(o, ops.activation(h, c_new))
        state_c = _advance(ops, masks, t, c_new, state_c)
        state_h, ys[t] = _advance(ops, masks, t, h_new, state_h), h_new
    return ys, state_h, state_c


def _gru_direction(ops: _Ops, operands: _Operands, node: onnx.NodeProto, x: Run, d: int,
                   hidden: int, order: list[int], masks: list[Run] | None, clip: float | None,
                   fns: list[tuple]) -> tuple[dict[int, Run], Run | None, None]:
    f, g = fns
    _, batch, _ = x.type.shape
    rows = 3 * hidden
    before_reset = bool(_attrs(node).get("linear_before_reset", 0))
    # With linear_before_reset the h gate's R bias sits inside r * (...); else both h biases
    # add to the input projection like those of z and r.
    bias = _bias_sum(ops, operands, d, rows, 2 * hidden if before_reset else rows)
    xw = _projection(ops, operands, x, d, rows, bias)
    rb_h = operands.vector(3, d, rows + 2 * hidden, 2 * rows) if before_reset else None
    if before_reset:
        r_all = operands.matrix(2, d, 0, rows)
    else:
        r_zr, r_h = operands.matrix(2, d, 0, 2 * hidden), operands.matrix(2, d, 2 * hidden, rows)
    state = operands.state(5, d, batch, hidden)
    one = ops.scalar(1.0)
    ys: dict[int, Run] = {}
    stem = ops.hint
    for t in order:
        ops.hint = f"{stem}_t{t}"
        xt = _step_input(ops, xw, t)
        if before_reset:
            rec = ops.matmul(state, r_all)
            z = ops.activation(f, ops.clip(ops.add(ops.gate(xt, 0, hidden),
                                                   ops.gate(rec, 0, hidden)), clip))
            r = ops.activation(f, ops.clip(ops.add(ops.gate(xt, 1, hidden),
                                                   ops.gate(rec, 1, hidden)), clip))
            reset = ops.mul(r, ops.add(ops.gate(rec, 2, hidden), rb_h))
        else:
            rec = ops.matmul(state, r_zr)
            z = ops.activation(f, ops.clip(ops.add(ops.gate(xt, 0, hidden),
                                                   ops.gate(rec, 0, hidden)), clip))
            r = ops.activation(f, ops.clip(ops.add(ops.gate(xt, 1, hidden),
                                                   ops.gate(rec, 1, hidden)), clip))
            reset = ops.matmul(ops.mul(r, state), r_h)
        cand = ops.activation(g, ops.clip(ops.add(ops.gate(xt, 2, hidden), reset), clip))
        keep = ops.emit("mp.sub", [one, z], hint="update")
        h_new = ops.add(ops.mul(keep, cand), ops.mul(z, state))
        state, ys[t] = _advance(ops, masks, t, h_new, state), h_new
    return ys, state, None


def _rnn_direction(ops: _Ops, operands: _Operands, node: onnx.NodeProto, x: Run, d: int,
                   hidden: int, order: list[int], masks: list[Run] | None, clip: float | None,
                   fns: list[tuple]) -> tuple[dict[int, Run], Run | None, None]:
    _, batch, _ = x.type.shape
    xw = _projection(ops, operands, x, d, hidden, _bias_sum(ops, operands, d, hidden, hidden))
    r = operands.matrix(2, d, 0, hidden)
    state = operands.state(5, d, batch, hidden)
    ys: dict[int, Run] = {}
    stem = ops.hint
    for t in order:
        ops.hint = f"{stem}_t{t}"
        pre = ops.add(_step_input(ops, xw, t), ops.matmul(state, r))
        ys[t] = ops.activation(fns[0], ops.clip(pre, clip))
        state = _advance(ops, masks, t, ys[t], state)
    return ys, state, None
