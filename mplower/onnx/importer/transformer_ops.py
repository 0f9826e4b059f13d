"""ONNX import handlers: the transformer ops of opset 23 (RMSNormalization, RotaryEmbedding,
Attention), and the pieces they share with ONNX Runtime's com.microsoft fusions (`msft`).

None of them is an mp op: each lowers at import to the mp ops the precision passes already
know (matmul, softmax, rms_norm, mul, add, where, ...), so that an attention's two matmuls get a
precision like any other matmul and its softmax stays where the sheet keeps softmax. The
lowerings follow onnx's reference implementation step by step (the order of each rounding
included) so that fp32 results match it; where the spec and the reference disagree the node is
refused with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.types import tensor
from mplower.numerics.formats import FORMATS
from mplower.onnx.importer.core import (
    ELEM_OF_ONNX,
    Const,
    Run,
    _attrs,
    _Importer,
    _reshape_to,
    _same_onnx,
    _scalar,
    _shape_of,
    handler,
    onnx_type_name,
)

# ---- small builders ----------------------------------------------------------------------------


def np_dtype(v: Run) -> np.dtype:
    return helper.tensor_dtype_to_np_dtype(v.onnx_type)


def binary(imp: _Importer, op: str, a: Run, b: Run) -> Run:
    return imp.emit(op, [a, b], onnx_type=a.onnx_type)


def transpose(imp: _Importer, x: Run, perm: Sequence[int]) -> Run:
    return imp.emit("mp.transpose", [x], {"perm": tuple(perm)}, onnx_type=x.onnx_type)


def slice_last(imp: _Importer, x: Run, start: int, end: int, step: int = 1) -> Run:
    """x[..., start:end:step]."""
    shape = x.type.shape
    attrs = {"starts": [0] * (len(shape) - 1) + [start], "ends": [*shape[:-1], end],
             "steps": [1] * (len(shape) - 1) + [step]}
    return imp.emit("mp.slice", [x], attrs, onnx_type=x.onnx_type)


def concat(imp: _Importer, parts: Sequence[Run], axis: int) -> Run:
    return parts[0] if len(parts) == 1 else imp.emit("mp.concat", list(parts), {"axis": axis},
                                                     onnx_type=parts[0].onnx_type)


def split_heads(imp: _Importer, x: Run, heads: int, what: str) -> Run:
    """(B, S, heads * D) -> (B, heads, S, D)."""
    if x.type.rank != 3:
        raise imp.error(f"{what} must be 3-D (batch, sequence, hidden), got "
                        f"{list(x.type.shape)}")
    b, s, hidden = x.type.shape
    if heads <= 0 or hidden % heads:
        raise imp.error(f"{what}: hidden size {hidden} is not a multiple of {heads} heads")
    return transpose(imp, _reshape_to(imp, x, (b, s, heads, hidden // heads)), (0, 2, 1, 3))


def merge_heads(imp: _Importer, y: Run) -> Run:
    """(B, heads, S, D) -> (B, S, heads * D)."""
    b, h, s, d = y.type.shape
    return _reshape_to(imp, transpose(imp, y, (0, 2, 1, 3)), (b, s, h * d))


def param(imp: _Importer, i: int, shape: tuple[int, ...], like: Run, what: str) -> Run:
    """Input `i` (a scale or bias) as exactly `shape`: constants broadcast at import, runtime
    values expanded."""
    v = imp.need_tensor(i)
    if isinstance(v, Const):
        try:
            arr = np.broadcast_to(v.array.astype(np_dtype(like)), shape)
        except ValueError:
            raise imp.error(f"{what} of shape {list(v.array.shape)} does not broadcast to "
                            f"{list(shape)}") from None
        return imp.constant(np.ascontiguousarray(arr), imp.node.input[i])
    _same_onnx(imp, like, v)
    if v.type.shape == shape:
        return v
    return imp.emit("mp.expand", [v], declared=tensor(shape, v.type.elem), onnx_type=v.onnx_type)


# ---- RMSNormalization --------------------------------------------------------------------------


def rms_norm(imp: _Importer, x: Run, scale_input: int, axis: int, eps: float) -> Run:
    r = x.type.rank
    if not -r <= axis < r:
        raise imp.error(f"axis {axis} is out of range for rank {r}")
    axis %= r
    gamma = param(imp, scale_input, x.type.shape[axis:], x, "the scale")
    return imp.emit("mp.rms_norm", [x, gamma], {"axis": axis, "epsilon": eps},
                    onnx_type=x.onnx_type)


@handler("RMSNormalization")
def _rms_normalization(imp: _Importer, node: onnx.NodeProto) -> list:
    a = _attrs(node)
    if int(a.get("stash_type", 1)) != TensorProto.FLOAT:
        raise imp.error(f"stash_type {a['stash_type']}: onnx defines RMSNormalization for a "
                        f"FLOAT stash only")
    x = imp.run_input(0)
    return [rms_norm(imp, x, 1, int(a.get("axis", -1)), float(a.get("epsilon", 1e-5)))]


# ---- rotary embeddings ------------------------------------------------------------------------


def rotate(imp: _Importer, x: Run, cos: Run, sin: Run, rot: int, interleaved: bool) -> Run:
    """Rotary embedding of the first `rot` entries of x's last axis (the rest pass through);
    cos and sin broadcast against x[..., :rot // 2]. As onnx's reference: real = cos x1 -
    sin x2, imag = sin x1 + cos x2, with (x1, x2) the halves or the even/odd entries."""
    d = x.type.shape[-1]
    half = rot // 2
    if rot <= 0 or rot % 2 or rot > d:
        raise imp.error(f"rotary dimension {rot} must be even and at most the head size {d}")
    if cos.type.shape[-1] != half or sin.type.shape[-1] != half:
        raise imp.error(f"the cos/sin caches' last dimension ({cos.type.shape[-1]}) must be "
                        f"half the rotary dimension ({half})")
    xr = x if rot == d else slice_last(imp, x, 0, rot)
    if interleaved:
        x1, x2 = slice_last(imp, xr, 0, rot, 2), slice_last(imp, xr, 1, rot, 2)
    else:
        x1, x2 = slice_last(imp, xr, 0, half), slice_last(imp, xr, half, rot)
    real = binary(imp, "mp.sub", binary(imp, "mp.mul", cos, x1), binary(imp, "mp.mul", sin, x2))
    imag = binary(imp, "mp.add", binary(imp, "mp.mul", sin, x1), binary(imp, "mp.mul", cos, x2))
    if interleaved:
        pair = real.type.shape + (1,)
        both = concat(imp, [_reshape_to(imp, real, pair), _reshape_to(imp, imag, pair)], -1)
        rotated = _reshape_to(imp, both, xr.type.shape)
    else:
        rotated = concat(imp, [real, imag], -1)
    return rotated if rot == d else concat(imp, [rotated, slice_last(imp, x, rot, d)], -1)


def cache_rows(imp: _Importer, cache_input: int, positions: Const | Run | None,
               like: Run) -> Const | Run:
    """The rows of a cos/sin cache at `positions` (B, S) (the cache itself when None)."""
    cache = imp.need_tensor(cache_input)
    if positions is None:
        return cache
    if isinstance(cache, Const) and isinstance(positions, Const):
        rows = positions.array.astype(np.int64)
        n = cache.array.shape[0]
        if rows.size and (rows.min() < -n or rows.max() >= n):
            raise imp.error(f"position ids reach {int(rows.max())}, past the {n} rows of the "
                            f"cos/sin cache")
        return Const(cache.array[rows])
    table = imp.as_run(cache, imp.node.input[cache_input])
    _same_onnx(imp, like, table)
    idx = imp.as_run(positions, "position_ids")
    return imp.emit("mp.gather", [table, idx], {"axis": 0}, onnx_type=table.onnx_type)


def as_broadcast(imp: _Importer, v: Const | Run, shape: tuple[int, ...], like: Run,
                 hint: str) -> Run:
    """A (B, S, half) table reshaped to `shape` (same elements) in like's type."""
    if isinstance(v, Const):
        arr = v.array.astype(np_dtype(like))
        if arr.size != int(np.prod(shape)):
            raise imp.error(f"the cos/sin rows of shape {list(arr.shape)} do not fit "
                            f"{list(shape)}")
        return imp.constant(arr.reshape(shape), hint)
    if v.type.size != int(np.prod(shape)):
        raise imp.error(f"the cos/sin rows of shape {list(v.type.shape)} do not fit "
                        f"{list(shape)}")
    return _reshape_to(imp, v, shape)


@handler("RotaryEmbedding")
def _rotary_embedding(imp: _Importer, node: onnx.NodeProto) -> list:
    a = _attrs(node)
    x = imp.run_input(0)
    positions = imp.need_tensor(3) if imp.input(3) is not None else None
    return [rope(imp, x, cache_rows(imp, 1, positions, x), cache_rows(imp, 2, positions, x),
                 num_heads=int(a.get("num_heads", 0)), rot=int(a.get("rotary_embedding_dim", 0)),
                 interleaved=bool(a.get("interleaved", 0)), bnsh=True)]


def rope(imp: _Importer, x: Run, cos: Const | Run, sin: Const | Run, *, num_heads: int,
         rot: int, interleaved: bool, bnsh: bool) -> Run:
    """x (B, S, hidden) with `num_heads`, or 4-D (B, N, S, D) when `bnsh` else (B, S, N, D),
    rotated by cos/sin rows of shape (B, S, half) (or anything with B*S*half elements in that
    order)."""
    shape = x.type.shape
    if x.type.rank == 3:
        b, s, hidden = shape
        if num_heads <= 0 or hidden % num_heads:
            raise imp.error(f"a 3-D input needs num_heads dividing its hidden size {hidden} "
                            f"(num_heads = {num_heads})")
        x4 = _reshape_to(imp, x, (b, s, num_heads, hidden // num_heads))
        seq_axis = 1
    elif x.type.rank == 4:
        x4, seq_axis = x, (2 if bnsh else 1)
        b, s = shape[0], shape[seq_axis]
    else:
        raise imp.error(f"the input must be 3-D or 4-D, got rank {x.type.rank}")
    d = x4.type.shape[-1]
    rot = rot or d
    table = [b, 1, 1, rot // 2]
    table[seq_axis] = s
    cos_b = as_broadcast(imp, cos, tuple(table), x, "cos")
    sin_b = as_broadcast(imp, sin, tuple(table), x, "sin")
    y = rotate(imp, x4, cos_b, sin_b, rot, interleaved)
    return _reshape_to(imp, y, shape)


# ---- scaled dot-product attention --------------------------------------------------------------

NEG_INF = -np.inf


@dataclass
class Bias:
    """What masks the attention scores, built from its parts. `allowed` (i1, broadcastable to
    the scores) says which keys a query may attend: the others get the lowest finite float
    through an mp.where, the mask fill the precision sheets know (no -inf ever reaches the
    softmax or calibration, and two masks never add up to an overflow). `additive` is added to
    the scores first (a float mask, attention_bias). Each is a numpy array known at import, a
    value computed by mp ops, or None; `allowed_static` and `allowed` combine with and."""

    additive: np.ndarray | Run | None = None
    allowed_static: np.ndarray | None = None
    allowed: Run | None = None

    def allow(self, imp: _Importer, part: np.ndarray | Run) -> None:
        if isinstance(part, Run):
            self.allowed = part if self.allowed is None else imp.emit(
                "mp.logical_and", [self.allowed, part], onnx_type=TensorProto.BOOL)
        else:
            self.allowed_static = part if self.allowed_static is None else \
                _broadcast(imp, np.logical_and, self.allowed_static, part)

    def add(self, imp: _Importer, part: np.ndarray | Run) -> None:
        if self.additive is None:
            self.additive = part
        elif isinstance(part, Run) or isinstance(self.additive, Run):
            a, b = (imp.constant(v, "bias") if isinstance(v, np.ndarray) else v
                    for v in (self.additive, part))
            self.additive = binary(imp, "mp.add", a, b)
        else:
            self.additive = _broadcast(imp, np.add, self.additive, part)


def _broadcast(imp: _Importer, fn: np.ufunc, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    try:
        return fn(a, b)
    except ValueError:
        raise imp.error(f"masks of shapes {list(a.shape)} and {list(b.shape)} do not "
                        f"broadcast together") from None


def add_mask(imp: _Importer, bias: Bias, mask: Const | Run, total: int, like: Run) -> None:
    """ONNX Attention's attn_mask: a boolean one says which keys to attend, a float one is
    added; a last axis shorter than `total` leaves the keys past it unattended."""
    shape = _shape_of(mask)
    pad = total - shape[-1]
    if pad < 0:
        raise imp.error(f"the mask's last dimension {shape[-1]} exceeds the {total} keys")
    tail = np.concatenate([np.ones(shape[-1], np.bool_), np.zeros(pad, np.bool_)])
    is_bool = (mask.array.dtype == np.bool_) if isinstance(mask, Const) else mask.type.elem == "i1"
    if pad:
        bias.allow(imp, tail)
    if isinstance(mask, Const):
        arr = np.pad(mask.array, [(0, 0)] * (len(shape) - 1) + [(0, pad)])
        if is_bool:
            bias.allow(imp, arr)
        else:
            bias.add(imp, arr.astype(np_dtype(like)))
        return
    if pad:
        zeros = imp.constant(np.zeros(shape[:-1] + (pad,), np.bool_ if is_bool else np_dtype(
            like)), "mask_pad")
        mask = concat(imp, [mask, zeros], -1)
    if is_bool:
        bias.allow(imp, mask)
    else:
        _same_onnx(imp, like, mask)
        bias.add(imp, mask)


def causal_allowed(sq: int, skv: int, offset: int, left: int = -1, right: int = -1,
                   causal: bool = True) -> np.ndarray:
    """Where query i may attend key j: j <= i + offset (causal), and within `left` keys before
    and `right` after position i + offset when they are >= 0 (a window)."""
    diff = (np.arange(sq)[:, None] + offset) - np.arange(skv)[None, :]
    allowed = diff >= 0 if causal else np.ones_like(diff, np.bool_)
    if left >= 0:
        allowed &= diff <= left
    if right >= 0:
        allowed &= -diff <= right
    return allowed


def grouped(imp: _Importer, x: Run, kv_heads: int) -> Run:
    """(B, H, S, D) as (B, kv_heads, H / kv_heads * S, D): the query heads that share a key
    head side by side, so one batched matmul serves them all (no copy of K or V)."""
    b, h, s, d = x.type.shape
    return _reshape_to(imp, x, (b, kv_heads, (h // kv_heads) * s, d))


def sdpa(imp: _Importer, q: Run, k: Run, v: Run, bias: Bias, *, scale: float | None,
         split_scale: bool, softcap: float = 0.0, softmax_type: int | None = None,
         qk_mode: int | None = None, sink: Run | None = None) -> tuple[Run, Run | None]:
    """softmax(q k^T * scale (softcapped) + bias) v for q (B, H, Sq, D), k (B, Hkv, Skv, D),
    v (B, Hkv, Skv, Dv) with H a multiple of Hkv (query head h reads key head h // (H / Hkv)).
    `split_scale` multiplies q and k by sqrt(scale) before the product (ONNX Attention), else
    the product by scale. A query row with no key to attend gives zeros (ONNX's fully-masked-row
    rule), never NaN. `sink` (H values, broadcast to (B, H, Sq, 1)) joins each row's softmax as
    one more logit whose probability is dropped (attention sinks, smooth softmax). Returns
    (Y (B, H, Sq, Dv), the requested qk output)."""
    if not q.type.rank == k.type.rank == v.type.rank == 4:
        raise imp.error(f"query, key and value must be 4-D (batch, heads, sequence, head size) "
                        f"here, got {list(q.type.shape)}, {list(k.type.shape)}, "
                        f"{list(v.type.shape)}")
    b, h, sq, d = q.type.shape
    hkv, skv = k.type.shape[1], k.type.shape[2]
    if h % hkv or v.type.shape[1] != hkv or k.type.shape[0] != b or v.type.shape[2] != skv:
        raise imp.error(f"query heads {h} must be a multiple of key/value heads {hkv} (keys "
                        f"{list(k.type.shape)}, values {list(v.type.shape)})")
    dtype = np_dtype(q)
    if scale is None:
        scale = 1 / np.sqrt(d)
    if split_scale:  # as onnx's reference: sqrt(scale) in f64, then in q's type
        c = _scalar(imp, float(dtype.type(np.sqrt(scale))), q)
        q, k = binary(imp, "mp.mul", q, c), binary(imp, "mp.mul", k, c)
    kt = transpose(imp, k, (0, 1, 3, 2))
    raw = _reshape_to(imp, binary(imp, "mp.matmul", grouped(imp, q, hkv), kt), (b, h, sq, skv))
    if not split_scale:
        raw = binary(imp, "mp.mul", raw, _scalar(imp, float(dtype.type(scale)), q))
    scores = raw
    if softcap > 0:
        cap = _scalar(imp, softcap, q)
        scores = binary(imp, "mp.mul", imp.emit("mp.tanh", [binary(imp, "mp.div", scores, cap)],
                                                 onnx_type=q.onnx_type), cap)
    capped = scores
    add = bias.additive
    if isinstance(add, np.ndarray):
        add = None if not np.any(add) else imp.constant(add.astype(dtype), "bias")
    if add is not None:
        scores = binary(imp, "mp.add", scores, add)
    allowed = bias.allowed
    if bias.allowed_static is not None and not bias.allowed_static.all():
        static = imp.constant(bias.allowed_static, "allowed")
        allowed = static if allowed is None else imp.emit(
            "mp.logical_and", [allowed, static], onnx_type=TensorProto.BOOL)
    with_bias = scores
    if allowed is not None:
        if qk_mode == 2:  # ONNX's mode-2 output holds the bias as -inf where keys are masked
            with_bias = imp.emit("mp.where", [allowed, scores, _scalar(imp, NEG_INF, q)],
                                 onnx_type=q.onnx_type)
        lowest = _scalar(imp, -float(FORMATS[q.type.elem].max_finite), q)
        scores = imp.emit("mp.where", [allowed, scores, lowest], onnx_type=q.onnx_type)
    guard = _masked_rows(imp, bias, allowed, add, q)
    work = scores
    if softmax_type is not None and softmax_type != q.onnx_type:
        elem = ELEM_OF_ONNX.get(softmax_type)
        if elem is None or not FORMATS[elem].is_float:
            raise imp.error(f"softmax_precision {onnx_type_name(softmax_type)} is not a float "
                            f"type of the IR")
        work = imp.emit("mp.cast", [work], declared=work.type.with_elem(elem),
                        onnx_type=softmax_type)
    if sink is not None:
        work = concat(imp, [work, sink], -1)
    probs = imp.emit("mp.softmax", [work], {"axis": -1}, onnx_type=work.onnx_type)
    if sink is not None:
        probs = slice_last(imp, probs, 0, skv)
    if guard is not None:
        probs = imp.emit("mp.where", [guard, _scalar(imp, 0.0, probs), probs],
                         onnx_type=probs.onnx_type)
    if probs.onnx_type != q.onnx_type:
        probs = imp.emit("mp.cast", [probs], declared=probs.type.with_elem(q.type.elem),
                         onnx_type=q.onnx_type)
    y = binary(imp, "mp.matmul", grouped(imp, probs, hkv), v)
    y = _reshape_to(imp, y, (b, h, sq, v.type.shape[3]))
    qk = {None: None, 0: raw, 1: capped, 2: with_bias, 3: probs}[qk_mode]
    return y, qk


def _masked_rows(imp: _Importer, bias: Bias, allowed: Run | None, add: Run | None,
                 q: Run) -> Run | None:
    """The query rows that attend no key (ONNX: their output is zeros): no key that is allowed
    and whose additive mask is not -inf. A constant when the masks are known at import (None
    if no row is masked), else computed without producing an infinity."""
    if bias.allowed is None and not isinstance(bias.additive, Run):
        ok = np.ones((1, 1), np.bool_) if bias.allowed_static is None else bias.allowed_static
        if isinstance(bias.additive, np.ndarray):
            ok = ok & ~np.isneginf(bias.additive)
        dead = ~ok.any(axis=-1, keepdims=True)
        return imp.constant(dead, "masked_rows") if dead.any() else None
    ok = allowed
    finite: Run | None = None
    if isinstance(bias.additive, Run):
        finite = imp.emit("mp.logical_not", [imp.emit(
            "mp.isinf", [add], {"detect_positive": False}, onnx_type=TensorProto.BOOL)],
            onnx_type=TensorProto.BOOL)
    elif isinstance(bias.additive, np.ndarray) and np.isneginf(bias.additive).any():
        finite = imp.constant(~np.isneginf(bias.additive), "finite_bias")
    if finite is not None:
        ok = finite if ok is None else imp.emit("mp.logical_and", [ok, finite],
                                                onnx_type=TensorProto.BOOL)
    hit = imp.emit("mp.cast", [ok], declared=ok.type.with_elem(q.type.elem),
                   onnx_type=q.onnx_type)
    some = imp.emit("mp.reduce_max", [hit], {"axes": (-1,), "keepdims": True},
                    onnx_type=q.onnx_type)
    return imp.emit("mp.equal", [some, _scalar(imp, 0.0, q)], onnx_type=TensorProto.BOOL)


def with_past(imp: _Importer, past: Const | Run | None, new: Run, what: str) -> Run:
    """The key (value) cache after this step: past and new concatenated on the sequence
    axis (2) of (B, heads, S, D)."""
    if past is None:
        return new
    p = imp.as_run(past, what)
    _same_onnx(imp, new, p)
    ps, ns = p.type.shape, new.type.shape
    if p.type.rank != 4 or (ps[0], ps[1], ps[3]) != (ns[0], ns[1], ns[3]):
        raise imp.error(f"{what} {list(ps)} does not match the new entries {list(ns)} "
                        f"(batch, heads, -, head size)")
    return concat(imp, [p, new], 2)


# ---- Attention (opset 23 and later) ------------------------------------------------------------


@handler("Attention")
def _attention(imp: _Importer, node: onnx.NodeProto) -> list:
    a = _attrs(node)
    q, k, v = (imp.run_input(i) for i in range(3))
    for t in (k, v):
        _same_onnx(imp, q, t)
    if not FORMATS[q.type.elem].is_float:
        raise imp.error(f"Q, K and V must be float tensors, got {onnx_type_name(q.onnx_type)}")
    rank = q.type.rank
    if rank != k.type.rank or rank != v.type.rank or rank not in (3, 4):
        raise imp.error("Q, K and V must all be 3-D or all 4-D")
    if rank == 3:
        q = split_heads(imp, q, int(a.get("q_num_heads", 0)), "Q")
        k = split_heads(imp, k, int(a.get("kv_num_heads", 0)), "K")
        v = split_heads(imp, v, int(a.get("kv_num_heads", 0)), "V")
    past_k, past_v = imp.input(4), imp.input(5)
    if (past_k is None) != (past_v is None):
        raise imp.error("past_key and past_value go together")
    past = 0 if past_k is None else _shape_of(past_k)[2]
    k = with_past(imp, past_k, k, "past_key")
    v = with_past(imp, past_v, v, "past_value")
    sq, skv = q.type.shape[2], k.type.shape[2]
    bias = Bias()
    if imp.input(3) is not None:
        add_mask(imp, bias, imp.need_tensor(3), skv, q)
    nonpad = imp.input(6)
    if nonpad is not None and past_k is not None:
        raise imp.error("nonpad_kv_seqlen cannot be combined with past_key/past_value")
    causal = bool(a.get("is_causal", 0))
    left, right = int(a.get("left_window_size", -1)), int(a.get("right_window_size", -1))
    if nonpad is None:
        if causal or left >= 0 or right >= 0:
            bias.allow(imp, causal_allowed(sq, skv, past, left, right, causal))
    else:
        _nonpad_bias(imp, bias, imp.need_tensor(6), q, skv, causal, left, right)
    mode = int(a.get("qk_matmul_output_mode", 0))
    wants_qk = len(node.output) > 3 and bool(imp.consumers.get(node.output[3]))
    softcap = float(a.get("softcap", 0.0))
    if wants_qk and mode == 0 and softcap > 0:
        raise imp.error("qk_matmul_output_mode 0 with a softcap: the spec says the raw product, "
                        "onnx's reference returns it softcapped; mplower takes neither side")
    if mode not in (0, 1, 2, 3):
        raise imp.error(f"qk_matmul_output_mode {mode} is not 0, 1, 2 or 3")
    scale = a.get("scale")
    y, qk = sdpa(imp, q, k, v, bias, scale=None if scale is None else float(scale),
                 split_scale=True, softcap=softcap,
                 softmax_type=a.get("softmax_precision"), qk_mode=mode if wants_qk else None)
    if rank == 3:
        y = merge_heads(imp, y)
    return [y, k, v, qk]


def _nonpad_bias(imp: _Importer, bias: Bias, nonpad: Const | Run, q: Run, skv: int,
                 causal: bool, left: int, right: int) -> None:
    """The keys of an external cache with `nonpad` valid ones per batch entry: keys past the
    count are padding; the causal frontier (and window) sits at offset nonpad - Sq."""
    b, _, sq, _ = q.type.shape
    if isinstance(nonpad, Const):
        n = nonpad.array.astype(np.int64).reshape(-1)
        if n.size != b:
            raise imp.error(f"nonpad_kv_seqlen has {n.size} entries for a batch of {b}")
        bias.allow(imp, (np.arange(skv)[None, :] < n[:, None]).reshape(b, 1, 1, skv))
        if causal or left >= 0 or right >= 0:
            bias.allow(imp, np.stack([causal_allowed(sq, skv, int(m) - sq, left, right, causal)
                                      for m in n])[:, None])
        return
    counts = _reshape_to(imp, nonpad, (b, 1, 1, 1))
    # Query i sits at position i + n[b] - Sq. With d = j - i + Sq, key j is kept iff
    # n[b] >= j + 1 (not padding), n[b] >= d (causal), n[b] >= d - right and n[b] <= d + left
    # (the window): bounds known at import against the runtime count.
    j = np.arange(skv)[None, :]
    d = j - np.arange(sq)[:, None] + sq
    lower = np.broadcast_to(j + 1, (sq, skv))
    if causal:
        lower = np.maximum(lower, d)
    if right >= 0:
        lower = np.maximum(lower, d - right)
    keep = imp.emit("mp.less_equal", [imp.constant(lower.astype(np.int64), "key_lower"),
                                      counts], onnx_type=TensorProto.BOOL)
    if left >= 0:
        upper = imp.emit("mp.less_equal", [counts, imp.constant((d + left).astype(np.int64),
                                                                "key_upper")],
                         onnx_type=TensorProto.BOOL)
        keep = imp.emit("mp.logical_and", [keep, upper], onnx_type=TensorProto.BOOL)
    bias.allow(imp, keep)
