"""Weight-only matmuls as onnxruntime's `com.microsoft.MatMulNBits`.

A weight-only layer in a lowered module is a float activation times a weight that one
`mp.dequantize` makes from constant integer codes (quantize{scheme=w4a16|w8a16}, or an imported
MatMulNBits), with reshapes and transposes between them (the group layout of the quantize pass).
The Q/DQ export writes those ops as they are; onnxruntime then fuses DequantizeLinear + MatMul
into its own MatMulNBits, which quantizes the activation too (accuracy level 4). This module
writes the MatMulNBits node itself, with the codes mplower computed and `accuracy_level = 0`
(the activation stays float, the weight is dequantized exactly as `(code - zero_point) *
scale`), so the runtime computes what the plan says.

The operator (onnxruntime docs/ContribOperators.md, com.microsoft.MatMulNBits, since version 1):
Y = A @ dequantize(B)^T; attributes K, N, bits (2, 4, 8), block_size (a power of two >= 16);
B is uint8 [N, ceil(K / block_size), block_size * bits / 8], codes unsigned and packed
low-bits-first along K; scales [N * blocks] in A's type; zero_points optional, uint8 packed the
same way per row of N ([N * ceil(blocks * bits / 8)]), 2^(bits - 1) when absent.

Each layer's block is found from the values, not from how the pass wrote them: the largest power
of two that divides every position along K where a scale or zero point changes (a per-channel
weight is one block, padded). Signed codes move to the unsigned range by 2^(bits - 1), codes and
zero points alike, so `code - zero_point` is unchanged. A layer MatMulNBits cannot hold (a block
that is no power of two >= 16, an activation that is not f32) stays in Q/DQ form with a note.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import helper

from mplower.ir.graph import Function, Module
from mplower.lowering.weight_only import WeightOnly, constant_closure, weight_only_matmuls

MS_DOMAIN = "com.microsoft"
WEIGHT_ONLY_FORMS = ("matmulnbits", "qdq")  # `mplower export --weight-only`


@dataclass(frozen=True)
class NBitsLayer:
    """One MatMulNBits node: its attributes and its constant inputs."""

    k: int
    n: int
    bits: int
    block: int
    packed: np.ndarray  # uint8 [N, blocks, block * bits / 8]
    scales: np.ndarray  # float32 [N * blocks]
    zero_points: np.ndarray | None  # uint8 packed, None for the default 2^(bits - 1)


@dataclass
class NBitsPlan:
    layers: dict[int, NBitsLayer]  # matmul node -> its MatMulNBits
    absorbed: set[int]  # nodes only those layers read: not exported
    notes: list[str]


def plan_nbits(module: Module, f: Function, weights: str | None) -> NBitsPlan:
    """The weight-only matmuls of `f` that become MatMulNBits, and the ops they replace."""
    layers: dict[int, NBitsLayer] = {}
    notes: list[str] = []
    upstream: set[int] = set()
    for wo in weight_only_matmuls(module, f, weights):
        n = wo.matmul
        layer = _layer(f, wo)
        if isinstance(layer, str):
            notes.append(f"{f.data(n)['name']}: weight-only matmul exported in Q/DQ form: {layer}")
            continue
        layers[n] = layer
        upstream |= constant_closure(f, f.operands(n)[1][0])
    absorbed: set[int] = set()
    for m in sorted(upstream, key=f.ops().index, reverse=True):  # users before producers
        users = {u for r in range(len(f.types(m))) for u, _ in f.uses((m, r))}
        if users <= absorbed | layers.keys():
            absorbed.add(m)
    return NBitsPlan(layers, absorbed, notes)


def _layer(f: Function, wo: WeightOnly) -> NBitsLayer | str:
    """The MatMulNBits of one weight-only matmul, or why it has none."""
    n = wo.matmul
    x_t, w_t = f.operand_types(n)[:2]
    if x_t.elem != "f32" or w_t.elem != "f32" or f.types(wo.chain[0])[0].elem != "f32":
        return (f"its activation is {x_t.elem}; MatMulNBits here computes in f32 only (the "
                f"weight's rounding to {x_t.elem} has no place in it)")
    k, n_out = wo.codes.shape
    bits = wo.bits
    offset = 0 if wo.elem == "ui8" else 1 << (bits - 1)
    codes, zeros = wo.codes + offset, wo.zero_point + offset
    period = wo.period()
    if period == k:  # one block per column, padded to a power of two
        block = max(16, 1 << (k - 1).bit_length())
    else:
        block = period & -period  # its largest power-of-two divisor
        if block < 16:
            return (f"its scales change every {period} rows of K, and MatMulNBits' block_size "
                    f"is a power of two >= 16")
    blocks = -(-k // block)
    starts = np.arange(blocks) * block
    zero_rows = zeros[starts].T  # [N, blocks]
    padded = np.repeat(zero_rows, block, axis=1)  # padding codes dequantize to 0
    padded[:, :k] = codes.T
    packed = _pack(padded.reshape(n_out, blocks, block), bits)
    default = 1 << (bits - 1)
    zero_points = None if np.all(zero_rows == default) else _pack(
        np.pad(zero_rows, ((0, 0), (0, -blocks % (8 // bits)))), bits).reshape(-1)
    scales = np.ascontiguousarray(wo.scale[starts].T, np.float32).reshape(-1)
    return NBitsLayer(k, n_out, bits, block, packed, scales, zero_points)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes (last axis a multiple of 8 / bits) as bytes, the first in the lowest
    bits (MatMulNBits' layout of B and of its zero points)."""
    per = 8 // bits
    grouped = codes.astype(np.uint16).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = np.arange(per, dtype=np.uint16) * bits
    return np.bitwise_or.reduce(grouped << shifts, axis=-1).astype(np.uint8)


def emit_nbits(ex, layer: NBitsLayer, x: str, hint: str) -> str:
    """The MatMulNBits node of `layer` on the FLOAT activation `x` (`ex`: the exporter)."""
    ins = [x, ex.init(layer.packed, f"{hint}_B"), ex.init(layer.scales, f"{hint}_scales")]
    if layer.zero_points is not None:
        ins.append(ex.init(layer.zero_points, f"{hint}_zero_points"))
    out = ex.fresh(hint)
    ex.nodes.append(helper.make_node(
        "MatMulNBits", ins, [out], name=out, domain=MS_DOMAIN, K=layer.k, N=layer.n,
        bits=layer.bits, block_size=layer.block, accuracy_level=0))
    return out

