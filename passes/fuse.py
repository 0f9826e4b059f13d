"""`fuse`: chains of ops that one kernel runs in one pass over memory become one fused op.

Patterns (mplower.ir.rewrite), each applied only where the fused kernel gives the separate
ops' bits: a residual add and its relu (`mp.add_relu`); an integer quantize read only by its
dequantize (`mp.fake_quant`); a conv with the dequantize of its exact integer sums, a
per-channel bias add, a relu, and a quantize or QDQ pair of its result, and a channel shuffle
read by a depthwise conv (`mp.fused_conv2d`); an 8-bit integer matmul with the dequantize of
its exact sums and the adds of vectors along its columns, and a float matmul with the bias
adds that follow it in its own format (`mp.fused_matmul`); a bf16/fp16 add, sub or mul and the
cast of its result (`mp.fused_binary`). The fused ops are declared in mplower.dialect.fused and
fused_conv; what the pass printed is what `run` and `bench` execute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.dialect.fused import (
    F32_EXACT,
    PLAIN_FLOATS,
    RELU_BEFORE_ROUNDING,
    along_last_axis,
)
from mplower.dialect.plan import ACCUM, ACCUM_BITS, PRECISION, Plan, unmaterialized
from mplower.ir.graph import Function, Module
from mplower.ir.opdef import OPS, attr_array, attr_type, check_attrs
from mplower.ir.rewrite import Pattern, apply_patterns, only_user, producer, replace_op
from mplower.ir.types import TypeAttr
from mplower.numerics.formats import FORMATS, f16_accum_emulated
from mplower.pass_manager import Pass, PassContext, register_pass


def _annotations(f: Function, node: int) -> dict[str, Any]:
    """The plan annotations (`mp.*`) of the op a fused op starts with: the report shows what
    was requested and executed for the fused op as for that one."""
    return {k: v for k, v in f.attrs_of(node).items() if "." in k}


# ---- add + relu -------------------------------------------------------------------------------


def _match_add_relu(f: Function, add: int) -> int | None:
    out = f.types(add)[0]
    relu = only_user(f, (add, 0), "mp.relu")
    if relu is None or f.types(relu)[0].elem != out.elem \
            or (out.elem != "f32" and out.elem not in RELU_BEFORE_ROUNDING):
        return None
    # The kernel reads two operands of the result's shape, each f32 or in the result's format.
    if any(t != out.with_elem(t.elem) or t.elem not in ("f32", out.elem)
           for t in f.operand_types(add)):
        return None
    return relu


def _rewrite_add_relu(f: Function, add: int, relu: int) -> None:
    replace_op(f, [add, relu], "mp.add_relu", f.operands(add), _annotations(f, add))


ADD_RELU = Pattern("add-relu", _match_add_relu, _rewrite_add_relu, ops=frozenset({"mp.add"}))


# ---- matmul + dequantize + column adds ------------------------------------------------------


def _magnitude(elem: str) -> float:
    f = FORMATS[elem]
    return max(abs(f.min_value), f.max_finite)


def _column_adds(f: Function, first: int, fits: Any) -> tuple[list[int], list[tuple]]:
    """The adds after `first` of a vector along the last axis (the other operand, for which
    `fits(add, its type)` holds), each the only reader of the op before: (their nodes, the
    vectors' values)."""
    chain, vectors, last = [], [], first
    shape = f.types(first)[0].shape
    while (add := only_user(f, (last, 0), "mp.add")) is not None:
        operands = f.operands(add)
        other = operands[1] if operands[0] == (last, 0) else operands[0]
        t = f.type_of(other)
        if not along_last_axis(t, shape) or not fits(add, t):
            break
        chain.append(add)
        vectors.append(other)
        last = add
    return chain, vectors


def _dequantize_scale(f: Function, dq: int, channels: int, axis: int = -1) -> Any:
    """The scale of an f32 dequantize of exact i32 sums whose channels lie along `axis` (a
    matmul's columns: -1; a conv's: 1), if it is one value or one per channel, with zero point
    0 and no blocks; else None."""
    a = check_attrs(OPS["mp.dequantize"], f.attrs_of(dq))
    scale, zp = attr_array(a["scale"]), attr_array(a["zero_point"])
    rank = f.types(dq)[0].rank
    if f.types(dq)[0].elem != "f32" or np.any(zp != 0) or a["block_size"]:
        return None
    if scale.size == 1:
        return f.attrs_of(dq)["scale"]
    return f.attrs_of(dq)["scale"] if a["axis"] % rank == axis % rank and scale.size == channels \
        else None


def _match_integer_matmul(f: Function, mm: int) -> tuple | None:
    x_t, w_t = f.operand_types(mm)
    out = f.types(mm)[0]
    if out.elem != "i32" or out.rank == 0 or ACCUM_BITS in f.attrs_of(mm) \
            or any(t.elem not in ("i8", "ui8") for t in (x_t, w_t)) \
            or _magnitude(x_t.elem) * _magnitude(w_t.elem) * x_t.shape[-1] > F32_EXACT:
        return None
    dq = only_user(f, (mm, 0), "mp.dequantize")
    scale = None if dq is None else _dequantize_scale(f, dq, out.shape[-1])
    if scale is None:
        return None
    chain, vectors = _column_adds(f, dq, lambda add, t: t.elem == "f32" and all(
        u.elem == "f32" for u in (*f.operand_types(add), *f.types(add))))
    return [dq, *chain], vectors, {"scale": scale}


def _match_float_matmul(f: Function, mm: int) -> tuple | None:
    ins, out = f.operand_types(mm), f.types(mm)[0]
    attrs = f.attrs_of(mm)
    if out.rank == 0 or ACCUM_BITS in attrs or ins[1].encoding is not None \
            or not all(t.elem in PLAIN_FLOATS for t in (*ins, out)):
        return None
    f16 = Plan.of(attrs).accum == "f16"
    if f16 and f16_accum_emulated(ins[0].elem):
        return None  # the fp16 accumulator's kernel
    chain, vectors = _column_adds(f, mm, lambda add, t: all(
        u.elem in PLAIN_FLOATS for u in (*f.operand_types(add), *f.types(add))))
    if not chain:
        return None
    # What the product and each add but the last round to, unless all are the result's.
    formats = [out.elem, *(f.types(add)[0].elem for add in chain[:-1])]
    last = f.types(chain[-1])[0].elem
    return chain, vectors, {} if set(formats) == {last} else {
        "formats": tuple(TypeAttr(e) for e in formats)}


def _rewrite_matmul(f: Function, mm: int, match: tuple) -> None:
    chain, vectors, attrs = match
    replace_op(f, [mm, *chain], "mp.fused_matmul", [*f.operands(mm), *vectors],
               {**attrs, **_annotations(f, mm)})


MATMULS = (
    Pattern("matmul-dequantize", _match_integer_matmul, _rewrite_matmul,
            ops=frozenset({"mp.matmul"})),
    Pattern("matmul-bias", _match_float_matmul, _rewrite_matmul, ops=frozenset({"mp.matmul"})),
)


# ---- quantize + dequantize --------------------------------------------------------------------


def _match_qdq(f: Function, q: int) -> dict | None:
    """An integer quantize read only by a dequantize with its scale and zero point: the
    fake_quant that computes both in one pass (quant.fake_quantizer), the same float32 bits."""
    from mplower.numerics.quant import fake_quantizer

    dq = only_user(f, (q, 0), "mp.dequantize")
    if dq is None:
        return None
    qa, da = (check_attrs(OPS[f.op(n)], f.attrs_of(n)) for n in (q, dq))
    x_t, q_t = f.operand_types(q)[0], f.types(q)[0]
    scale, zp = attr_array(qa["scale"]), attr_array(qa["zero_point"])
    axis = qa["axis"] if scale.size > 1 else None
    if x_t.elem != "f32" or f.types(dq)[0].elem != "f32" or qa["block_size"] \
            or da["block_size"] or not FORMATS[q_t.elem].is_int \
            or not np.array_equal(scale, attr_array(da["scale"])) \
            or not np.array_equal(zp, attr_array(da["zero_point"])) \
            or axis is not None and axis % q_t.rank != da["axis"] % q_t.rank \
            or fake_quantizer(x_t.shape, scale.astype(np.float32), zp, q_t.elem, axis) is None:
        return None
    attrs = {k: f.attrs_of(q)[k] for k in ("scale", "zero_point", "axis") if k in f.attrs_of(q)}
    return {"dq": dq, "attrs": {**attrs, "dtype": TypeAttr(q_t.elem), **_annotations(f, q)}}


def _rewrite_qdq(f: Function, q: int, match: dict) -> None:
    replace_op(f, [q, match["dq"]], "mp.fake_quant", f.operands(q), match["attrs"])


QDQ = Pattern("quantize-dequantize", _match_qdq, _rewrite_qdq, ops=frozenset({"mp.quantize"}))


# ---- conv + its epilogue ----------------------------------------------------------------------
# A conv is followed, in a network, by ops that touch each output once: the dequantize of an
# integer conv, the add of a per-channel bias, a relu, a quantize for the next integer conv (or
# a QDQ pair before a float op). mp.fused_conv2d runs them as the implicit GEMM stores each
# output (mplower.numerics.conv's epilogue), each with the float32 operation the op's kernel
# uses: the same bits, two to four passes over memory fewer.

# |sum| below 2^31: the exact sum is the int32 that dequantize would read.
_I32_LIMIT = 2 ** 31


def _float_conv(f: Function, conv: int) -> bool:
    """Whether the backend runs a conv on the implicit GEMM with an f32 accumulator and float
    operands, its result f32 or a format it rounds to as it stores it."""
    ins, out = f.operand_types(conv), f.types(conv)[0]
    f16 = Plan.of(f.attrs_of(conv)).accum == "f16" and f16_accum_emulated(ins[0].elem)
    return not f16 and all(FORMATS[t.elem].is_float and t.elem != "f64" for t in ins) \
        and out.elem in PLAIN_FLOATS


def _bias_add(f: Function, last: int, channels: int) -> tuple[int, Any] | None:
    """The f32 add of one value per channel (or one for all) to `last`'s f32 result, if it is
    its only reader: (the add, the added value)."""
    add = only_user(f, (last, 0), "mp.add")
    if add is None or f.types(add)[0] != f.types(last)[0] or f.types(add)[0].elem != "f32":
        return None
    operands = f.operands(add)
    other = operands[1] if operands[0] == (last, 0) else operands[0]
    t = f.type_of(other)
    shape = (1,) * (4 - t.rank) + t.shape if t.rank <= 4 else ()
    if t.elem != "f32" or len(shape) != 4 or shape[0] != 1 or shape[2:] != (1, 1) \
            or shape[1] not in (1, channels):
        return None
    return add, other


def _depthwise(f: Function, conv: int) -> bool:
    x_t, w_t = f.operand_types(conv)[:2]
    groups = check_attrs(OPS[f.op(conv)], f.attrs_of(conv))["groups"]
    return x_t.rank == 4 and groups == x_t.shape[1] and w_t.shape[1] == 1


def _quantized_result(f: Function, conv: int, q: int, integer: bool) -> dict | None:
    """The out_* attributes of a fused conv that quantizes its f32 result as `q` (mp.quantize:
    per tensor, to an 8-bit integer format) does, or requantizes it as `q` (mp.fake_quant:
    a depthwise conv's, per tensor or per channel) does; else None."""
    a = check_attrs(OPS[f.op(q)], f.attrs_of(q))
    scale, zp = attr_array(a["scale"]), attr_array(a["zero_point"])
    if a["block_size"]:
        return None
    if f.op(q) == "mp.quantize":
        fmt = FORMATS[f.types(q)[0].elem]
        if not fmt.is_int or fmt.bits != 8 or scale.size != 1 or zp.size != 1 \
                or not fmt.min_value <= zp.reshape(()) <= fmt.max_finite:
            return None
        dtype = f.types(q)[0].elem
    else:
        dtype = attr_type(a["dtype"])
        if not _depthwise(f, conv) or dtype not in ("i8", "ui8") \
                or f.types(q)[0].elem != "f32" or scale.size > 1 and a["axis"] % 4 != 1 \
                or integer and any(t.elem not in ("i8", "ui8")
                                   for t in f.operand_types(conv)[:2]):
            return None
    return {"out_scale": f.attrs_of(q)["scale"],
            "out_zero_point": f.attrs_of(q).get("zero_point", 0), "out_dtype": TypeAttr(dtype)}


def _match_conv(f: Function, conv: int) -> tuple | None:
    ins, out = f.operand_types(conv), f.types(conv)[0]
    channels = out.shape[1]
    chain: list[int] = []
    attrs: dict[str, Any] = {}
    bias = ins[2:] and [f.operands(conv)[2]]
    last = conv
    if out.elem == "i32":
        x_t, w_t = ins[:2]
        k = w_t.shape[1] * w_t.shape[2] * w_t.shape[3]
        if len(ins) != 2 or any(t.elem not in ("i8", "ui8") for t in (x_t, w_t)) \
                or _magnitude(x_t.elem) * _magnitude(w_t.elem) * k >= _I32_LIMIT:
            return None
        dq = only_user(f, (conv, 0), "mp.dequantize")
        scale = None if dq is None else _dequantize_scale(f, dq, channels, axis=1)
        if scale is None:
            return None
        chain.append(dq)
        attrs["scale"] = scale
        last = dq
    elif not _float_conv(f, conv) or out.elem not in ("f32", *RELU_BEFORE_ROUNDING):
        return None
    if not bias and f.types(last)[0].elem == "f32" \
            and (added := _bias_add(f, last, channels)) is not None:
        chain.append(added[0])
        bias, last = [added[1]], added[0]
    relu = only_user(f, (last, 0), "mp.relu")
    if relu is not None and f.types(relu)[0].elem == f.types(last)[0].elem:
        chain.append(relu)
        attrs["relu"] = True
        last = relu
    if f.types(last)[0].elem == "f32":
        q = only_user(f, (last, 0), ("mp.quantize", "mp.fake_quant"))
        quantized = None if q is None else _quantized_result(f, conv, q, "scale" in attrs)
        if quantized is not None:
            chain.append(q)
            attrs.update(quantized)
    if not chain:
        return None
    conv_attrs = {k: v for k, v in f.attrs_of(conv).items() if "." not in k}
    return chain, [*f.operands(conv)[:2], *bias], {**conv_attrs, **attrs,
                                                    **_annotations(f, conv)}


def _rewrite_conv(f: Function, conv: int, match: tuple) -> None:
    chain, operands, attrs = match
    replace_op(f, [conv, *chain], "mp.fused_conv2d", operands, attrs)


CONV = Pattern("conv-epilogue", _match_conv, _rewrite_conv, ops=frozenset({"mp.conv2d"}))


# ---- a channel shuffle read by a depthwise conv ----------------------------------------------
# ShuffleNet's channel shuffle (reshape to (N, g, C/g, H, W), swap axes 1 and 2, reshape back)
# copies the tensor, and a depthwise conv, which reads each input channel as one plane, is its
# only reader: the conv reads the planes in the shuffled order instead (fused_conv2d's
# `shuffle`, numerics.depthwise), the same values, so the same bits, without the copy.
# Per-tensor elementwise ops in between (a lowered plan's quantize, scaled_quant or cast) run
# on the unshuffled tensor: each element gets the same operation, and the scale of a
# per-tensor recipe (the amax of the tensor) does not depend on the order of the elements.


def _only_read(f: Function, value: Any) -> int | None:
    """The op that computes `value`, where one op reads it once and the function does not
    return it."""
    return producer(f, value) if only_user(f, value) is not None else None


def _per_tensor(f: Function, n: int) -> bool:
    op = f.op(n)
    if op == "mp.cast":
        return True
    if op not in ("mp.quantize", "mp.scaled_quant"):
        return False
    a = check_attrs(OPS[op], f.attrs_of(n))
    if op == "mp.quantize":
        return attr_array(a["scale"]).size == 1 and not a["block_size"]
    return a["recipe"] != "block"


def _match_shuffle(f: Function, conv: int) -> tuple | None:
    x_t = f.operand_types(conv)[0]
    if not _depthwise(f, conv):
        return None
    if f.op(conv) == "mp.conv2d" and not _float_conv(f, conv) \
            or f.op(conv) == "mp.fused_conv2d" \
            and check_attrs(OPS["mp.fused_conv2d"], f.attrs_of(conv))["shuffle"] != 1:
        return None
    chain, back = [], _only_read(f, f.operands(conv)[0])
    while back is not None and f.op(back) != "mp.reshape" and _per_tensor(f, back) \
            and f.operand_types(back)[0].shape == x_t.shape:
        chain.append(back)
        back = _only_read(f, f.operands(back)[0])
    swap = back is not None and f.op(back) == "mp.reshape" and _only_read(f, f.operands(back)[0])
    split = swap and f.op(swap) == "mp.transpose" and _only_read(f, f.operands(swap)[0])
    if not split or f.op(split) != "mp.reshape" \
            or tuple(check_attrs(OPS["mp.transpose"], f.attrs_of(swap))["perm"]) \
            != (0, 2, 1, 3, 4) or f.operand_types(split)[0].shape != x_t.shape \
            or len({f.types(n)[0].elem for n in (back, swap, split)}) != 1:
        return None
    return chain, back, swap, split


def _rewrite_shuffle(f: Function, conv: int, match: tuple) -> None:
    chain, back, swap, split = match
    groups = f.types(split)[0].shape[1]
    f.set_operand(chain[-1] if chain else conv, 0, f.operands(split)[0])
    for n in (back, swap, split):
        f.erase(n)
    if f.op(conv) == "mp.fused_conv2d":
        f.set_attr(conv, "shuffle", groups)
    else:
        replace_op(f, [conv], "mp.fused_conv2d", f.operands(conv),
                   {**f.attrs_of(conv), "shuffle": groups})


SHUFFLE = Pattern("shuffle-into-conv", _match_shuffle, _rewrite_shuffle,
                  ops=frozenset({"mp.conv2d", "mp.fused_conv2d"}))


# ---- a bf16/fp16 add, sub or mul and the cast of its result ----------------------------------
# BERT's GELU casts its f32 products to bf16: the op and both roundings in one pass
# (elementwise.binary_rounded), with their bits.


def _match_binary_cast(f: Function, n: int) -> int | None:
    ins, out = f.operand_types(n), f.types(n)[0]
    shape = out.shape
    full = [t.shape == shape or not shape for t in ins]
    if not all(t.elem in PLAIN_FLOATS for t in (*ins, out)) or not any(full) \
            or not all(a or along_last_axis(t, shape) for a, t in zip(full, ins, strict=True)):
        return None
    cast = only_user(f, (n, 0), "mp.cast")
    if cast is None:
        return None
    to = f.types(cast)[0].elem
    saturate = check_attrs(OPS["mp.cast"], f.attrs_of(cast))["saturate"]
    if to not in PLAIN_FLOATS or saturate and to.startswith("f8") or out.elem == to == "f32":
        return None
    return cast


def _rewrite_binary_cast(f: Function, n: int, cast: int) -> None:
    replace_op(f, [n, cast], "mp.fused_binary", f.operands(n),
               {"kind": f.op(n)[3:], "formats": (TypeAttr(f.types(n)[0].elem),),
                **_annotations(f, n)})


BINARY_CAST = Pattern("binary-cast", _match_binary_cast, _rewrite_binary_cast,
                      ops=frozenset({"mp.add", "mp.sub", "mp.mul"}))


FUSED = frozenset({"mp.add_relu", "mp.fused_matmul", "mp.fused_conv2d", "mp.fused_binary"})
# In this order: residual adds first (an add that could close either chain is a residual's),
# QDQ pairs before the convs that requantize through them, a conv's epilogue before the
# shuffle it reads, matmul bias adds before the adds that stay.
PHASES = ((ADD_RELU,), (QDQ,), (CONV,), (SHUFFLE,), MATMULS, (BINARY_CAST,))


def fuse_function(f: Function, ctx: PassContext) -> None:
    for patterns in PHASES:
        apply_patterns(f, patterns, ctx.stat)
    # A fused op keeps the plan of the op its chain starts with, unless its other operands or
    # its result are in formats that plan does not describe (an fp8 matmul's f32 bias add):
    # then its compute format and accumulator are its operands' (what the report shows), so
    # the backend does not take the plan for one insert-casts has yet to materialize.
    while (n := unmaterialized(f)) is not None and f.op(n) in FUSED:
        f.del_attr(n, PRECISION)
        f.del_attr(n, ACCUM)


@register_pass
@dataclass
class Fuse(Pass):
    """Fuse chains of ops that one kernel runs in one pass over memory into fused ops, where
    the fused kernel gives the separate ops' bits.

    A residual add and its relu become `mp.add_relu`; an integer quantize -> dequantize pair
    `mp.fake_quant`; a conv and the dequantize of its integer sums, a per-channel bias add, a
    relu and a quantize (or, for a depthwise conv, a QDQ pair) of its result, or a channel
    shuffle (reshape, transpose, reshape) that a depthwise conv reads, `mp.fused_conv2d`; an
    8-bit integer matmul, the dequantize of its sums and the adds of vectors along its
    columns, or a float matmul and the bias adds in its format that follow it,
    `mp.fused_matmul`; a bf16/fp16 add, sub or mul and the cast of its result
    `mp.fused_binary`. Run it last: the result prints, parses and runs (`mplower run`,
    `mplower bench`) like any other module, and the unfused module gives the same bits, more
    slowly.
    """

    name: ClassVar[str] = "fuse"
    statistics: ClassVar[dict[str, str]] = {
        "add-relu": "adds and their relu fused (mp.add_relu)",
        "quantize-dequantize": "quantize -> dequantize pairs made one mp.fake_quant",
        "conv-epilogue": "convs fused with their dequantize, bias add, relu or quantize",
        "shuffle-into-conv": "channel shuffles read in place by their depthwise conv",
        "matmul-dequantize": "integer matmuls fused with their dequantize and column adds",
        "matmul-bias": "float matmuls fused with their bias adds",
        "binary-cast": "bf16/fp16 adds, subs and muls fused with the cast of their result",
    }

    def run(self, module: Module, ctx: PassContext) -> None:
        for f in module.functions.values():
            fuse_function(f, ctx)
