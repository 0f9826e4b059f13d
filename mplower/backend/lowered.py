"""The steps of a compiled function, and the kernel fusions `Program.run_lowered` still makes
on its own.

Each fusion replaces steps by one whose kernel computes the same bits in fewer passes over
memory; they predate the `fuse` pass (passes/fuse.py), which has taken over a residual add
and its relu and a matmul's dequantize and bias adds. Those below wait for their move to it:
a conv's dequantize, bias add, relu and rounding as the conv stores each output, a channel
shuffle read in place by its depthwise conv, convs written into their concatenation, an
integer quantize -> dequantize pair (or a conv's requantize or quantize) in one pass, a
scaled_quant's amax taken by its producer, a bf16/fp16 add/sub/mul with its rounding, and a
float matmul's rounding in place.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np

from mplower.backend.kernels import (
    NO_COUNTS,
    Kernel,
    add_relu_kernel,
    f32,
    magnitude,
    rounded_matmul_kernel,
)
from mplower.backend.scaled import ScaleStats, scaled_quant_kernel
from mplower.dialect.fused import PLAIN_FLOATS, RELU_BEFORE_ROUNDING
from mplower.dialect.plan import DENSE
from mplower.ir.diagnostics import Location
from mplower.ir.opdef import attr_array
from mplower.ir.types import TensorType
from mplower.numerics.conv import IntegerWeights
from mplower.numerics.elementwise import binary_rounded
from mplower.numerics.formats import FORMATS
from mplower.numerics.gemm import TILE_ROWS, PackedMatrix
from mplower.numerics.quant import fake_quantizer
from mplower.numerics.rounding import (
    ROUNDING_FORMATS,
    Counts,
)


@dataclass
class Step:
    node: int
    name: str  # the result's SSA name, e.g. "%3"
    op: str
    inputs: list[int]  # slot of each operand
    output: int  # slot of its result (an op with several results has a step per result)
    run: Kernel
    reference: Callable[[list[np.ndarray]], np.ndarray | None]
    requested: dict[str, str | None]
    executed: dict[str, str | None]
    reason: str | None  # why executed differs from requested (reason codes joined by ",")
    flops: int
    out_type: TensorType
    loc: Location
    constant: np.ndarray | None = None  # the lowered value of an mp.constant, rounded once
    constant_counts: Counts = NO_COUNTS
    scale_stats: list[ScaleStats] | None = None  # mp.scaled_quant: its last step's account
    attrs: dict = field(default_factory=dict)  # checked attributes
    in_types: list[TensorType] = field(default_factory=list)
    # A depthwise conv's input channel c is channel channels[c] of its operand (run_lowered's
    # shuffle fusion, _fuse_shuffles).
    channels: np.ndarray | None = None
    # A conv's fused epilogue (scale, bias, relu, rounded format), as _fuse_epilogues built it.
    epilogue: tuple | None = None
    # A conv writing its channels of a concatenation (_fuse_concats): (channel0, shape, first,
    # last).
    concat: tuple | None = None
    # This step's kernel, built to also leave the amax of its result in a box (_fuse_amax).
    amax_kernel: Callable[[Any], Kernel] | None = None


# ---- packed weights (run_lowered) ----------------------------------------------------------
# A matmul whose b is a constant matrix (a weight) reads it converted to the product's working
# precision and packed into panels (mplower.numerics.gemm.PackedMatrix), made once here: on
# every call that was a pass over b, and for an integer weight a float copy too.

# An integer conv's constant weight likewise: its magnitude bound and float32 copy, which the
# implicit GEMM reads (IntegerWeights), are made once.

def pack_weights(steps: list[Step], constants: dict[int, Any]) -> list[Step]:
    out = []
    for s in steps:
        w = constants.get(s.inputs[1]) if len(s.inputs) >= 2 else None
        dtype = getattr(s.run, "weight_dtype", None)
        if (s.op == "mp.matmul" and len(s.inputs) == 2 or s.op == "mp.fused_matmul") \
                and dtype is not None and isinstance(w, np.ndarray) and w.ndim == 2:
            s = replace(s, run=partial(_with_weight, s.run, PackedMatrix(w, dtype)))
        elif s.op == "mp.conv2d" and getattr(s.run, "integer_weights", False) \
                and isinstance(w, np.ndarray) and w.ndim == 4 and w.dtype.kind in "iu":
            s = replace(s, run=partial(_with_weight, s.run, IntegerWeights(w)))
        out.append(s)
    return out


def _with_weight(run: Kernel, weight: PackedMatrix | IntegerWeights,
                 xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
    return run([xs[0], weight, *xs[2:]])


# ---- epilogue fusion (run_lowered) ---------------------------------------------------------
# A conv is followed, in a network, by ops that touch each output once: the dequantize of an
# integer conv, the add of a per-channel bias, a relu. run_lowered runs them as the GEMM stores
# each output (mplower.numerics.conv's epilogue), which computes each with the float32
# operation the op's kernel uses, so the bits are the same and two to four passes over memory
# (and their Python calls) are saved. Only where the intermediate values are used by nothing
# else, and every value in the chain is f32 except the conv's exact i32 sum.

# |sum| below 2^31: the exact sum is the int32 that dequantize would read.
_I32_LIMIT = 2 ** 31


def _only_user_of(steps: list[Step], outputs: list[int]):
    """only_user(s, op): the one step that reads s's result, if it is an `op` that reads it
    once and the result is not a function output; else None."""
    uses: dict[int, list[Step]] = {}
    for s in steps:
        for i in s.inputs:
            uses.setdefault(i, []).append(s)
    kept = set(outputs)

    def only_user(s: Step, op: str) -> Step | None:
        users = uses.get(s.output, [])
        if len(users) == 1 and users[0].op == op and s.output not in kept \
                and users[0].inputs.count(s.output) == 1:
            return users[0]
        return None
    return only_user


def _fuse_epilogues(steps: list[Step], constants: dict[int, Any],
                    outputs: list[int]) -> list[Step]:
    only_user = _only_user_of(steps, outputs)

    def bias_add(s: Step) -> Step:
        """The add of a per-channel f32 constant to s, if it is s's only use, into the chain
        and `bias`; the last step of the chain."""
        nonlocal bias
        add = only_user(s, "mp.add")
        if add is not None:
            other = add.inputs[1 - add.inputs.index(s.output)]
            bias = _channel_bias(constants.get(other), add, s.out_type.shape[1])
            if bias is not None:
                chain.append(add)
                return add
        return s

    fused: dict[int, Step] = {}  # step index (its node) -> the step that replaces it
    gone: set[int] = set()
    for conv in steps:
        if conv.op != "mp.conv2d" or conv.executed["accum"] not in ("f32", "i32") \
                or conv.executed["kernel"] != DENSE:
            continue
        channels = conv.out_type.shape[1]
        chain: list[Step] = []
        scale = bias = None
        last = conv
        if conv.out_type.elem == "i32":
            x_t, w_t = conv.in_types[:2]
            k = w_t.shape[1] * w_t.shape[2] * w_t.shape[3]
            if len(conv.inputs) != 2 or FORMATS[x_t.elem].bits != 8 \
                    or FORMATS[w_t.elem].bits != 8 \
                    or magnitude(x_t.elem) * magnitude(w_t.elem) * k >= _I32_LIMIT \
                    or (dq := only_user(conv, "mp.dequantize")) is None:
                continue
            scale = _dequantize_scale(dq, channels)
            if scale is None:
                continue
            chain.append(dq)
            last = bias_add(dq)
        elif conv.out_type.elem == "f32":
            # A conv without a bias operand (an fp8 plan's) takes the f32 add of one.
            last = bias_add(conv) if len(conv.inputs) == 2 else conv
        elif conv.out_type.elem not in RELU_BEFORE_ROUNDING:
            continue
        relu = only_user(last, "mp.relu")
        rounded = conv.out_type.elem if conv.out_type.elem in RELU_BEFORE_ROUNDING else None
        if relu is not None and relu.out_type.elem == last.out_type.elem:
            chain.append(relu)
            last = relu
        if not chain:
            # A rounded result alone (ShuffleNet's second grouped 1x1 conv of a unit, its bias
            # an operand) is rounded as the conv stores its tiles too, not in a pass after it.
            epilogue = _rebuildable(conv) if rounded is not None else None
            if epilogue is not None:
                fused[conv.node] = replace(conv, run=_fused_conv_kernel(conv, *epilogue),
                                           epilogue=epilogue)
            continue
        fused[conv.node] = replace(conv, name=last.name, output=last.output, out_type=last.out_type,
                                   run=_fused_conv_kernel(conv, scale, bias, relu is not None,
                                                          rounded),
                                   epilogue=(scale, bias, relu is not None, rounded))
        gone.update(s.node for s in chain)
    return [fused.get(s.node, s) for s in steps if s.node not in gone]


# ---- a float matmul's rounding (run_lowered) --------------------------------------------------
# A bf16/fp16 matmul's kernel rounds its float32 product into a new array and counts what the
# rounding did; run_lowered keeps no counts, so it rounds in place (round_add_columns with no
# adds: round_to's bits), one array and one pass fewer. Its bias adds are the `fuse` pass's
# mp.fused_matmul.

def _round_matmuls_in_place(steps: list[Step]) -> list[Step]:
    return [replace(s, run=rounded_matmul_kernel(s.out_type.elem, []))
            if s.op == "mp.matmul" and len(s.inputs) == 2 and s.out_type.elem != "f32"
            and getattr(s.run, "weight_dtype", None) == np.float32
            and all(t.elem in PLAIN_FLOATS for t in (*s.in_types, s.out_type)) else s
            for s in steps]


def _along_last_axis(value: Any, shape: tuple[int, ...], columns: int) -> np.ndarray | None:
    """A float32 constant that numpy broadcasts to `shape` along its last axis only (one value
    per column, or one for all), as a vector of `columns`, or None."""
    if not isinstance(value, np.ndarray) or value.dtype != np.float32 \
            or value.ndim > len(shape) or any(d != 1 for d in value.shape[:-1]) \
            or value.ndim and value.shape[-1] not in (1, columns):
        return None
    if tuple(np.broadcast_shapes(value.shape, shape)) != shape:
        return None
    return np.ascontiguousarray(np.broadcast_to(value.reshape(-1), (columns,)))


# ---- a bf16/fp16 plan's elementwise add, sub or mul and its rounding (run_lowered) ---------
# Their kernels run numpy's float32 op, then round_to over its result: two passes over memory
# and two new arrays. elementwise.binary_rounded does both in one pass, with their bits, and
# also the rounding of a cast that is the result's only reader (BERT's GELU casts its f32
# products to bf16).

_BINARY_OPS = {"mp.add": "add", "mp.sub": "sub", "mp.mul": "mul"}


def _fuse_rounded_binaries(steps: list[Step], constants: dict[int, Any],
                           outputs: list[int]) -> list[Step]:
    only_user = _only_user_of(steps, outputs)
    fused: dict[int, Step] = {}
    gone: set[int] = set()
    for s in steps:
        if s.op not in _BINARY_OPS or not getattr(s.run, "generic", False) \
                or len(s.inputs) != 2 or s.node in gone \
                or not all(t.elem in PLAIN_FLOATS for t in (*s.in_types, s.out_type)):
            continue
        shape = s.out_type.shape
        operands: list[np.ndarray | None] = []  # None: the step's input as it comes
        for i, t in zip(s.inputs, s.in_types, strict=True):
            vector = None if t.shape == shape or not shape \
                else _along_last_axis(constants.get(i), shape, shape[-1])
            if t.shape != shape and vector is None:
                break
            operands.append(vector)
        if len(operands) != 2 or all(v is not None for v in operands):
            continue
        chain, cast = [s], only_user(s, "mp.cast")
        if cast is not None and cast.out_type.elem in PLAIN_FLOATS \
                and not (cast.attrs["saturate"] and cast.out_type.elem.startswith("f8")):
            chain.append(cast)
        formats, last = tuple(c.out_type.elem for c in chain), chain[-1]
        if all(f == "f32" for f in formats):
            continue
        gone.update(c.node for c in chain[1:])
        fused[s.node] = replace(s, name=last.name, output=last.output, out_type=last.out_type,
                                run=_rounded_binary_kernel(_BINARY_OPS[s.op], operands,
                                                           formats))
    return [fused.get(s.node, s) for s in steps if s.node not in gone]


def _rounded_binary_kernel(op: str, operands: list[np.ndarray | None],
                           formats: tuple[str, ...]) -> Kernel:
    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        a, b = (f32(x) if v is None else v for x, v in zip(xs, operands, strict=True))
        return binary_rounded(op, a, b, formats), None  # run_lowered keeps no counts
    return run


def _readers(steps: list[Step]) -> dict[int, int]:
    """How many steps read each slot."""
    readers: dict[int, int] = {}
    for s in steps:
        for i in s.inputs:
            readers[i] = readers.get(i, 0) + 1
    return readers


def _rebuildable(conv: Step) -> tuple | None:
    """The (scale, bias, relu, rounded) with which `_fused_conv_kernel` computes what a conv
    step's kernel computes (so that it can be rebuilt reading another channel order, or
    writing into a concatenation), or None where its kernel is another (an integer result,
    float64, the f16 accumulator, a sparse kernel)."""
    if conv.epilogue is not None:
        return conv.epilogue
    out = conv.out_type.elem
    if not getattr(conv.run, "generic", False) or conv.executed["accum"] != "f32" \
            or conv.executed["kernel"] != DENSE \
            or out != "f32" and out not in ROUNDING_FORMATS \
            or not all(FORMATS[t.elem].is_float and t.elem != "f64" for t in conv.in_types):
        return None
    return None, None, False, None if out == "f32" else out


# ---- a channel shuffle read by a depthwise conv (run_lowered) ------------------------------
# ShuffleNet's channel shuffle (reshape to (N, g, C/g, H, W), swap axes 1 and 2, reshape back)
# copies the tensor, and a depthwise conv, which reads each input channel as one plane, is its
# only reader: the conv reads the planes in the shuffled order instead (`Step.channels`,
# numerics.depthwise), the same values, so the same bits, without the copy. Per-tensor
# elementwise ops in between (a lowered plan's quantize, scaled_quant or cast) run on the
# unshuffled tensor: each element gets the same operation, and the scale of a per-tensor
# recipe (the amax of the tensor) does not depend on the order of the elements.

def _per_tensor(s: Step) -> bool:
    if s.op == "mp.cast":
        return True
    if s.op == "mp.quantize":
        return attr_array(s.attrs["scale"]).size == 1 and not s.attrs["block_size"]
    return s.op == "mp.scaled_quant" and s.attrs["recipe"] != "block"


def _fuse_shuffles(steps: list[Step], outputs: list[int]) -> list[Step]:
    producer = {s.output: s for s in steps}
    readers, kept = _readers(steps), set(outputs)

    def only_reader(slot: int) -> Step | None:
        """The step that computes `slot`, where one step reads it and it is not an output."""
        return None if readers.get(slot) != 1 or slot in kept else producer.get(slot)

    fused: dict[int, Step] = {}
    gone: set[int] = set()
    for conv in steps:
        x_t = conv.in_types[0]
        if conv.op != "mp.conv2d" or x_t.rank != 4 or conv.attrs["groups"] != x_t.shape[1] \
                or conv.in_types[1].shape[1] != 1 or conv.node in fused \
                or (epilogue := _rebuildable(conv)) is None:
            continue
        chain, back = [], only_reader(conv.inputs[0])
        while back is not None and back.op != "mp.reshape" and _per_tensor(back) \
                and back.in_types[0].shape == x_t.shape and back.node not in fused:
            chain.append(back)
            back = only_reader(back.inputs[0])
        swap = back and back.op == "mp.reshape" and only_reader(back.inputs[0])
        split = swap and swap.op == "mp.transpose" and only_reader(swap.inputs[0])
        if not split or split.op != "mp.reshape" or tuple(swap.attrs["perm"]) != (0, 2, 1, 3, 4) \
                or split.in_types[0].shape != x_t.shape \
                or len({s.out_type.elem for s in (back, swap, split)}) != 1:
            continue
        # back's channel i * g + j is swap's (i, j), split's (j, i): input channel j * a + i.
        a, g = swap.out_type.shape[1], swap.out_type.shape[2]
        c = np.arange(a * g)
        channels = (c % g) * a + c // g
        first = chain[-1] if chain else conv  # the step that read the shuffled tensor
        fused[first.node] = replace(first, inputs=[split.inputs[0], *first.inputs[1:]])
        conv = replace(fused.get(conv.node, conv), channels=channels)
        fused[conv.node] = replace(conv, run=_fused_conv_kernel(conv, *epilogue))
        gone.update((back.node, swap.node, split.node))
    return [fused.get(s.node, s) for s in steps if s.node not in gone]


# ---- convs that write their channels of a concatenation (run_lowered) ----------------------
# A concat along channels of conv results that nothing else reads (SqueezeNet's fire modules,
# Inception's branches) copies every one of them once more: each conv writes its channels of
# the concatenation instead (conv2d's `into`). The first conv to run allocates the result, each
# later one takes it as an extra operand and adds its channels, and the last one's value is the
# concat's. The same sums and epilogue, stored elsewhere: the same bits.

def _fuse_concats(steps: list[Step], outputs: list[int]) -> list[Step]:
    position = {s.output: i for i, s in enumerate(steps)}
    readers, kept = _readers(steps), set(outputs)
    fused: dict[int, Step] = {}
    gone: set[int] = set()
    for cat in steps:
        t = cat.out_type
        if cat.op != "mp.concat" or t.rank != 4 or cat.attrs["axis"] % 4 != 1 \
                or len(set(cat.inputs)) != len(cat.inputs):
            continue
        convs = [steps[position[i]] if i in position else None for i in cat.inputs]
        if not all(c is not None and _writes_into(c) and c.out_type.elem == t.elem
                   and readers.get(c.output) == 1 and c.output not in kept
                   and c.node not in fused for c in convs):
            continue
        offsets = np.cumsum([0] + [c.out_type.shape[1] for c in convs])[:-1]
        order = sorted(range(len(convs)), key=lambda j: position[convs[j].output])
        previous = None
        for j in order:
            conv, first = convs[j], previous is None
            concat = (int(offsets[j]), t.shape, first, j == order[-1])
            new = replace(conv, run=_fused_conv_kernel(conv, *_rebuildable(conv), concat),
                          inputs=conv.inputs if first else [*conv.inputs, previous.output],
                          concat=concat)
            if j == order[-1]:
                new = replace(new, name=cat.name, output=cat.output, out_type=t)
            fused[conv.node] = previous = new
        gone.add(cat.node)
    return [fused.get(s.node, s) for s in steps if s.node not in gone]


# ---- an integer quantize read only by its dequantize (run_lowered) -------------------------
# A QDQ pair in front of an op that runs in float32 (the int8 plan's fallbacks: ShuffleNet's
# grouped 1x1 convs) stores the integers and reads them straight back: one pass computes the
# dequantized values instead (quant.fake_quantizer), the same float32 bits.

def _fuse_fake_quants(steps: list[Step], outputs: list[int]) -> list[Step]:
    producer = {s.output: s for s in steps}
    readers, kept = _readers(steps), set(outputs)
    fused: dict[int, Step] = {}
    gone: set[int] = set()
    for dq in steps:
        q = producer.get(dq.inputs[0]) if dq.op == "mp.dequantize" else None
        if q is None or q.op != "mp.quantize" or readers.get(q.output) != 1 \
                or q.output in kept or dq.out_type.elem != "f32" \
                or q.attrs["block_size"] or dq.attrs["block_size"]:
            continue
        scale, zp = (attr_array(q.attrs[a]) for a in ("scale", "zero_point"))
        axis = q.attrs["axis"] if scale.size > 1 else None
        if not np.array_equal(scale, attr_array(dq.attrs["scale"])) \
                or not np.array_equal(zp, attr_array(dq.attrs["zero_point"])) \
                or axis is not None and axis % q.out_type.rank != dq.attrs["axis"] % q.out_type.rank \
                or (run := fake_quantizer(q.in_types[0].shape, scale.astype(np.float32), zp,
                                          q.out_type.elem, axis)) is None:
            continue
        conv = producer.get(q.inputs[0])
        channels = q.in_types[0].shape[1] if q.in_types[0].rank == 4 else 0
        if conv is not None and _requantizable(conv) and readers.get(conv.output) == 1 \
                and conv.output not in kept and (axis is None or axis % 4 == 1):
            # The depthwise conv that computes q's operand quantizes and dequantizes each
            # output as it stores it: one pass fewer again.
            per_channel = (np.broadcast_to(scale.astype(np.float32).reshape(-1), (channels,)),
                           np.broadcast_to(zp.reshape(-1), (channels,)), q.out_type.elem)
            # epilogue=None: no later fusion rebuilds it without the requantize.
            fused[conv.node] = replace(conv, name=dq.name, output=dq.output,
                                       out_type=dq.out_type, epilogue=None, run=_fused_conv_kernel(
                                           conv, *_rebuildable(conv), requantize=per_channel))
            gone.update((q.node, dq.node))
            continue
        fused[q.node] = replace(q, name=dq.name, output=dq.output, out_type=dq.out_type,
                                run=lambda xs, run=run: (run(f32(xs[0])), None))
        gone.add(dq.node)
    return [fused.get(s.node, s) for s in steps if s.node not in gone]


def _requantizable(conv: Step) -> bool:
    """Whether a conv step is a depthwise conv whose kernel (numerics.depthwise) can also
    quantize and dequantize its float32 result as it stores it (`depthwise_conv2d`'s
    `requantize`): float operands, or 8-bit integers with a dequantize epilogue."""
    if conv.op != "mp.conv2d" or conv.concat is not None or conv.out_type.elem != "f32" \
            or (epilogue := _rebuildable(conv)) is None or epilogue[3] is not None:
        return False
    x_t, w_t = conv.in_types[:2]
    if x_t.rank != 4 or conv.attrs["groups"] != x_t.shape[1] or w_t.shape[1] != 1:
        return False
    ints = [FORMATS[t.elem].is_int for t in (x_t, w_t)]
    return not any(ints) or all(ints) and epilogue[0] is not None \
        and all(FORMATS[t.elem].bits == 8 for t in (x_t, w_t))


# ---- a conv's float32 result read only by its quantize (run_lowered) -----------------------
# A static int8 plan quantizes each activation for the next integer conv: the conv stores its
# float32 result, and the quantize reads it back from memory for a second pass and writes the
# integers. The implicit GEMM quantizes each tile instead, as it stores it (conv2d's
# `quantize`: quant._quantize_one on the same float32 values, the same integers), so the
# result is read back from L1, and the step and its pass are gone.

def _fuse_quantized_outputs(steps: list[Step], outputs: list[int]) -> list[Step]:
    only_user = _only_user_of(steps, outputs)
    fused: dict[int, Step] = {}
    gone: set[int] = set()
    producer = {s.output: s for s in steps}
    for q in steps:
        # A residual add + relu whose result the next block's conv reads quantized and the
        # next residual add reads as it is: the add_relu pass quantizes it as well, and the
        # quantize step takes its integers from the box (two passes fewer over the result).
        p = producer.get(q.inputs[0]) if q.op == "mp.quantize" and q.inputs else None
        if p is None or p.op != "mp.add_relu" or p.amax_kernel is None or p.node in fused \
                or p.out_type.elem != "f32" or q.attrs["block_size"] \
                or (quantize := _per_tensor_8bit(q)) is None:
            continue
        box = threading.local()
        fused[p.node] = replace(p, run=add_relu_kernel(None, box, quantize))
        fused[q.node] = replace(q, run=lambda xs, box=box: (box.q, None))
    steps = [fused.get(s.node, s) for s in steps]
    for conv in steps:
        if conv.op != "mp.conv2d" or conv.concat is not None or conv.out_type.elem != "f32" \
                or (epilogue := _rebuildable(conv)) is None or epilogue[3] is not None \
                or (q := only_user(conv, "mp.quantize")) is None or q.attrs["block_size"]:
            continue
        quantize = _per_tensor_8bit(q)
        if quantize is None:
            continue
        # epilogue=None: no later fusion rebuilds it without the quantize.
        fused[conv.node] = replace(conv, name=q.name, output=q.output, out_type=q.out_type,
                                   epilogue=None, run=_fused_conv_kernel(
                                       conv, *epilogue, quantize=quantize))
        gone.add(q.node)
    return [fused.get(s.node, s) for s in steps if s.node not in gone]


def _per_tensor_8bit(q: Step) -> tuple | None:
    """(scale, zero point, format) of a per-tensor quantize to an 8-bit integer format, else
    None."""
    f = FORMATS[q.out_type.elem]
    scale, zp = (attr_array(q.attrs[a]) for a in ("scale", "zero_point"))
    if not f.is_int or f.bits != 8 or scale.size != 1 or zp.size != 1 \
            or not f.min_value <= zp.reshape(()) <= f.max_finite:
        return None
    return scale.astype(np.float32).reshape(()), zp.reshape(()), q.out_type.elem


# ---- the amax a scaled_quant reads, taken by the step that computes its operand -----------
# A per-tensor mp.scaled_quant (an fp8 plan's current scaling) reads its whole operand once for
# its amax before it rounds. Where the operand comes from a conv or a residual add + relu, that
# kernel takes the amax as it stores each output (conv2d's and add_relu's `amax`) and leaves it
# in a box the scaled_quant reads instead: the same value (max is exact in any order), one pass
# over the tensor fewer. The box is per thread, as each run_lowered runs its steps in turn.
# Knowing the amax also lets the rounding skip NaN and infinity handling where there are none,
# and where the scaled_quant is the operand's only reader it writes over the operand: on
# ShuffleNet batch 8, fp8 went from 1.38x to 1.17-1.24x of fp32 (docs/benchmarks.md).

def _fuse_amax(steps: list[Step], outputs: list[int]) -> list[Step]:
    producer = {s.output: s for s in steps}
    readers, kept = _readers(steps), set(outputs)
    fused: dict[int, Step] = {}
    for sq in steps:
        if sq.op != "mp.scaled_quant" or sq.attrs["recipe"] not in ("current", "static"):
            continue
        p = producer.get(sq.inputs[0])
        if p is None or p.node in fused or p.out_type.elem != "f32":
            continue
        box = threading.local()
        if p.amax_kernel is not None:
            run = p.amax_kernel(box)
        elif p.op == "mp.conv2d" and p.concat is None and (epilogue := _rebuildable(p)):
            run = _fused_conv_kernel(p, *epilogue, box=box)
        else:
            continue
        fused[p.node] = replace(p, run=run, amax_kernel=None)  # taken: box.amax is set
        # The conv or add has just allocated its result: where the scaled_quant is its only
        # reader, the scaled values can take its place.
        alone = readers.get(p.output) == 1 and p.output not in kept
        # run_lowered keeps no counts: the rounding takes none (scale_round's `counted`).
        fused[sq.node] = replace(sq, run=scaled_quant_kernel(
            sq.attrs, sq.out_type, amax_of=lambda box=box: box.amax, overwrite=alone,
            counted=False)[0])
    return [fused.get(s.node, s) for s in steps]


def _writes_into(conv: Step) -> bool:
    """Whether a conv step's kernel can write its result into a concatenation: one group of
    at least a register tile of output channels on the implicit GEMM, float32 sums or an
    integer conv with its dequantize, rebuilt by `_fused_conv_kernel`."""
    epilogue = _rebuildable(conv)
    return conv.op == "mp.conv2d" and conv.attrs["groups"] == 1 \
        and conv.in_types[1].shape[0] >= TILE_ROWS and epilogue is not None \
        and (epilogue[0] is None or conv.executed["accum"] == "i32")


def _dequantize_scale(dq: Step, channels: int, axis: int = 1) -> np.ndarray | None:
    """The per-channel float32 scale of an f32 dequantize of an i32 result whose channels
    lie along `axis` (a conv's: 1; a matmul's output columns: -1): a scalar or one per
    channel of that axis, zero point 0, no blocks; else None."""
    scale = attr_array(dq.attrs["scale"]).astype(np.float32)
    zp = attr_array(dq.attrs["zero_point"])
    rank = len(dq.in_types[0].shape)
    if dq.out_type.elem != "f32" or np.any(zp != 0) or dq.attrs.get("block_size"):
        return None
    if scale.size == 1:
        return np.full(channels, scale.reshape(()), np.float32)
    if dq.attrs["axis"] % rank != axis % rank or scale.size != channels:
        return None
    return scale.reshape(-1)


def _channel_bias(value: Any, add: Step, channels: int) -> np.ndarray | None:
    """A float32 constant that adds one value per channel of an NCHW result, as a vector."""
    if not isinstance(value, np.ndarray) or value.dtype != np.float32 \
            or add.out_type.elem != "f32" or value.ndim > 4:
        return None
    shape = (1,) * (4 - value.ndim) + value.shape
    if shape[0] != 1 or shape[2:] != (1, 1) or shape[1] not in (1, channels):
        return None
    return np.ascontiguousarray(np.broadcast_to(value.reshape(-1), (channels,)))


def _fused_conv_kernel(conv: Step, scale: np.ndarray | None, bias: np.ndarray | None,
                       relu: bool, rounded: str | None,
                       concat: tuple[int, tuple[int, ...], bool, bool] | None = None,
                       box: Any = None, requantize: tuple | None = None,
                       quantize: tuple | None = None) -> Kernel:
    """The conv with its fused epilogue, reading its input channels in `conv.channels` order.
    `concat` = (channel0, shape, first, last) writes the result into channels channel0.. of a
    concatenation of `shape` (_fuse_concats): the `first` conv allocates it, the others take
    it as their last operand, and each rounds its own channels as it stores them.
    With a `box` (_fuse_amax, no concat), box.amax is set to the result's amax, which the
    conv kernels take as they store it; with `requantize` (_fuse_fake_quants, a depthwise
    conv) the result is quantized and dequantized as it is stored; with `quantize`
    (_fuse_quantized_outputs) it is quantized, and the integers are the result."""
    from mplower.numerics.conv import conv2d

    a, channels, operands = conv.attrs, conv.channels, len(conv.inputs)
    geometry = (a["strides"], a["padding"], a["dilations"], a["groups"])

    def run(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
        x, w, into = xs[0], xs[1], None
        if concat is not None:
            into = (np.empty(concat[1], np.float32) if concat[2] else xs[-1], concat[0])
        found = None if box is None else []
        if scale is None:  # a float conv: its own bias operand or the added one, the relu
            b = f32(xs[2]) if operands == 3 else bias
            # The rounding too as the conv stores its tiles (conv2d's rounding: round_to's
            # kernel, the same bits; run_lowered keeps no counts), of its own channels where
            # it writes into a concatenation.
            y = conv2d(f32(x), f32(w), *geometry, bias=b, relu=relu, channels=channels,
                       into=into, rounding=rounded, amax=found, requantize=requantize,
                       quantize=quantize)
        else:
            y = conv2d(x, w, *geometry, scale=scale, bias=bias, relu=relu, channels=channels,
                       into=into, amax=found, requantize=requantize, quantize=quantize)
        if box is not None:
            box.amax = found[0]
        return y, None
    if scale is not None:  # an integer conv: its constant weight can be an IntegerWeights
        run.integer_weights = True  # type: ignore[attr-defined]
    return run


def fuse_steps(live: list[Step], constants: dict[int, Any], outputs: list[int]) -> list[Step]:
    """run_lowered's steps after its own fusions (`live`: the steps that are not constant;
    `constants`: the folded values by slot; `outputs`: the function's result slots)."""
    fused = _round_matmuls_in_place(_fuse_epilogues(live, constants, outputs))
    fused = _fuse_concats(_fuse_shuffles(fused, outputs), outputs)
    fused = _fuse_amax(_fuse_fake_quants(fused, outputs), outputs)
    fused = _fuse_quantized_outputs(fused, outputs)
    fused = _fuse_rounded_binaries(fused, constants, outputs)
    return pack_weights(fused, constants)
