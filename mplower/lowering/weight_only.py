"""Weight-only quantized matmuls of a lowered module, read back as codes, scales and zero points.

A weight-only layer is a float activation times a weight that one `mp.dequantize` makes from
constant integer codes, with reshapes and transposes between them: quantize{scheme=w4a16|w8a16}
writes its group layout that way, and an imported MatMulNBits is a blocked dequantize of
constant codes. Exporters (ONNX MatMulNBits, compressed-tensors checkpoints) need the same
three (K, N) arrays the executor multiplies with: `weight[k, n] = (codes[k, n] -
zero_point[k, n]) * scale[k, n]`, computed in f32. They are taken from the values (the
dequantize's own parameters, moved by the same reshapes and transposes as the codes), so any
layout a pass chooses reads back the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mplower.dialect.mp.quantization import _along as along_axis
from mplower.ir.graph import Function, Module, Value
from mplower.ir.opdef import OPS, check_attrs
from mplower.lowering.calibration import ConstantValues

CODE_BITS = {"i4": 4, "i8": 8, "ui8": 8}  # integer code types of weight-only layers
_MOVES = ("mp.reshape", "mp.transpose", "mp.cast")  # what may lie between dequantize and matmul


@dataclass(frozen=True)
class WeightOnly:
    """One weight-only matmul: its (K, N) weight as integer codes on a grid."""

    matmul: int  # the mp.matmul node
    chain: tuple[int, ...]  # dequantize, then the moves (and casts) to the matmul's operand 1
    elem: str  # code type (CODE_BITS)
    codes: np.ndarray  # int64 [K, N]
    scale: np.ndarray  # float32 [K, N]
    zero_point: np.ndarray  # int64 [K, N]
    source: str | None  # the name of the one named float constant the codes come from

    @property
    def bits(self) -> int:
        return CODE_BITS[self.elem]

    def period(self) -> int:
        """The largest run of rows of K that share every scale and zero point, aligned at row
        0 (a divisor of K; K itself for one scale per column)."""
        k = self.codes.shape[0]
        s, z = self.scale, self.zero_point
        changes = np.flatnonzero(np.any((s[1:] != s[:-1]) | (z[1:] != z[:-1]), axis=1)) + 1
        return math.gcd(k, *map(int, changes))

    def dequantized(self) -> np.ndarray:
        """The f32 weight the executor multiplies with."""
        return (self.codes.astype(np.float32) - self.zero_point.astype(np.float32)) * self.scale


def weight_only_matmuls(module: Module, f: Function, weights: str | None = None
                        ) -> list[WeightOnly]:
    """Every weight-only matmul of `f` (x @ W with W a dequantized constant)."""
    consts = ConstantValues(module, f, weights)
    out = []
    for n in f.walk("mp.matmul"):
        chain = _weight_chain(f, n, consts)
        if chain is not None:
            out.append(_read(f, n, chain, consts))
    return out


def _weight_chain(f: Function, n: int, consts: ConstantValues) -> list[int] | None:
    """[dequantize, moves...] from the codes to operand 1 of matmul `n`, when that operand is a
    dequantized constant (through reshapes and transposes) and operand 0 is neither a constant
    nor itself dequantized (that is w8a8 in Q/DQ form, not weight-only)."""
    x, w = f.operands(n)[:2]
    if x in consts or f.op(x[0]) == "mp.dequantize" or f.type_of(w).rank != 2:
        return None
    chain: list[int] = []
    v: Value = w
    while f.op(v[0]) in _MOVES:
        chain.append(v[0])
        v = f.operands(v[0])[0]
    if f.op(v[0]) != "mp.dequantize":
        return None
    codes = f.operands(v[0])[0]
    if codes not in consts or f.type_of(codes).elem not in CODE_BITS:
        return None
    return [v[0], *reversed(chain)]


def _read(f: Function, n: int, chain: list[int], consts: ConstantValues) -> WeightOnly:
    dq = chain[0]
    codes_v = f.operands(dq)[0]
    a = check_attrs(OPS["mp.dequantize"], f.attrs_of(dq))
    q = np.asarray(consts.get(codes_v)).astype(np.int64)
    scale = np.broadcast_to(along_axis(np.asarray(a["scale"], np.float32), q.shape, a), q.shape)
    zp = np.broadcast_to(along_axis(np.asarray(a["zero_point"]), q.shape, a), q.shape)
    for m in chain[1:]:  # the same reshapes and transposes the weight takes
        if f.op(m) == "mp.cast":  # rounds the f32 weight for the matmul: the grid stays
            continue
        b = check_attrs(OPS[f.op(m)], f.attrs_of(m))
        q, scale, zp = (np.asarray(OPS[f.op(m)].reference([arr], b, f.types(m))[0])
                        for arr in (q, scale, zp))
    names = {f.attrs_of(m)["name"] for m in constant_closure(f, codes_v[0])
             if f.op(m) == "mp.constant" and "name" in f.attrs_of(m)}
    return WeightOnly(n, tuple(chain), f.type_of(codes_v).elem, q.astype(np.int64),
                      np.ascontiguousarray(scale, np.float32), zp.astype(np.int64),
                      names.pop() if len(names) == 1 else None)


def constant_closure(f: Function, node: int) -> set[int]:
    """`node` and every op it is computed from."""
    seen, todo = set(), [node]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(u for u, _ in f.operands(m))
    return seen
