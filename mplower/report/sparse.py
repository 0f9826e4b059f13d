"""The sparse reality check: what a sparse kernel decision promises, costs and delivers.

`reality_check` puts the numbers of one matmul lowered to a sparse kernel side by side: nominal
sparsity, metadata, the modeled speedup on the target, the measured speedup of the backend's
kernels (mplower.backend.sparse) against dense BLAS here, and the conversion time.
`sparse_report` does so for every op lower-sparse decided in a function, with the dense
fallbacks and their reason codes, and `sparse_lines` renders that section under a report's
table (`mplower report`, and the run report).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mplower.dialect.mp import WEIGHTED
from mplower.dialect.plan import Plan
from mplower.io.npz import WeightStore
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import Function, Module
from mplower.ir.opdef import OPS, check_attrs
from mplower.ir.types import DenseAttr
from mplower.lowering.sparsity import (
    WEIGHT_OPERAND,
    contraction_time,
    other_bytes,
    reduction_axis,
    sparsity,
    storage,
)
from mplower.lowering.target import DENSE, NO_SPARSE_KERNEL, Target
from mplower.report.table import table


@dataclass(frozen=True)
class RealityCheck:
    """One sparse op's numbers: what the format promises, costs and delivers."""

    kernel: str
    nominal_sparsity: float  # fraction of zeros in the weight
    value_bytes: int  # stored values, in the compute format
    metadata_bytes: int  # 2-bit positions, or CSR column indices and row pointers
    dense_bytes: int  # the weight stored densely in the compute format
    metadata_overhead: float  # metadata bytes per value byte
    modeled_dense_s: float
    modeled_sparse_s: float
    modeled_speedup: float  # modeled dense time / sparse time on the target
    measured_dense_s: float | None  # numpy (BLAS) x @ W on this machine, median
    measured_sparse_s: float | None  # this module's kernel, median
    measured_speedup: float | None
    conversion_s: float | None  # compressing W once (compress_2_4 / to_csr)

    def as_dict(self) -> dict:
        return asdict(self)


def reality_check(kernel: str, w: np.ndarray, rows: int, compute: str, target: Target,
                  flops: int, moved_bytes: int, measure: bool = True,
                  seed: int = 0) -> RealityCheck:
    """The numbers of a matmul x (rows, K) @ W (K, N) lowered to `kernel` in `compute`.

    `flops` and `moved_bytes` (what the op reads and writes besides W) come from the IR and feed
    the target's cost model for both the dense and the sparse kernel. With `measure`, x is
    random and both this module's kernel and numpy's BLAS matmul run on the same float32 values.
    """
    k = w.shape[0]
    cols = w.size // k if k else 0
    nnz = int(np.count_nonzero(w))
    stored = storage(kernel, k, cols, compute, nnz)
    dense = storage(DENSE, k, cols, compute)
    dense_s = contraction_time(target, compute, DENSE, flops, moved_bytes, k, cols, nnz)
    sparse_s = contraction_time(target, compute, kernel, flops, moved_bytes, k, cols, nnz)
    measured = (None, None, None)
    if measure and w.ndim == 2:
        # The kernels are numba's: imported here, so that a report without a sparse op to
        # measure (the policy sheet of most modules) does not import numba.
        from mplower.backend.measure import median_time
        from mplower.backend.sparse import compress, multiply

        w32 = np.ascontiguousarray(w, np.float32)
        x = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
        conversion = median_time(lambda: compress(kernel, w32), reps=3)
        parts = compress(kernel, w32)
        dense_t = median_time(lambda: np.matmul(x, w32))
        sparse_t = median_time(lambda: multiply(kernel, x, parts, (k, cols)))
        measured = (dense_t, sparse_t, conversion)
    dense_t, sparse_t, conversion = measured
    return RealityCheck(
        kernel=kernel, nominal_sparsity=sparsity(w), value_bytes=stored.values,
        metadata_bytes=stored.metadata, dense_bytes=dense.total,
        metadata_overhead=stored.overhead, modeled_dense_s=dense_s, modeled_sparse_s=sparse_s,
        modeled_speedup=dense_s / sparse_s, measured_dense_s=dense_t,
        measured_sparse_s=sparse_t,
        measured_speedup=dense_t / sparse_t if dense_t is not None and sparse_t else None,
        conversion_s=conversion)


def sparse_report(module: Module, target: Target, func: str | None = None,
                  weights: str | None = None, measure: bool = True) -> dict[str, Any] | None:
    """The sparse reality check of a function: every matmul/conv2d that lower-sparse decided
    (`mp.kernel`, `mp.sparse_reason`) or legalize moved off a sparse kernel, with the numbers of
    `reality_check` for those on a sparse kernel and the dense fallbacks counted by reason code.
    None when no op was decided. Weights that cannot be read leave an op's numbers out and say
    why in its `note`; only matmuls are measured (this backend has no sparse conv kernel)."""
    f = module.function(func)
    stores: list[WeightStore] = []  # made on first use: a module without sparse ops needs none
    entries = []
    for n in f.ops():
        d = f.data(n)
        attrs = d["attrs"]
        if d["op"] not in WEIGHTED:
            continue
        plan = Plan.of(attrs)
        kernel, reason = plan.kernel_or_dense, plan.sparse_reason
        if kernel == DENSE and reason is None:
            if NO_SPARSE_KERNEL not in plan.fallback:
                continue
            reason = NO_SPARSE_KERNEL  # legalize moved it off a sparse kernel
        entry: dict[str, Any] = {"name": f.value_name((n, 0)), "op": d["op"], "kernel": kernel,
                                 "reason": reason}
        if kernel != DENSE:
            entry.update(_op_check(f, n, kernel, module, weights, stores, target, measure))
        entries.append(entry)
    if not entries:
        return None
    dense = [e for e in entries if e["kernel"] == DENSE]
    return {
        "target": target.name,
        "considered": len(entries),
        "sparse_ops": len(entries) - len(dense),
        "dense_fallbacks": len(dense),
        "fallback_rate": len(dense) / len(entries),
        "kernels": dict(Counter(e["kernel"] for e in entries if e["kernel"] != DENSE)),
        "reasons": dict(Counter(e["reason"] for e in dense)),
        "ops": entries,
    }


def _op_check(f: Function, n: int, kernel: str, module: Module, weights: str | None,
              stores: list[WeightStore], target: Target, measure: bool) -> dict[str, Any]:
    d = f.data(n)
    op, attrs = d["op"], d["attrs"]
    ins, outs = f.operand_types(n), d["types"]
    node = f.operands(n)[WEIGHT_OPERAND][0]
    while f.op(node) in ("mp.sparse_encode", "mp.cast"):
        node = f.operands(node)[0][0]
    src = f.data(node)
    if src["op"] != "mp.constant":
        return {"note": "the weight is not a constant"}
    try:
        if isinstance(src["attrs"].get("value"), DenseAttr):
            w = src["attrs"]["value"].array
        else:
            if not stores:
                stores.append(WeightStore(module, weights))
            w = stores[0].get(src["attrs"]["name"], src["types"][0].shape, src["loc"])
    except DiagnosticError as e:
        return {"note": e.diagnostics[0].message}
    plan = Plan.of(attrs)
    compute, accum = plan.precision or ins[0].elem, plan.accum
    try:
        target.peak(compute, kernel)
    except ValueError as e:  # a plan not legalized for this target asks for a kernel it lacks
        return {"compute": compute, "note": f"{e}: the op runs dense there "
                                            f"(legalize{{target={target.name}}} records that)"}
    flops = int(OPS[op].flops(ins, outs, check_attrs(OPS[op], attrs)))
    axis = reduction_axis(op, w.ndim)
    w2 = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)  # (K, everything else)
    rows = math.prod(ins[0].shape[:-1]) if op == "mp.matmul" else 0
    check = reality_check(kernel, w2, rows, compute, target, flops,
                          other_bytes(op, ins, outs, compute, accum),
                          measure=measure and op == "mp.matmul")
    return {"compute": compute, "weight_shape": list(w.shape), **check.as_dict()}


SPARSE_HEADER = ("name", "kernel", "sparsity", "metadata", "modeled", "measured here",
                 "conversion")


def sparse_lines(sparse: dict[str, Any], fmt: str) -> list[str]:
    """`sparse_report`'s section as lines to print under a report's table ("table" or
    "markdown"): a summary with the dense fallbacks by reason code, then one row per sparse op."""
    kernels = ", ".join(f"{k}: {v}" for k, v in sparse["kernels"].items()) or "none"
    reasons = ", ".join(f"{k}: {v}" for k, v in sparse["reasons"].items())
    out = ["", (f"sparse: {sparse['considered']} matmul/conv ops, {sparse['sparse_ops']} on sparse "
                f"kernels ({kernels}), {sparse['dense_fallbacks']} dense "
                f"({sparse['fallback_rate']:.1%})" + (f" - {reasons}" if reasons else ""))]
    rows = [_sparse_cells(e) for e in sparse["ops"] if e["kernel"] != DENSE]
    if not rows:
        return out
    return out + ([""] if fmt == "markdown" else []) + table(SPARSE_HEADER, rows, fmt)


def _sparse_cells(e: dict[str, Any]) -> list[str]:
    if "modeled_speedup" not in e:
        return [e["name"], e["kernel"], "-", "-", "-", e.get("note", "-"), "-"]
    measured = (f"{e['measured_speedup']:.2f}x ({e['measured_sparse_s'] * 1e6:.1f} us vs "
                f"{e['measured_dense_s'] * 1e6:.1f} us BLAS)"
                if e["measured_speedup"] is not None else "-")
    conversion = f"{e['conversion_s'] * 1e6:.1f} us" if e["conversion_s"] is not None else "-"
    return [e["name"], e["kernel"], f"{e['nominal_sparsity']:.1%}",
            f"{e['metadata_bytes']} B ({e['metadata_overhead']:.1%} of values)",
            f"{e['modeled_speedup']:.4f}x", measured, conversion]
