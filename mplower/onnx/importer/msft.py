"""ONNX import handlers: the com.microsoft operators that onnxruntime's transformer optimizer and
its quantization tools write into shared models.

Each lowers to mp ops at import (matmul, layer_norm, rms_norm, gelu, softmax, dequantize, ...),
so that the precision passes give every part of a fusion a precision of its own: a
SkipLayerNormalization is an add and a layer_norm, an Attention three projections, two batched
matmuls and a softmax. Semantics follow onnxruntime's contrib op schemas (contrib_defs.cc,
bert_defs.cc, quantization_defs.cc, as its `get_all_operator_schema()` documents them); the
tests compare against onnxruntime's CPU kernels. What depends on values known only at run time
in a way a static graph cannot express (KV-cache lengths per batch entry, shared past/present
buffers, beam search indirection) is refused with the reason.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.types import DenseAttr, tensor
from mplower.numerics.formats import FORMATS
from mplower.onnx.importer.core import (
    CONTRIB_DEFAULT_DOMAIN,
    Const,
    Run,
    _attrs,
    _Importer,
    _reshape_to,
    _same_onnx,
    _scalar,
    _shape_of,
    handler,
)
from mplower.onnx.importer.transformer_ops import (
    Bias,
    as_broadcast,
    binary,
    cache_rows,
    causal_allowed,
    concat,
    merge_heads,
    np_dtype,
    param,
    rms_norm,
    rope,
    rotate,
    sdpa,
    slice_last,
    split_heads,
    transpose,
    with_past,
)

MS = "com.microsoft::"
# onnxruntime registers SimplifiedLayerNormalization in the default domain, where onnx's checker
# knows no such op; the importer moves such nodes to com.microsoft before it checks the model.
CONTRIB_DEFAULT_DOMAIN["SimplifiedLayerNormalization"] = "com.microsoft"


def _required(imp: _Importer, a: dict, name: str) -> int:
    """An integer attribute the contrib schema requires (onnx's checker does not know it)."""
    if name not in a:
        raise imp.error(f"attribute '{name}' is required")
    return int(a[name])


def _unused_outputs(imp: _Importer, node: onnx.NodeProto, which: range, why: str) -> None:
    for k in which:
        name = node.output[k] if k < len(node.output) else ""
        if name and imp.consumers.get(name):
            raise imp.error(f"output #{k} ('{name}') is not supported: {why}")


# ---- matrix products -----------------------------------------------------------------------------


def _permuted(imp: _Importer, i: int, perm: tuple[int, ...]) -> Run:
    v = imp.need_tensor(i)
    if perm == tuple(range(len(perm))):
        return imp.as_run(v, imp.node.input[i])
    if isinstance(v, Const):
        return imp.constant(np.ascontiguousarray(np.transpose(v.array, perm)),
                            f"{imp.node.input[i]}_t")
    return transpose(imp, v, perm)


def _fused_perm(rank: int, trans: bool, trans_batch: bool) -> tuple[int, ...]:
    """FusedMatMul's view of an operand: transBatch moves the first axis behind the batch axes
    (it becomes the row axis), trans then swaps the last two."""
    perm = list(range(rank))
    if trans_batch and rank > 2:
        perm = [*range(1, rank - 1), 0, rank - 1]
    if trans and rank >= 2:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return tuple(perm)


@handler(MS + "FusedMatMul")
def _fused_matmul(imp: _Importer, node: onnx.NodeProto) -> list:
    a = _attrs(node)
    ra, rb = len(_shape_of(imp.need(0))), len(_shape_of(imp.need(1)))
    if ra < 2 or rb < 2:
        raise imp.error("FusedMatMul of a 1-D operand is not supported")
    x = _permuted(imp, 0, _fused_perm(ra, bool(a.get("transA", 0)), bool(a.get("transBatchA", 0))))
    w = _permuted(imp, 1, _fused_perm(rb, bool(a.get("transB", 0)), bool(a.get("transBatchB", 0))))
    _same_onnx(imp, x, w)
    y = binary(imp, "mp.matmul", x, w)
    alpha = float(a.get("alpha", 1.0))
    return [y if alpha == 1.0 else binary(imp, "mp.mul", y, _scalar(imp, alpha, y))]


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes holding 8 / bits values each, the first in the lowest bits, as uint8."""
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    vals = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * per)


@handler(MS + "MatMulNBits")
def _matmul_nbits(imp: _Importer, node: onnx.NodeProto) -> list:
    """A (..., K) times the (K, N) weight stored as `bits`-bit codes in blocks of `block_size`
    along K: the codes stay a quantized constant (i4 for 2 and 4 bits, offset by 2^(bits-1);
    ui8 for 8) that one blocked mp.dequantize turns into the f32 weight, exactly
    (q - zero_point) * scale."""
    at = _attrs(node)
    bits, block = int(at.get("bits", 4)), _required(imp, at, "block_size")
    k, n = _required(imp, at, "K"), _required(imp, at, "N")
    if bits not in (2, 4, 8):
        raise imp.error(f"bits = {bits}: mplower imports 2-, 4- and 8-bit MatMulNBits (as "
                        f"onnxruntime does)")
    if imp.input(4) is not None:
        raise imp.error("g_idx (act-order group indices) is not supported")
    if int(at.get("weight_prepacked", 0)):
        raise imp.error("weights prepacked for a GPU kernel layout are not supported")
    x = imp.run_input(0)
    if x.type.shape[-1] != k:
        raise imp.error(f"A's last dimension {x.type.shape[-1]} is not K = {k}")
    packed = imp.const(1, "the packed weights B")
    scales = imp.const(2, "the scales")
    blocks = -(-k // block) if block > 0 else 0
    if packed is None or scales is None or block < 16 or block & (block - 1):
        raise imp.error("B, scales and a power-of-two block_size >= 16 are required")
    if packed.shape != (n, blocks, block * bits // 8):
        raise imp.error(f"B has shape {list(packed.shape)}, expected "
                        f"{[n, blocks, block * bits // 8]} for N={n}, K={k}, "
                        f"block_size={block}, bits={bits}")
    codes = _unpack(packed.astype(np.uint8), bits).reshape(n, blocks * block)[:, :k]
    zp_in = imp.const(3, "the zero points")
    zp_size = n * (-(-blocks * bits // 8) if zp_in is not None and zp_in.dtype == np.uint8
                   else blocks)
    if scales.size != n * blocks or (zp_in is not None and zp_in.size != zp_size):
        raise imp.error(f"scales ({scales.size} values) and zero points "
                        f"({'none' if zp_in is None else zp_in.size}) must hold one entry per "
                        f"block ({n} x {blocks}; packed zero points {zp_size})")
    scale = scales.astype(np.float32).reshape(n, blocks)
    if zp_in is None:
        zp = np.full((n, blocks), 1 << (bits - 1), np.int64)
    elif zp_in.dtype == np.uint8:
        zp = _unpack(zp_in.reshape(n, -1), bits)[:, :blocks].astype(np.int64)
    else:  # unpacked, in A's float type: exact only when they hold the codes' integers
        zp = zp_in.astype(np.float64).reshape(n, blocks)
        if np.any(zp != np.round(zp)) or zp.min() < 0 or zp.max() >= 1 << bits:
            raise imp.error("float zero points that are not integer codes are not supported")
        zp = zp.astype(np.int64)
    if bits < 8:  # codes 0..2^bits-1 held as i4 around 0: (q - o) - (zp - o) = q - zp exactly
        import ml_dtypes

        offset = 1 << (bits - 1)
        weight = (codes.T.astype(np.int16) - offset).astype(ml_dtypes.int4)
        zp, elem = zp - offset, "i4"
    else:
        weight, elem = codes.T.copy(), "ui8"
    q = imp.constant(weight, f"{node.input[1]}_codes")
    attrs = {"scale": DenseAttr(np.ascontiguousarray(scale.T), tensor((blocks, n), "f32")),
             "zero_point": DenseAttr(np.ascontiguousarray(zp.T), tensor((blocks, n), elem)),
             "axis": 0, "block_size": block}
    w = imp.emit("mp.dequantize", [q], attrs, declared=q.type.with_elem(x.type.elem),
                 hint=f"{node.input[1]}_dq", onnx_type=x.onnx_type)
    y = binary(imp, "mp.matmul", x, w)
    if imp.input(5) is not None:
        y = binary(imp, "mp.add", y, param(imp, 5, (n,), y, "the bias"))
    return [y]


# ---- normalizations ------------------------------------------------------------------------------


def _skip_sum(imp: _Importer, bias_input: int) -> Run:
    """input + skip (+ bias), in that order, as onnxruntime's kernels add them."""
    x, skip = imp.run_input(0), imp.run_input(1)
    _same_onnx(imp, x, skip)
    total = binary(imp, "mp.add", x, skip)
    if imp.input(bias_input) is not None:
        total = binary(imp, "mp.add", total,
                       param(imp, bias_input, (x.type.shape[-1],), x, "the bias"))
    return total


@handler(MS + "SkipLayerNormalization")
def _skip_layer_norm(imp: _Importer, node: onnx.NodeProto) -> list:
    _unused_outputs(imp, node, range(1, 3), "the saved mean and variance exist for training")
    total = _skip_sum(imp, 4)
    hidden = total.type.shape[-1]
    gamma = param(imp, 2, (hidden,), total, "gamma")
    beta = param(imp, 3, (hidden,), total, "beta") if imp.input(3) is not None else \
        imp.constant(np.zeros(hidden, np_dtype(total)), "zeros")
    eps = float(_attrs(node).get("epsilon", 1e-12))
    y = imp.emit("mp.layer_norm", [total, gamma, beta], {"axis": -1, "epsilon": eps},
                 onnx_type=total.onnx_type)
    return [y, None, None, total]


@handler(MS + "SkipSimplifiedLayerNormalization")
def _skip_rms_norm(imp: _Importer, node: onnx.NodeProto) -> list:
    _unused_outputs(imp, node, range(1, 3), "the saved mean and variance exist for training")
    total = _skip_sum(imp, 3)
    hidden = total.type.shape[-1]
    gamma = param(imp, 2, (hidden,), total, "gamma")
    eps = float(_attrs(node).get("epsilon", 1e-12))
    y = imp.emit("mp.rms_norm", [total, gamma], {"axis": -1, "epsilon": eps},
                 onnx_type=total.onnx_type)
    return [y, None, None, total]


@handler(MS + "SimplifiedLayerNormalization")
def _simplified_layer_norm(imp: _Importer, node: onnx.NodeProto) -> list:
    _unused_outputs(imp, node, range(1, 2), "the saved inverse deviation exists for training")
    a = _attrs(node)
    x = imp.run_input(0)
    return [rms_norm(imp, x, 1, int(a.get("axis", -1)), float(a.get("epsilon", 1e-5)))]


@handler(MS + "EmbedLayerNormalization")
def _embed_layer_norm(imp: _Importer, node: onnx.NodeProto) -> list:
    """word + position (+ segment) embeddings, then layer_norm; mask_index is the count of
    non-zero mask entries per sequence."""
    ids = imp.run_input(0)
    if ids.type.rank != 2:
        raise imp.error(f"input_ids must be 2-D (batch, sequence), got {list(ids.type.shape)}")
    words = imp.as_run(imp.need_tensor(2), node.input[2])
    total = imp.emit("mp.gather", [words, ids], {"axis": 0}, onnx_type=words.onnx_type)
    b, s = ids.type.shape
    table = imp.as_run(imp.need_tensor(3), node.input[3])
    if imp.input(8) is not None:
        pos = imp.run_input(8)
    else:
        pos = imp.constant(np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy(),
                           "position_ids")
    total = binary(imp, "mp.add", total,
                   imp.emit("mp.gather", [table, pos], {"axis": 0}, onnx_type=table.onnx_type))
    if imp.input(1) is not None and imp.input(4) is not None:
        seg = imp.as_run(imp.need_tensor(4), node.input[4])
        total = binary(imp, "mp.add", total, imp.emit("mp.gather", [seg, imp.run_input(1)],
                                                      {"axis": 0}, onnx_type=seg.onnx_type))
    hidden = total.type.shape[-1]
    gamma, beta = param(imp, 5, (hidden,), total, "gamma"), param(imp, 6, (hidden,), total, "beta")
    eps = float(_attrs(node).get("epsilon", 1e-12))
    y = imp.emit("mp.layer_norm", [total, gamma, beta], {"axis": -1, "epsilon": eps},
                 onnx_type=total.onnx_type)
    mask_index = None
    if len(node.output) > 1 and node.output[1] and imp.consumers.get(node.output[1]):
        if imp.input(7) is None:
            raise imp.error("mask_index needs the mask input")
        mask = imp.run_input(7)
        ones = imp.emit("mp.equal", [mask, _scalar(imp, 1, mask)], onnx_type=TensorProto.BOOL)
        ones = imp.emit("mp.cast", [ones], declared=ones.type.with_elem("i32"),
                        onnx_type=TensorProto.INT32)
        mask_index = imp.emit("mp.reduce_sum", [ones], {"axes": (1,), "keepdims": False},
                              onnx_type=TensorProto.INT32)
    return [y, mask_index, total]


# ---- activations ---------------------------------------------------------------------------------


def _plus_bias(imp: _Importer, x: Run, i: int) -> Run:
    if imp.input(i) is None:
        return x
    return binary(imp, "mp.add", x, param(imp, i, (x.type.shape[-1],), x, "the bias"))


@handler(MS + "Gelu", MS + "BiasGelu", MS + "FastGelu")
def _gelu(imp: _Importer, node: onnx.NodeProto) -> list:
    x = _plus_bias(imp, imp.run_input(0), 1)
    approx = "tanh" if node.op_type == "FastGelu" else "none"
    return [imp.emit("mp.gelu", [x], {"approximate": approx}, onnx_type=x.onnx_type)]


@handler(MS + "QuickGelu")
def _quick_gelu(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    alpha = float(_attrs(node).get("alpha", 1.702))
    gate = imp.emit("mp.sigmoid", [binary(imp, "mp.mul", x, _scalar(imp, alpha, x))],
                    onnx_type=x.onnx_type)
    return [binary(imp, "mp.mul", x, gate)]


@handler(MS + "BiasAdd")
def _bias_add(imp: _Importer, node: onnx.NodeProto) -> list:
    x = _plus_bias(imp, imp.run_input(0), 1)
    skip = imp.run_input(2)
    _same_onnx(imp, x, skip)
    return [binary(imp, "mp.add", x, skip)]


@handler(MS + "BiasSplitGelu")
def _bias_split_gelu(imp: _Importer, node: onnx.NodeProto) -> list:
    x = _plus_bias(imp, imp.run_input(0), 1)
    d = x.type.shape[-1]
    if d % 2:
        raise imp.error(f"the last dimension {d} does not split in halves")
    left, right = slice_last(imp, x, 0, d // 2), slice_last(imp, x, d // 2, d)
    return [binary(imp, "mp.mul", left, imp.emit("mp.gelu", [right], {"approximate": "none"},
                                                  onnx_type=x.onnx_type))]


# ---- rotary embeddings ---------------------------------------------------------------------------


def _positions(imp: _Importer, i: int, b: int, s: int, past: int = 0) -> Const | Run:
    """Position ids (B, S): given as such, or as one offset (shape (1,)) to which the token
    index is added; absent: past + the token index."""
    if imp.input(i) is None:
        return Const(np.broadcast_to(np.arange(past, past + s, dtype=np.int64), (b, s)).copy())
    v = imp.need_tensor(i)
    if _shape_of(v) == (b, s):
        return v
    if int(np.prod(_shape_of(v))) != 1:
        raise imp.error(f"position_ids of shape {list(_shape_of(v))}: expected (1) or {[b, s]}")
    steps = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s))
    if isinstance(v, Const):
        return Const(v.array.astype(np.int64).reshape(()) + steps)
    offset = _reshape_to(imp, v, (1, 1))
    return binary(imp, "mp.add", offset, imp.constant(steps.astype(np.int64), "token_index"))


@handler(MS + "RotaryEmbedding")
def _rotary_embedding(imp: _Importer, node: onnx.NodeProto) -> list:
    a = _attrs(node)
    if int(a.get("is_packed_batching", 0)):
        raise imp.error("packed (ragged) batching is not supported")
    if float(a.get("scale", 1.0)) != 1.0:
        raise imp.error("a scale other than 1.0 is not supported")
    x = imp.run_input(0)
    b = x.type.shape[0]
    s = x.type.shape[2] if x.type.rank == 4 else x.type.shape[1]
    pos = _positions(imp, 1, b, s)
    return [rope(imp, x, cache_rows(imp, 2, pos, x), cache_rows(imp, 3, pos, x),
                 num_heads=int(a.get("num_heads", 0)), rot=int(a.get("rotary_embedding_dim", 0)),
                 interleaved=bool(a.get("interleaved", 0)), bnsh=True)]


# ---- attention -----------------------------------------------------------------------------------


def _key_mask(imp: _Importer, mask: Const | Run, b: int, sq: int, total: int, fill: float,
              like: Run, what: str) -> np.ndarray | Run:
    """onnxruntime's mask forms as an additive bias: 1-D (B) key lengths (right padding),
    2-D (B, total) or 3-D (B, Sq, total) of 1 (attend) and 0 (masked, gets `fill`)."""
    dtype = np_dtype(like)
    shape = _shape_of(mask)
    if shape == (b,):
        if not isinstance(mask, Const):
            lengths = _reshape_to(imp, imp.emit("mp.cast", [mask],
                                                declared=mask.type.with_elem("i64"),
                                                onnx_type=TensorProto.INT64), (b, 1, 1, 1))
            keys = imp.constant(np.arange(total, dtype=np.int64).reshape(1, 1, 1, total), "keys")
            keep = imp.emit("mp.less", [keys, lengths], onnx_type=TensorProto.BOOL)
            return imp.emit("mp.where", [keep, _scalar(imp, 0.0, like), _scalar(imp, fill, like)],
                            onnx_type=like.onnx_type)
        keep = np.arange(total)[None, :] < mask.array.reshape(b, 1)
        return np.where(keep, dtype.type(0), dtype.type(fill)).reshape(b, 1, 1, total)
    if shape not in ((b, total), (b, sq, total)):
        raise imp.error(f"{what} of shape {list(shape)}: mplower takes (B), (B, total) and "
                        f"(B, S, total) masks")
    bshape = (b, 1, 1, total) if len(shape) == 2 else (b, 1, sq, total)
    if isinstance(mask, Const):
        return np.where(mask.array.reshape(bshape) != 0, dtype.type(0), dtype.type(fill))
    keep = imp.emit("mp.equal", [mask, imp.constant(np.zeros((), np.dtype(
        FORMATS[mask.type.elem].storage if mask.type.elem != "i1" else np.bool_)), "zero")],
        onnx_type=TensorProto.BOOL)
    bias = imp.emit("mp.where", [keep, _scalar(imp, fill, like), _scalar(imp, 0.0, like)],
                    onnx_type=like.onnx_type)
    return _reshape_to(imp, bias, bshape)


def _attention_bias(imp: _Importer, i: int, bias: Bias, like: Run) -> None:
    if imp.input(i) is None:
        return
    v = imp.need_tensor(i)
    bias.add(imp, v.array.astype(np_dtype(like)) if isinstance(v, Const) else v)


def _contrib_sdpa(imp: _Importer, a: dict, q: Run, k: Run, v: Run, plen: int, mask: int,
                  mask_name: str) -> Run:
    """Attention and MultiHeadAttention's shared tail: the key mask of input `mask`, the causal
    mask (`unidirectional`), attention_bias (input 5), then scaled dot-product attention."""
    b, _, sq, _ = q.type.shape
    total = k.type.shape[2]
    fill = float(a.get("mask_filter_value", -10000.0))
    bias = Bias()
    if imp.input(mask) is not None:
        bias.add(imp, _key_mask(imp, imp.need_tensor(mask), b, sq, total, fill, q, mask_name))
    if int(a.get("unidirectional", 0)):
        # onnxruntime adds mask_filter_value past the causal frontier too
        bias.add(imp, np.where(causal_allowed(sq, total, plen), np_dtype(q).type(0),
                               np_dtype(q).type(fill)))
    _attention_bias(imp, 5, bias, q)
    scale = a.get("scale")
    y, _ = sdpa(imp, q, k, v, bias, scale=None if scale is None else float(scale),
                split_scale=False)
    return y


@handler(MS + "Attention")
def _ms_attention(imp: _Importer, node: onnx.NodeProto) -> list:
    a = _attrs(node)
    for flag in ("do_rotary", "past_present_share_buffer"):
        if int(a.get(flag, 0)):
            raise imp.error(f"{flag} = 1 is not supported")
    if imp.input(6) is not None:
        raise imp.error("past_sequence_length (a shared past/present buffer) is not supported")
    heads = _required(imp, a, "num_heads")
    x = imp.run_input(0)
    w = imp.as_run(imp.need_tensor(1), node.input[1])
    _same_onnx(imp, x, w)
    qkv = binary(imp, "mp.matmul", x, w)
    width = qkv.type.shape[-1]
    if imp.input(2) is not None:
        qkv = binary(imp, "mp.add", qkv, param(imp, 2, (width,), qkv, "the bias"))
    sizes = [int(v) for v in a.get("qkv_hidden_sizes", [])] or [width // 3] * 3
    if sum(sizes) != width or len(sizes) != 3:
        raise imp.error(f"qkv_hidden_sizes {sizes} do not add up to the weights' {width} columns")
    q, k, v = (split_heads(imp, slice_last(imp, qkv, start, start + n), heads, what)
               for start, n, what in ((0, sizes[0], "Q"), (sizes[0], sizes[1], "K"),
                                      (sizes[0] + sizes[1], sizes[2], "V")))
    past = imp.input(4)
    plen = 0
    if past is not None:
        p = imp.as_run(past, node.input[4])
        if p.type.rank != 5 or p.type.shape[0] != 2:
            raise imp.error(f"past must be (2, B, N, P, D), got {list(p.type.shape)}")
        plen = p.type.shape[3]
        ps = p.type.shape[1:]
        pk, pv = (_reshape_to(imp, imp.emit("mp.slice", [p], {
            "starts": [i, 0, 0, 0, 0], "ends": [i + 1, *ps], "steps": [1] * 5},
            onnx_type=p.onnx_type), ps) for i in (0, 1))
        k, v = with_past(imp, pk, k, "past"), with_past(imp, pv, v, "past")
    y = _contrib_sdpa(imp, a, q, k, v, plen, 3, "mask_index")
    present = None
    if len(node.output) > 1 and node.output[1] and imp.consumers.get(node.output[1]):
        one = (1, *k.type.shape)
        present = concat(imp, [_reshape_to(imp, k, one), _reshape_to(imp, v, one)], 0)
    return [merge_heads(imp, y), present]


def _packed(imp: _Importer, x: Run, index: int, count: int) -> Run:
    """Entry `index` of a packed (B, S, N, count, D) input as (B, N, S, D)."""
    b, s, n, _, d = x.type.shape
    part = imp.emit("mp.slice", [x], {"starts": [0, 0, 0, index, 0],
                                      "ends": [b, s, n, index + 1, d], "steps": [1] * 5},
                    onnx_type=x.onnx_type)
    return transpose(imp, _reshape_to(imp, part, (b, s, n, d)), (0, 2, 1, 3))


@handler(MS + "MultiHeadAttention")
def _multi_head_attention(imp: _Importer, node: onnx.NodeProto) -> list:
    a = _attrs(node)
    for i, what in ((8, "past_sequence_length (a shared buffer)"),
                    (9, "cache_indirection (beam search)")):
        if imp.input(i) is not None:
            raise imp.error(f"{what} is not supported")
    _unused_outputs(imp, node, range(3, 4), "the qk output is not supported")
    heads = _required(imp, a, "num_heads")
    query = imp.run_input(0)
    bias_in = imp.input(3)
    if query.type.rank == 5:  # packed QKV (B, S, N, 3, D)
        if bias_in is not None:
            raise imp.error("a bias with packed QKV is not supported")
        q, k, v = (_packed(imp, query, i, 3) for i in range(3))
    else:
        key = imp.run_input(1)
        hq = query.type.shape[-1]
        bias_q = bias_k = bias_v = None
        if bias_in is not None:
            full = imp.as_run(imp.need_tensor(3), node.input[3])
            hk = key.type.shape[-1] if key.type.rank == 3 else hq
            bias_q, bias_k = slice_last(imp, full, 0, hq), slice_last(imp, full, hq, hq + hk)
            bias_v = slice_last(imp, full, hq + hk, full.type.shape[-1])
        if bias_q is not None:
            query = binary(imp, "mp.add", query, bias_q)
        q = split_heads(imp, query, heads, "query")
        if key.type.rank == 5:  # packed KV (B, L, N, 2, D)
            k, v = _packed(imp, key, 0, 2), _packed(imp, key, 1, 2)
        elif key.type.rank == 4:  # keys and values already (B, N, L, D): no bias applies
            k, v = key, imp.run_input(2)
        else:
            value = imp.run_input(2)
            if bias_k is not None:
                key, value = binary(imp, "mp.add", key, bias_k), binary(imp, "mp.add", value,
                                                                        bias_v)
            k, v = split_heads(imp, key, heads, "key"), split_heads(imp, value, heads, "value")
    plen = 0 if imp.input(6) is None else _shape_of(imp.need(6))[2]
    k = with_past(imp, imp.input(6), k, "past_key")
    v = with_past(imp, imp.input(7), v, "past_value")
    y = _contrib_sdpa(imp, a, q, k, v, plen, 4, "key_padding_mask")
    return [merge_heads(imp, y), k, v, None]


def _first_prompt_positions(imp: _Importer, pos: Const | Run, b: int, s: int) -> Const | Run:
    """onnxruntime's GQA reads only the first position id in a first prompt (its schema says
    so; its CPU kernel takes position_ids[0, 0] for every sequence): positions p + 0, 1, ..."""
    steps = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s))
    if isinstance(pos, Const):
        return Const(pos.array.reshape(-1)[0].astype(np.int64) + steps)
    first = imp.emit("mp.slice", [pos], {"starts": [0, 0], "ends": [1, 1], "steps": [1, 1]},
                     onnx_type=pos.onnx_type)
    return binary(imp, "mp.add", first, imp.constant(steps.astype(np_dtype(pos)), "token_index"))


def _sink(imp: _Importer, i: int, b: int, heads: int, sq: int, like: Run) -> Run:
    """head_sink (one logit per head) as the (B, H, Sq, 1) column the softmax takes."""
    v = imp.need_tensor(i)
    if _shape_of(v) != (heads,):
        raise imp.error(f"head_sink must hold one value per head ({heads}), got shape "
                        f"{list(_shape_of(v))}")
    shape = (b, heads, sq, 1)
    if isinstance(v, Const):
        return imp.constant(np.ascontiguousarray(np.broadcast_to(
            v.array.astype(np_dtype(like)).reshape(1, heads, 1, 1), shape)), "head_sink")
    _same_onnx(imp, like, v)
    return imp.emit("mp.expand", [_reshape_to(imp, v, (1, heads, 1, 1))],
                    declared=tensor(shape, v.type.elem), onnx_type=v.onnx_type)


@handler(MS + "GroupQueryAttention")
def _group_query_attention(imp: _Importer, node: onnx.NodeProto) -> list:
    """Static-shape GQA: every batch entry holds past_key's length P of cached tokens and adds
    S new ones (seqlens_k = P + S - 1 everywhere, total_sequence_length = P + S), so the present
    cache is past and new concatenated. Other lengths depend on the values of seqlens_k (ragged
    batches, a shared max-length buffer) and are refused."""
    a = _attrs(node)
    for i, what in ((12, "k_scale (a quantized KV cache)"),
                    (13, "v_scale (a quantized KV cache)"), (14, "q_norm_weight"),
                    (15, "k_norm_weight"), (16, "query_seqlens")):
        if imp.input(i) is not None:
            raise imp.error(f"{what} is not supported")
    if int(a.get("sliding_window_cache", 0)) > 0:
        raise imp.error("sliding_window_cache = 1 (a window-sized cache that evicts by values) "
                        "is not supported")
    _unused_outputs(imp, node, range(3, 4), "the qk output is not supported")
    heads, kv_heads = _required(imp, a, "num_heads"), _required(imp, a, "kv_num_heads")
    query = imp.run_input(0)
    if query.type.rank != 3 or heads <= 0 or kv_heads <= 0:
        raise imp.error(f"query must be 3-D and the head counts positive (query "
                        f"{list(query.type.shape)}, {heads} and {kv_heads} heads)")
    b, s, width = query.type.shape
    if imp.input(1) is None:  # packed QKV along the hidden axis
        d = width // (heads + 2 * kv_heads)
        parts = [slice_last(imp, query, 0, heads * d),
                 slice_last(imp, query, heads * d, (heads + kv_heads) * d),
                 slice_last(imp, query, (heads + kv_heads) * d, width)]
    else:
        parts = [query, imp.run_input(1), imp.run_input(2)]
    q = split_heads(imp, parts[0], heads, "query")
    k = split_heads(imp, parts[1], kv_heads, "key")
    v = split_heads(imp, parts[2], kv_heads, "value")
    past = 0 if imp.input(3) is None else _shape_of(imp.need(3))[2]
    for i in (5, 6):
        if not isinstance(imp.need(i), Const):
            roots = ", ".join(map(repr, imp._graph_inputs_under(node.input[i]))) or "none"
            raise imp.error(f"{'seqlens_k' if i == 5 else 'total_sequence_length'} "
                            f"('{node.input[i]}') is computed at run time (from graph input(s) "
                            f"{roots}): the cache length of each batch entry would decide the "
                            f"masks and the present cache's shape from values; mplower imports "
                            f"GroupQueryAttention with constant seqlens_k and "
                            f"total_sequence_length")
    seqlens, total = imp.need(5).array, imp.need(6).array
    want = past + s
    if int(np.reshape(total, -1)[0]) != want or np.any(np.reshape(seqlens, -1) != want - 1):
        raise imp.error(f"seqlens_k {np.reshape(seqlens, -1).tolist()} and "
                        f"total_sequence_length {int(np.reshape(total, -1)[0])}: mplower takes "
                        f"a cache of past_key's length {past} plus the {s} new tokens for every "
                        f"batch entry (seqlens_k = {want - 1}); other lengths depend on values "
                        f"(a ragged batch or a shared max-length buffer)")
    if int(a.get("do_rotary", 0)):
        pos = _positions(imp, 9, b, s, past)
        if not past and imp.input(9) is not None:
            pos = _first_prompt_positions(imp, pos, b, s)
        interleaved = bool(a.get("rotary_interleaved", 0))
        cos, sin = cache_rows(imp, 7, pos, q), cache_rows(imp, 8, pos, q)
        half = _shape_of(imp.need(7))[-1]
        cos_b = as_broadcast(imp, cos, (b, 1, s, half), q, "cos")
        sin_b = as_broadcast(imp, sin, (b, 1, s, half), q, "sin")
        q = rotate(imp, q, cos_b, sin_b, 2 * half, interleaved)
        k = rotate(imp, k, cos_b, sin_b, 2 * half, interleaved)
    k = with_past(imp, imp.input(3), k, "past_key")
    v = with_past(imp, imp.input(4), v, "past_value")
    bias = Bias()
    window = int(a.get("local_window_size", -1))
    causal = bool(a.get("causal", 1))
    if causal or window >= 0:  # onnxruntime leaves such keys out of the softmax
        bias.allow(imp, causal_allowed(s, want, past, window - 1 if window > 0 else -1,
                                       causal=causal))
    _attention_bias(imp, 10, bias, q)
    sink = None
    if imp.input(11) is not None or int(a.get("smooth_softmax", 0)) > 0:
        # One more logit per row (the head's sink, or 0 for smooth softmax), as onnxruntime's
        # ComputeSmoothSoftmaxInplace adds exp(sink - max) to the denominator.
        sq = q.type.shape[2]
        sink = _sink(imp, 11, b, heads, sq, q) if imp.input(11) is not None else \
            imp.constant(np.zeros((b, heads, sq, 1), np_dtype(q)), "smooth_softmax")
    scale = a.get("scale")
    softcap = float(a.get("softcap", 0.0))
    y, _ = sdpa(imp, q, k, v, bias, scale=None if scale in (None, 0.0) else float(scale),
                split_scale=False, softcap=softcap, sink=sink)
    return [merge_heads(imp, y), k, v, None]

