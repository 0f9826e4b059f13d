"""ONNX import handlers: the window and mel generators, DFT and STFT.

The generators (HannWindow, HammingWindow, BlackmanWindow, MelWeightMatrix) take sizes and
frequencies that are constants in the models that use them; the importer folds such a node with
onnx's reference before it reaches a handler, so the handler here only says which input is not
a constant. DFT and STFT of a constant fold the same way; of a runtime signal they are a matmul
with a constant transform matrix, which is the linear map of numpy's FFT (as ONNX's reference
computes it) applied to each basis vector, so every variant (inverse, onesided, the inverse of
a onesided spectrum, dft_length padding or truncating) is one matrix, and the matmul takes a
precision like any other.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.types import tensor
from mplower.onnx.importer.core import Run, _attrs, _Importer, _reshape_to, handler

_GENERATOR_INPUTS = {
    "HannWindow": ("size",), "HammingWindow": ("size",), "BlackmanWindow": ("size",),
    "MelWeightMatrix": ("num_mel_bins", "dft_length", "sample_rate", "lower_edge_hertz",
                        "upper_edge_hertz"),
}


@handler(*_GENERATOR_INPUTS)
def _generator(imp: _Importer, node: onnx.NodeProto) -> list:
    for i, name in enumerate(_GENERATOR_INPUTS[node.op_type]):
        imp.const(i, f"{node.op_type}'s {name}")
    # All inputs are constants, yet folding (onnx's reference) failed on them.
    raise imp.error(f"{node.op_type} could not be computed at import from its constant inputs "
                    f"(onnx's reference evaluator rejects them)")


def _transform(n: int, c: int, length: int, inverse: bool, onesided: bool) -> np.ndarray:
    """The (n*c, K*c_out) matrix of ONNX's DFT along one axis of n points with c components
    (1 real, 2 complex), as numpy's FFT computes it in float64."""
    basis = np.eye(n * c).reshape(n * c, n, c)
    signal = basis[..., 0] if c == 1 else basis[..., 0] + 1j * basis[..., 1]
    if inverse and onesided:
        out = np.fft.irfft(signal, n=length, axis=1)[..., None]
    elif inverse:
        out = np.fft.ifft(signal, n=length, axis=1)
    else:
        out = np.fft.fft(signal, n=length, axis=1)
        if onesided:
            out = out[:, :length // 2 + 1]
    if np.iscomplexobj(out):
        out = np.stack([out.real, out.imag], axis=-1)
    return out.reshape(n * c, -1)


def _apply(imp: _Importer, x: Run, axis: int, matrix: np.ndarray, components: int,
           hint: str) -> Run:
    """x with its `axis` (and its last, component axis) replaced by x @ matrix."""
    rank = x.type.rank
    perm = [k for k in range(rank - 1) if k != axis] + [axis, rank - 1]
    moved = x
    if perm != list(range(rank)):
        moved = imp.emit("mp.transpose", [x], {"perm": tuple(perm)}, onnx_type=x.onnx_type)
    lead = moved.type.shape[:-2]
    flat = _reshape_to(imp, moved, (*lead, moved.type.shape[-2] * moved.type.shape[-1]))
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    m = imp.constant(matrix.astype(dtype), f"{hint}_matrix")
    y = imp.emit("mp.matmul", [flat, m], hint=hint, onnx_type=x.onnx_type)
    y = _reshape_to(imp, y, (*lead, matrix.shape[1] // components, components))
    if perm == list(range(rank)):
        return y
    back = [0] * rank
    for i, p in enumerate(perm):
        back[p] = i
    return imp.emit("mp.transpose", [y], {"perm": tuple(back)}, onnx_type=x.onnx_type)


def _one_int(imp: _Importer, i: int, what: str) -> int | None:
    v = imp.const(i, what)
    if v is None:
        return None
    v = np.asarray(v)
    if v.size != 1:
        raise imp.error(f"{what} must be one value, got shape {list(v.shape)}")
    return int(v.reshape(-1)[0])


def _signal(imp: _Importer, what: str) -> Run:
    x = imp.run_input(0)
    if x.type.rank < 2 or x.type.shape[-1] not in (1, 2) or x.type.elem[0] not in "fb":
        raise imp.error(f"{what} must be a float tensor whose last axis (size 1 real or 2 "
                        f"complex) holds the components, got {x.type}")
    return x


@handler("DFT")
def _dft(imp: _Importer, node: onnx.NodeProto) -> list:
    x = _signal(imp, "DFT's input")
    a = _attrs(node)
    rank = x.type.rank
    if imp.opset >= 20:
        axis = _one_int(imp, 2, "DFT's axis")
        axis = -2 if axis is None else axis
    else:
        axis = int(a.get("axis", 1))
    if not -rank <= axis < rank or axis % rank == rank - 1:
        raise imp.error(f"axis {axis} must name a signal axis of {x.type} (not the last, "
                        f"component axis)")
    axis %= rank
    inverse, onesided = bool(a.get("inverse", 0)), bool(a.get("onesided", 0))
    n, c = x.type.shape[axis], x.type.shape[-1]
    length = _one_int(imp, 1, "DFT's dft_length")
    if length is None:
        length = 2 * (n - 1) if inverse and onesided else n
    if length < 1 or (onesided and not inverse and c != 1):
        raise imp.error(f"dft_length {length} must be >= 1, and a onesided DFT needs a real "
                        f"input (last axis 1), got {x.type}")
    matrix = _transform(n, c, length, inverse, onesided)
    return [_apply(imp, x, axis, matrix, 1 if inverse and onesided else 2, "dft")]


@handler("STFT")
def _stft(imp: _Importer, node: onnx.NodeProto) -> list:
    x = _signal(imp, "STFT's signal")
    if x.type.rank != 3:
        raise imp.error(f"STFT's signal must be [batch, length, 1 or 2], got {x.type}")
    batch, total, c = x.type.shape
    step = _one_int(imp, 1, "STFT's frame_step")
    window = imp.input(2)
    frame = _one_int(imp, 3, "STFT's frame_length")
    if frame is None:
        frame = total if window is None else window.array.shape[0] \
            if not isinstance(window, Run) else window.type.shape[0]
    onesided = bool(_attrs(node).get("onesided", 1))
    if step is None or step < 1 or not 1 <= frame <= total or (onesided and c != 1):
        raise imp.error(f"frame_step {step} must be >= 1 and frame_length {frame} in "
                        f"[1, {total}]; a onesided STFT needs a real signal (last axis 1), "
                        f"got {x.type}")
    frames = 1 + (total - frame) // step
    index = np.arange(frames)[:, None] * step + np.arange(frame)[None, :]
    picked = imp.emit("mp.gather", [x, imp.constant(index.astype(np.int64), "frame_index")],
                      {"axis": 1}, hint="frames", onnx_type=x.onnx_type)
    if window is not None:
        w = imp.run_input(2)
        if w.type.shape != (frame,):
            raise imp.error(f"window {w.type} must hold frame_length ({frame}) values")
        w = _reshape_to(imp, w, (1, 1, frame, 1))
        picked = imp.emit("mp.mul", [picked, w], hint="windowed", onnx_type=x.onnx_type)
    matrix = _transform(frame, c, frame, False, onesided)
    flat = _reshape_to(imp, picked, (batch, frames, frame * c))
    dtype = helper.tensor_dtype_to_np_dtype(x.onnx_type)
    m = imp.constant(matrix.astype(dtype), "stft_matrix")
    y = imp.emit("mp.matmul", [flat, m], hint="stft", onnx_type=x.onnx_type)
    bins = matrix.shape[1] // 2
    return [imp.emit("mp.reshape", [y], declared=tensor((batch, frames, bins, 2), y.type.elem),
                     onnx_type=x.onnx_type)]

