"""ONNX import handlers: Tile, DepthToSpace, SpaceToDepth, OneHot, Compress, Einsum and the
scatters.

Most of these are exact rearrangements or comparisons, written at import as the mp ops the
passes already understand (reshape, expand, transpose, gather, equal, where, matmul,
reduce_sum), so they need no op of their own; only the scatters are ops (mp.scatter_elements,
mp.scatter_nd). What needs a runtime value where the IR carries an attribute (Tile's repeats,
OneHot's depth, Compress's condition) must be a constant. Einsum becomes transposes,
diagonals (gathers), sums and one matmul per pair of operands; an equation whose letters
broadcast (one letter, two sizes) or whose operands no matmul takes is refused, located.
"""

from __future__ import annotations

import math
import re
import string

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.types import tensor
from mplower.onnx.importer.core import (
    Run,
    _attrs,
    _Importer,
    _reshape_to,
    handler,
)


def _transpose(imp: _Importer, x: Run, perm: tuple[int, ...]) -> Run:
    if perm == tuple(range(len(perm))):
        return x
    return imp.emit("mp.transpose", [x], {"perm": perm}, onnx_type=x.onnx_type)


# ---- Tile, DepthToSpace, SpaceToDepth: reshape, expand or transpose, reshape --------------------


@handler("Tile")
def _tile(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    reps = [int(r) for r in np.asarray(imp.const(1, "Tile's repeats")).reshape(-1)]
    shape = x.type.shape
    if len(reps) != len(shape) or any(r < 0 for r in reps):
        raise imp.error(f"repeats {reps} must give one count >= 0 per dimension of {x.type}")
    # (d0, d1) tiled (r0, r1) is (1, d0, 1, d1) broadcast to (r0, d0, r1, d1), read as
    # (r0 * d0, r1 * d1): numpy's tile order, and nothing computed.
    spread = _reshape_to(imp, x, [v for d in shape for v in (1, d)])
    big = tensor(tuple(v for r, d in zip(reps, shape) for v in (r, d)), x.type.elem)
    if big.shape != spread.type.shape:
        spread = imp.emit("mp.expand", [spread], declared=big, onnx_type=x.onnx_type)
    return [_reshape_to(imp, spread, [r * d for r, d in zip(reps, shape)])]


def _blocks(imp: _Importer, node: onnx.NodeProto, x: Run) -> int:
    if x.type.rank != 4:
        raise imp.error(f"{node.op_type} takes a rank-4 NCHW tensor, got {x.type}")
    b = int(_attrs(node)["blocksize"])
    if b < 1:
        raise imp.error(f"blocksize {b} must be >= 1")
    return b


@handler("DepthToSpace")
def _depth_to_space(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    b = _blocks(imp, node, x)
    n, c, h, w = x.type.shape
    if c % (b * b):
        raise imp.error(f"channels {c} are not a multiple of blocksize^2 = {b * b}")
    mode = _attrs(node).get("mode", "DCR")
    if mode == "DCR":
        parts, perm = (n, b, b, c // (b * b), h, w), (0, 3, 4, 1, 5, 2)
    elif mode == "CRD":
        parts, perm = (n, c // (b * b), b, b, h, w), (0, 1, 4, 2, 5, 3)
    else:
        raise imp.error(f"mode '{mode}' is not DCR or CRD")
    y = _transpose(imp, _reshape_to(imp, x, parts), perm)
    return [_reshape_to(imp, y, (n, c // (b * b), h * b, w * b))]


@handler("SpaceToDepth")
def _space_to_depth(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    b = _blocks(imp, node, x)
    n, c, h, w = x.type.shape
    if h % b or w % b:
        raise imp.error(f"height {h} and width {w} must be multiples of blocksize {b}")
    # Opset 28 adds DepthToSpace's two channel orders; before it, DCR.
    mode = _attrs(node).get("mode", "DCR")
    if mode not in ("DCR", "CRD"):
        raise imp.error(f"mode '{mode}' is not DCR or CRD")
    y = _reshape_to(imp, x, (n, c, h // b, b, w // b, b))
    y = _transpose(imp, y, (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4))
    return [_reshape_to(imp, y, (n, c * b * b, h // b, w // b))]


# ---- OneHot and Compress ------------------------------------------------------------------------


@handler("OneHot")
def _one_hot(imp: _Importer, node: onnx.NodeProto) -> list:
    idx = imp.run_input(0)
    depth = np.asarray(imp.const(1, "OneHot's depth")).reshape(-1)
    values = np.asarray(imp.const(2, "OneHot's values (off, on)")).reshape(-1)
    if depth.size != 1 or values.size != 2:
        raise imp.error(f"depth must be one number and values two (off, on), got "
                        f"{depth.size} and {values.size}")
    d = int(depth[0])
    if d < 1:
        raise imp.error(f"depth {d} must be >= 1")
    rank = idx.type.rank + 1
    axis = int(_attrs(node).get("axis", -1))
    if not -rank <= axis < rank:
        raise imp.error(f"axis {axis} is out of range for a result of rank {rank}")
    axis %= rank
    # Negative indices count from the end; any index outside [-depth, depth) matches no
    # position and its row is all `off`, as ONNX says.
    dtype = helper.tensor_dtype_to_np_dtype(idx.onnx_type)
    positions = np.arange(d).astype(dtype).reshape((d,) + (1,) * (rank - 1 - axis))
    zero = imp.constant(np.zeros((), dtype), "zero")
    negative = imp.emit("mp.less", [idx, zero])
    wrapped = imp.emit("mp.where", [negative, imp.emit(
        "mp.add", [idx, imp.constant(np.array(d, dtype), "depth")]), idx])
    at = _reshape_to(imp, wrapped, idx.type.shape[:axis] + (1,) + idx.type.shape[axis:])
    hit = imp.emit("mp.equal", [at, imp.constant(positions, "positions")])
    off, on = (imp.constant(v, n) for v, n in ((values[:1].reshape(()), "off"),
                                               (values[1:].reshape(()), "on")))
    return [imp.emit("mp.where", [hit, on, off], onnx_type=off.onnx_type)]


@handler("Compress")
def _compress(imp: _Importer, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    cond = np.asarray(imp.const(1, "Compress's condition (its count sets the result's shape)"))
    axis = _attrs(node).get("axis")
    if axis is None:
        x = _reshape_to(imp, x, (x.type.size,))
        axis = 0
    if not -x.type.rank <= axis < x.type.rank:
        raise imp.error(f"axis {axis} is out of range for {x.type}")
    axis %= x.type.rank
    if cond.ndim != 1 or cond.size > x.type.shape[axis]:
        raise imp.error(f"condition of shape {list(cond.shape)} must be 1-D and no longer than "
                        f"dimension {axis} of {x.type} ({x.type.shape[axis]})")
    picked = imp.constant(np.flatnonzero(cond.astype(bool)).astype(np.int64), "picked")
    return [imp.emit("mp.gather", [x, picked], {"axis": axis}, onnx_type=x.onnx_type)]


# ---- Scatters ----------------------------------------------------------------------------------


@handler("ScatterElements", "ScatterND", "Scatter")
def _scatter(imp: _Importer, node: onnx.NodeProto) -> list:
    data, idx, updates = (imp.run_input(i) for i in range(3))
    a = _attrs(node)
    attrs = {"reduction": a.get("reduction", "none")}
    if node.op_type == "ScatterND":
        return [imp.emit("mp.scatter_nd", [data, idx, updates], attrs, onnx_type=data.onnx_type)]
    attrs["axis"] = int(a.get("axis", 0))
    return [imp.emit("mp.scatter_elements", [data, idx, updates], attrs,
                     onnx_type=data.onnx_type)]


# ---- Einsum --------------------------------------------------------------------------------------


def _einsum_terms(imp: _Importer, equation: str, ranks: list[int]) -> tuple[list[str], str]:
    """The letters of each operand and of the result, `...` spelled out as fresh capitals."""
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise imp.error(f"equation '{equation}' names {len(terms)} operands, the node has "
                        f"{len(ranks)}")
    spare = [c for c in string.ascii_uppercase if c not in eq]
    ell = ""
    letters = []
    for t, r in zip(terms, ranks):
        if not re.fullmatch(r"[a-zA-Z]*(\.\.\.)?[a-zA-Z]*", t):
            raise imp.error(f"equation '{equation}': term '{t}' is not letters with at most "
                            f"one '...'")
        n = r - (len(t) - 3 if "..." in t else len(t))
        if n < 0 or (n and "..." not in t):
            raise imp.error(f"equation '{equation}': term '{t}' does not fit an operand of "
                            f"rank {r}")
        if "..." in t:
            if len(ell) < n:
                ell = "".join(spare[:n])
            t = t.replace("...", ell[len(ell) - n:])
        letters.append(t)
    if not arrow:  # implicit form: the letters used once, in alphabetical order
        seen = "".join(letters)
        out = ell + "".join(sorted(c for c in set(seen) - set(ell) if seen.count(c) == 1))
    else:
        out = out.replace("...", ell)
    return letters, out


def _sum_out(imp: _Importer, x: Run, have: str, keep: set[str]) -> tuple[Run, str]:
    gone = tuple(k for k, c in enumerate(have) if c not in keep)
    if not gone:
        return x, have
    y = imp.emit("mp.reduce_sum", [x], {"axes": gone, "keepdims": False})
    return y, "".join(c for c in have if c in keep)


@handler("Einsum")
def _einsum(imp: _Importer, node: onnx.NodeProto) -> list:
    """Operands taken pairwise, left to right: shared letters still needed later are batch
    dimensions, shared letters no longer needed are contracted (one matmul), and letters of
    one operand alone that nothing needs are summed first."""
    xs = [imp.run_input(i) for i in range(len(node.input))]
    equation = str(_attrs(node)["equation"])
    terms, out = _einsum_terms(imp, equation, [x.type.rank for x in xs])
    size: dict[str, int] = {}
    for t, x in zip(terms, xs):
        for c, d in zip(t, x.type.shape):
            if size.setdefault(c, d) != d:
                what = f"letter '{c}'" if c in equation else "'...'"  # '...' became capitals
                raise imp.error(f"equation '{equation}': {what} stands for dimensions "
                                f"{size[c]} and {d} (mplower does not broadcast them)")
    if set(out) - set(size):
        raise imp.error(f"equation '{equation}': the result names a letter no operand has")
    for i, t in enumerate(terms):
        xs[i], terms[i] = _diagonal(imp, xs[i], t)
    acc, have = xs[0], terms[0]
    for k in range(1, len(xs) + 1):
        later = set(out).union(*terms[k:])
        acc, have = _sum_out(imp, acc, have, later)
        if k == len(xs):
            break
        b, bl = _sum_out(imp, xs[k], terms[k], later | set(have))
        acc, have = _pair(imp, acc, have, b, bl, later, size)
    perm = tuple(have.index(c) for c in out)
    return [_transpose(imp, acc, perm)]


def _diagonal(imp: _Importer, x: Run, term: str) -> tuple[Run, str]:
    """A letter repeated within a term (`ii`) reads the diagonal: the two axes moved last and
    the last one gathered at the index of the other (data movement, nothing computed)."""
    while len(set(term)) != len(term):
        c = next(c for c in term if term.count(c) > 1)
        p, q = term.index(c), term.index(c, term.index(c) + 1)
        rest = [k for k in range(len(term)) if k not in (p, q)]
        x = _transpose(imp, x, tuple(rest) + (p, q))
        n = x.type.shape[-1]
        where = np.broadcast_to(np.arange(n).reshape(n, 1), x.type.shape[:-1] + (1,))
        x = imp.emit("mp.gather_elements", [x, imp.constant(where.astype(np.int64), "diag")],
                     {"axis": x.type.rank - 1}, onnx_type=x.onnx_type)
        x = _reshape_to(imp, x, x.type.shape[:-1])
        term = "".join(term[k] for k in rest) + c
    return x, term


def _pair(imp: _Importer, a: Run, al: str, b: Run, bl: str, later: set[str],
          size: dict[str, int]) -> tuple[Run, str]:
    batch = [c for c in al if c in bl and c in later]
    inner = [c for c in al if c in bl and c not in later]
    left = [c for c in al if c not in bl]
    right = [c for c in bl if c not in al]
    m, k, n = (math.prod(size[c] for c in part) for part in (left, inner, right))
    bs = tuple(size[c] for c in batch)
    a = _transpose(imp, a, tuple(al.index(c) for c in batch + left + inner))
    b = _transpose(imp, b, tuple(bl.index(c) for c in batch + inner + right))
    a = _reshape_to(imp, a, bs + (m, k))
    b = _reshape_to(imp, b, bs + (k, n))
    y = imp.emit("mp.matmul", [a, b], declared=tensor(bs + (m, n), a.type.elem),
                 onnx_type=a.onnx_type)
    letters = "".join(batch + left + right)
    return _reshape_to(imp, y, tuple(size[c] for c in letters)), letters

