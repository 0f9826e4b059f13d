"""What `Program.run_lowered` (and so `mplower bench`) decides on its own: which kernel each op
runs on and where its result is stored, never which ops run.

The program is the module as the pipeline printed it: fusion is the `fuse` pass's
(passes/fuse.py), whose fused ops run here as in `run`. What run_lowered adds, each giving the
bits `run` gives:

- each op's uncounted kernel where it has one (`Chosen.fast`: a bf16/fp16 conv, matmul, add,
  sub or mul rounding its result as it computes it, a fake_quant in one pass), since
  run_lowered reports no counts;
- constant weights converted and packed once (`pack_weights`);
- buffer assignment: convs whose results only a channel concatenation reads write into their
  channels of its buffer, and the concat, which still runs, finds its result there
  (`_concats_in_place`);
- a value passed beside a result: a per-tensor mp.scaled_quant reads the amax that the conv or
  add_relu computing its operand took as it stored it (`_amax_shared`), and a quantize of an
  add_relu's result the integers that kernel made in the same pass (`_quantize_shared`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np

from mplower.backend.fused import ConvEpilogue
from mplower.backend.kernels import NO_COUNTS, Kernel, add_relu_kernel
from mplower.backend.scaled import ScaleStats, scaled_quant_kernel
from mplower.ir.diagnostics import Location
from mplower.ir.opdef import attr_array
from mplower.ir.types import TensorType
from mplower.numerics.conv import IntegerWeights
from mplower.numerics.formats import FORMATS
from mplower.numerics.gemm import TILE_ROWS, PackedMatrix
from mplower.numerics.rounding import Counts

CONVS = ("mp.conv2d", "mp.fused_conv2d")


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
    # This step's kernel, built to also leave the amax of its result in a box (_amax_shared).
    amax_kernel: Callable[[Any], Kernel] | None = None
    # The op's uncounted kernel, which run_lowered runs (Chosen.fast), and a conv's epilogue,
    # from which its kernel is rebuilt (mplower.backend.fused.ConvEpilogue).
    fast: Kernel | None = None
    conv: ConvEpilogue | None = None

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
        elif s.op in CONVS and getattr(s.run, "integer_weights", False) \
                and isinstance(w, np.ndarray) and w.ndim == 4 and w.dtype.kind in "iu":
            s = replace(s, run=partial(_with_weight, s.run, IntegerWeights(w)))
        out.append(s)
    return out


def _with_weight(run: Kernel, weight: PackedMatrix | IntegerWeights,
                 xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
    return run([xs[0], weight, *xs[2:]])


def _readers(steps: list[Step]) -> dict[int, int]:
    """How many steps read each slot."""
    readers: dict[int, int] = {}
    for s in steps:
        for i in s.inputs:
            readers[i] = readers.get(i, 0) + 1
    return readers


# ---- convs written into their concatenation (buffer assignment) ------------------------------
# A concat along channels of conv results that nothing else reads (SqueezeNet's fire modules,
# Inception's branches) would copy every one of them once more: each conv writes its channels
# of the concatenation instead (conv2d's `into`). The first conv to run allocates it, each
# later one takes it as an extra operand and adds its channels; every conv's slot then holds
# the whole buffer, which the concat step returns. The same sums and epilogue, stored
# elsewhere: the same bits, and the same ops.

def _writes_into(conv: Step) -> bool:
    """Whether a conv step's kernel can write its result into a concatenation: one group of
    at least a register tile of output channels on the implicit GEMM, its result the conv's
    (neither quantized nor requantized)."""
    return conv.op in CONVS and conv.conv is not None and conv.conv.plain \
        and conv.attrs["groups"] == 1 and conv.in_types[1].shape[0] >= TILE_ROWS


def _concats_in_place(steps: list[Step], outputs: list[int]) -> tuple[list[Step], set[int]]:
    """The steps with the convs of such concats writing into them; the nodes of those convs."""
    position = {s.output: i for i, s in enumerate(steps)}
    readers, kept = _readers(steps), set(outputs)
    out, writing = list(steps), set()
    for cat in steps:
        t = cat.out_type
        if cat.op != "mp.concat" or t.rank != 4 or cat.attrs["axis"] % 4 != 1 \
                or len(set(cat.inputs)) != len(cat.inputs):
            continue
        convs = [steps[position[i]] if i in position else None for i in cat.inputs]
        if not all(c is not None and _writes_into(c) and c.out_type.elem == t.elem
                   and readers.get(c.output) == 1 and c.output not in kept
                   and c.node not in writing for c in convs):
            continue
        offsets = np.cumsum([0] + [c.out_type.shape[1] for c in convs])[:-1]
        previous = None
        for j in sorted(range(len(convs)), key=lambda j: position[convs[j].output]):
            conv = convs[j]
            into = (int(offsets[j]), t.shape, previous is None)
            previous = out[position[conv.output]] = replace(
                conv, run=conv.conv.kernel(into=into),
                inputs=conv.inputs if previous is None else [*conv.inputs, previous.output])
            writing.add(conv.node)
        out[position[cat.output]] = replace(cat, run=_written)
    return out, writing


def _written(xs: list[np.ndarray]) -> tuple[np.ndarray, Counts | None]:
    """A concat whose operands wrote into its buffer: each operand's slot holds it."""
    return xs[0], None


# ---- the amax a scaled_quant reads, taken by the step that computes its operand -----------
# A per-tensor mp.scaled_quant (an fp8 plan's current scaling) reads its whole operand once for
# its amax before it rounds. Where the operand comes from a conv or an add_relu, that kernel
# takes the amax as it stores each output (conv2d's and add_relu's `amax`) and leaves it in a
# box the scaled_quant reads instead: the same value (max is exact in any order), one pass over
# the tensor fewer. The box is per thread, as each run_lowered runs its steps in turn. Knowing
# the amax also lets the rounding skip NaN and infinity handling where there are none, and
# where the scaled_quant is the operand's only reader it writes over the operand.

def _amax_shared(steps: list[Step], outputs: list[int], writing: set[int]) -> list[Step]:
    producer = {s.output: s for s in steps}
    readers, kept = _readers(steps), set(outputs)
    shared: dict[int, Step] = {}
    for sq in steps:
        if sq.op != "mp.scaled_quant" or sq.attrs["recipe"] not in ("current", "static"):
            continue
        p = producer.get(sq.inputs[0])
        if p is None or p.node in shared or p.out_type.elem != "f32":
            continue
        box = threading.local()
        if p.amax_kernel is not None:
            run = p.amax_kernel(box)
        elif p.conv is not None and p.conv.plain and p.node not in writing:
            run = p.conv.kernel(box=box)
        else:
            continue
        shared[p.node] = replace(p, run=run, amax_kernel=None)  # taken: box.amax is set
        # The conv or add has just allocated its result: where the scaled_quant is its only
        # reader, the scaled values can take its place.
        alone = readers.get(p.output) == 1 and p.output not in kept
        # run_lowered keeps no counts: the rounding takes none (scale_round's `counted`).
        shared[sq.node] = replace(sq, run=scaled_quant_kernel(
            sq.attrs, sq.out_type, amax_of=lambda box=box: box.amax, overwrite=alone,
            counted=False)[0])
    return [shared.get(s.node, s) for s in steps]


# ---- a quantize of an add_relu's result, made by the add_relu --------------------------------
# A residual add + relu whose result the next block's conv reads quantized and the next
# residual add reads as it is: the add_relu quantizes it too in its one pass, and the quantize
# step takes its integers from the box (two passes fewer over the result).

def _quantize_shared(steps: list[Step]) -> list[Step]:
    producer = {s.output: s for s in steps}
    shared: dict[int, Step] = {}
    for q in steps:
        p = producer.get(q.inputs[0]) if q.op == "mp.quantize" and q.inputs else None
        if p is None or p.op != "mp.add_relu" or p.amax_kernel is None or p.node in shared \
                or p.out_type.elem != "f32" or q.attrs["block_size"] \
                or (quantize := _per_tensor_8bit(q)) is None:
            continue
        box = threading.local()
        shared[p.node] = replace(p, run=add_relu_kernel(None, box, quantize))
        shared[q.node] = replace(q, run=lambda xs, box=box: (box.q, None))
    return [shared.get(s.node, s) for s in steps]


def _per_tensor_8bit(q: Step) -> tuple | None:
    """(scale, zero point, format) of a per-tensor quantize to an 8-bit integer format, else
    None."""
    f = FORMATS[q.out_type.elem]
    scale, zp = (attr_array(q.attrs[a]) for a in ("scale", "zero_point"))
    if not f.is_int or f.bits != 8 or scale.size != 1 or zp.size != 1 \
            or not f.min_value <= zp.reshape(()) <= f.max_finite:
        return None
    return scale.astype(np.float32).reshape(()), zp.reshape(()), q.out_type.elem


def lowered_steps(live: list[Step], constants: dict[int, Any], outputs: list[int]) -> list[Step]:
    """The steps run_lowered runs (`live`: the steps that are not constant; `constants`: the
    folded values by slot; `outputs`: the function's result slots): the same ops, on their
    uncounted kernels, with the buffers and values shared as above."""
    steps = [replace(s, run=s.fast) if s.fast is not None else s for s in live]
    steps, writing = _concats_in_place(steps, outputs)
    steps = _quantize_shared(_amax_shared(steps, outputs, writing))
    return pack_weights(steps, constants)
