"""Building a function of mp ops from a checkpoint: what the architecture modules share.

`Builder` appends ops whose result types come from the op definitions (so the module verifies
by construction), names each checkpoint tensor once as a weight that both functions of the
module read, and keeps those weights lazy: `LazyWeights` produces one array at a time (a view of
the mapped file, or its f32 widening or transpose) when the .npz is written, so a large
checkpoint is never held in memory whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.dialect.plan import OUTPUT_NAMES
from mplower.hf.safetensors import Checkpoint
from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.ir.graph import RETURN, Function, Value
from mplower.ir.opdef import OPS
from mplower.ir.types import DenseAttr, TensorType, tensor


class LazyWeights(Mapping[str, np.ndarray]):
    """npz key -> array, each made only when read (and not kept)."""

    def __init__(self) -> None:
        self._make: dict[str, Callable[[], np.ndarray]] = {}

    def add(self, key: str, make: Callable[[], np.ndarray]) -> None:
        self._make[key] = make

    def __getitem__(self, key: str) -> np.ndarray:
        return self._make[key]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._make)

    def __len__(self) -> int:
        return len(self._make)


class Builder:
    """Appends mp ops to one function at a time; weights are shared by all of them."""

    def __init__(self, ckpt: Checkpoint | None, loc: Location):
        self.ckpt, self.loc = ckpt, loc
        self.weights = LazyWeights()
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.f = Function("main", loc)

    def start(self, name: str, args: Sequence[tuple[str, TensorType]]) -> list[Value]:
        self.f = Function(name, self.loc)
        return [(self.f.add_arg(a, t, self.loc), 0) for a, t in args]

    def finish(self, results: Sequence[tuple[str, Value]]) -> Function:
        self.f.result_types = [self.type(v) for _, v in results]
        self.f.attrs[OUTPUT_NAMES] = tuple(n for n, _ in results)
        self.f.append_op(RETURN, [v for _, v in results], {}, [], loc=self.loc)
        return self.f

    def type(self, v: Value) -> TensorType:
        return self.f.type_of(v)

    def shape(self, v: Value) -> tuple[int, ...]:
        return self.type(v).shape

    def emit(self, op: str, operands: Sequence[Value], attrs: dict[str, Any] | None = None,
             result: tuple[int, ...] | None = None, hint: str = "") -> Value:
        attrs = attrs or {}
        ins = [self.type(v) for v in operands]
        declared = [tensor(result, ins[0].elem)] if result is not None else []
        types = OPS[op].infer(ins, attrs, declared)
        name = self.f.fresh_name(hint or op.removeprefix("mp."))
        return (self.f.append_op(op, list(operands), attrs, types, name, self.loc), 0)

    def constant(self, key: str, arr: np.ndarray | None, shape: tuple[int, ...],
                 make: Callable[[], np.ndarray] | None = None) -> Value:
        """A named f32 weight `key` (made by `make`, or `arr`), declared once per module."""
        if key not in self._shapes:
            self._shapes[key] = shape
            self.weights.add(key, make or (lambda: arr))
        t = tensor(shape, "f32")
        name = self.f.fresh_name("w")
        return (self.f.append_op("mp.constant", [], {"name": key}, [t], name, self.loc), 0)

    def scalar(self, value: float) -> Value:
        t = tensor((), "f32")
        dense = DenseAttr(np.asarray(value, np.float32), t)
        return (self.f.append_op("mp.constant", [], {"value": dense}, [t],
                                 self.f.fresh_name("c"), self.loc), 0)

    def checked(self, name: str, shape: tuple[int, ...]) -> None:
        """Refuse the checkpoint tensor `name` unless it has `shape` (no check without a
        checkpoint: a shapes-only import takes config.json's word)."""
        if self.ckpt is None:
            return
        info = self.ckpt.info(name)
        if info.shape != shape:
            raise DiagnosticError.at(Location(str(info.file), 0, 0),
                                     f"tensor '{name}' has shape {list(info.shape)}; config.json "
                                     f"implies {list(shape)}")

    def tensor_of(self, name: str, shape: tuple[int, ...], transpose: bool = False,
                  key: str | None = None) -> Value:
        """The checkpoint tensor `name` as f32, checked to have `shape` (before a transpose);
        its npz key is `key`, by default `name`."""
        self.checked(name, shape)
        ckpt, key = self.ckpt, key or name
        if transpose:  # stored [out, in] as torch.nn.Linear keeps it; matmul takes [in, out]
            return self.constant(key, None, shape[::-1],
                                 lambda: np.ascontiguousarray(ckpt.float32(name).T))
        return self.constant(key, None, shape, lambda: ckpt.float32(name))

    # ---- layers --------------------------------------------------------------------------
    def linear(self, x: Value, weight: str, n_in: int, n_out: int, bias: str | None = None,
               conv1d: bool = False, key: str | None = None) -> Value:
        """x @ W (+ b); W is [out, in] (nn.Linear) or, for GPT-2's Conv1D, [in, out]; its
        npz key is `key`, by default `weight`."""
        if conv1d:
            w = self.tensor_of(weight, (n_in, n_out), key=key)
        else:
            w = self.tensor_of(weight, (n_out, n_in), transpose=True, key=key)
        y = self.emit("mp.matmul", [x, w])
        if bias is not None:
            y = self.emit("mp.add", [y, self.tensor_of(bias, (n_out,))])
        return y

    def reshape(self, x: Value, shape: tuple[int, ...]) -> Value:
        return self.emit("mp.reshape", [x], result=shape)

    def transpose(self, x: Value, perm: Sequence[int]) -> Value:
        return self.emit("mp.transpose", [x], {"perm": list(perm)})

    def slice_last(self, x: Value, lo: int, hi: int) -> Value:
        shape = self.shape(x)
        return self.emit("mp.slice", [x], {"starts": [0] * (len(shape) - 1) + [lo],
                                           "ends": list(shape[:-1]) + [hi],
                                           "steps": [1] * len(shape)})

    def attention(self, q: Value, k: Value, v: Value, scale: float,
                  mask: Value | None) -> Value:
        """softmax(q k^T * scale + mask) v for q [B, H, S, D] and k, v [B, Hkv, T, D] (H a
        multiple of Hkv: query head h reads key head h // (H / Hkv), as repeat_kv does);
        the result is [B, S, H * D]."""
        b, h, s, d = self.shape(q)
        _, hkv, t, _ = self.shape(k)
        qg = self.reshape(q, (b, hkv, h // hkv, s, d))
        kt = self.reshape(self.transpose(k, (0, 1, 3, 2)), (b, hkv, 1, d, t))
        scores = self.emit("mp.mul", [self.emit("mp.matmul", [qg, kt]), self.scalar(scale)])
        if mask is not None:
            scores = self.emit("mp.add", [scores, mask])
        p = self.emit("mp.softmax", [scores], {"axis": 4})
        o = self.emit("mp.matmul", [p, self.reshape(v, (b, hkv, 1, t, d))])
        o = self.transpose(self.reshape(o, (b, h, s, d)), (0, 2, 1, 3))
        return self.reshape(o, (b, s, h * d))

    def heads(self, x: Value, n: int, d: int) -> Value:
        """[B, S, n * d] -> [B, n, S, d]."""
        b, s, _ = self.shape(x)
        return self.transpose(self.reshape(x, (b, s, n, d)), (0, 2, 1, 3))

    def causal_mask(self, s: int, start: int) -> Value | None:
        """Additive mask [s, start + s]: query i sees keys up to start + i; None when it sees
        all of them (one new token). The fill is f32's lowest value, as HF's masks use."""
        if s == 1:
            return None
        t = start + s
        allowed = np.arange(t)[None, :] <= start + np.arange(s)[:, None]
        mask = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)
        return self.constant(f"causal_mask.{start}+{s}", mask, (s, t))
