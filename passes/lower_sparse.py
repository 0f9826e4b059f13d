"""`lower-sparse`: choose a dense, structured-sparse (2:4, 1:2) or CSR kernel for each weight op.

Every matmul and conv2d gets a decision. One whose second operand is computed (attention's
q @ k^T) is dense with reason `no-constant-weight`: a sparse kernel needs the weight's zeros
before the run. For every one whose weight is a constant, the target description says which
sparse kernels exist for the op in its compute format (`mp.precision`, else its operand type),
the weight's values say which of them it fits (a 2:4 or 1:2 pattern along the reduction axis,
or enough zeros for CSR), the shape thresholds rule out weights too small to pay for a sparse
launch, and the target's roofline cost model (mplower.lowering.sparsity.contraction_time) compares the
fastest fitting kernel with the dense one. The pass records the choice as `mp.kernel`, a dense
choice's reason code as `mp.sparse_reason` (the codes of mplower.lowering.target.SPARSE_REASON_CODES)
and both in `mp.reason`. A matmul given a sparse kernel reads its weight through an
`mp.sparse_encode` whose result type carries the encoding; a conv2d's 4-D weight has no
encoded type in the IR, so a sparse conv carries the decision in `mp.kernel` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from mplower.dialect.mp import WEIGHTED
from mplower.dialect.plan import TARGET, Plan
from mplower.io.npz import WeightStore
from mplower.ir.graph import ARG, Function, Module, Value
from mplower.ir.opdef import OPS, check_attrs
from mplower.ir.types import DenseAttr
from mplower.lowering.sparsity import (
    ENCODING_OF_KERNEL,
    KERNEL_PATTERN,
    WEIGHT_OPERAND,
    contraction_time,
    other_bytes,
    patterns_of,
    reduction_axis,
    sparsity,
)
from mplower.lowering.target import (
    CSR,
    DENSE,
    DTYPE_UNSUPPORTED,
    KERNELS,
    NO_CONSTANT_WEIGHT,
    NO_SPARSE_KERNEL,
    NOT_PROFITABLE,
    PATTERN_INVALID,
    TOO_SMALL,
    Target,
    load_target,
)
from mplower.pass_manager import Pass, PassContext, PipelineError, option, register_pass


@dataclass(frozen=True)
class Choice:
    kernel: str
    reason: str | None  # the reason code of a dense choice
    detail: str  # what mp.reason says about it
    speedup: float | None = None  # modeled dense time / time of the chosen sparse kernel


@dataclass(frozen=True)
class Thresholds:
    min_size: int
    min_dim: int
    min_speedup: float
    csr_min_sparsity: float


def choose_kernel(target: Target, op: str, compute: str, w: np.ndarray, axis: int, flops: int,
                  moved_bytes: int, limits: Thresholds) -> Choice:
    """The kernel for one op with weight values `w` (reduction axis `axis`), and why.

    `flops` is the op's dense count and `moved_bytes` what it reads and writes besides `w`.

    Checked in order, the first failure being the reason code: the target has a sparse kernel
    for `op` at all (no-sparse-kernel); the weight fits one of them, a structured one by its
    pattern or CSR by its share of zeros (pattern-invalid); one it fits exists in `compute`
    (dtype-unsupported); the weight meets the shape thresholds (too-small); the fastest fitting
    kernel beats dense by more than `min_speedup` in the cost model (not-profitable).
    """
    offered = {k for fmt in target.formats for k in target.kernels(op, fmt)} - {DENSE}
    if not offered:
        return Choice(DENSE, NO_SPARSE_KERNEL, f"{target.name} has no sparse {op} kernel")
    patterns = patterns_of(w, axis)
    zeros = sparsity(w)
    fits = {k for k, p in KERNEL_PATTERN.items() if p in patterns}
    if zeros >= limits.csr_min_sparsity:
        fits.add(CSR)
    usable = fits & offered
    if not usable:
        have = "/".join(sorted(patterns)) or "no structured pattern"
        return Choice(DENSE, PATTERN_INVALID, (
            f"weight has {have} and {zeros:.0%} zeros; {target.name} runs "
            f"{', '.join(_kernel_names(offered))}"))
    here = usable & target.kernels(op, compute)
    if not here:
        return Choice(DENSE, DTYPE_UNSUPPORTED, (
            f"{target.name} has no {compute} {'/'.join(_kernel_names(usable))} kernel"))
    k = w.shape[axis]
    cols = w.size // k
    if w.size < limits.min_size or k < limits.min_dim or cols < limits.min_dim:
        return Choice(DENSE, TOO_SMALL, (
            f"weight {k}x{cols} is below min_size={limits.min_size} or min_dim="
            f"{limits.min_dim}"))
    nnz = int(np.count_nonzero(w))
    dense = contraction_time(target, compute, DENSE, flops, moved_bytes, k, cols, nnz)
    times = {kern: contraction_time(target, compute, kern, flops, moved_bytes, k, cols, nnz)
             for kern in here}
    best = min(sorted(here, key=KERNELS.index), key=times.__getitem__)
    speedup = dense / times[best]
    if speedup <= limits.min_speedup:
        return Choice(DENSE, NOT_PROFITABLE, (
            f"{best} modeled {speedup:.4f}x dense on {target.name}, needs > "
            f"{limits.min_speedup}x"), speedup)
    return Choice(best, None, f"modeled {speedup:.4f}x dense on {target.name}", speedup)


def _kernel_names(kernels: set[str]) -> list[str]:
    return sorted(kernels, key=KERNELS.index)


def _not_a_weight(f: Function, value: Value) -> str:
    what = "an argument" if f.op(value[0]) == ARG else f"computed by {f.op(value[0])}"
    return f"operand #{WEIGHT_OPERAND} {f.value_name(value)} is {what}, not a constant weight"


def weight_values(f: Function, value: Value, store: WeightStore) -> np.ndarray | None:
    """The values of a weight operand that is a constant, possibly behind casts (rounding keeps
    zeros, so the constant's pattern is the cast's); None for anything computed."""
    node = value[0]
    while f.op(node) == "mp.cast":
        node = f.operands(node)[0][0]
    d = f.data(node)
    if d["op"] != "mp.constant":
        return None
    attrs = d["attrs"]
    if isinstance(attrs.get("value"), DenseAttr):
        return attrs["value"].array
    return store.get(attrs["name"], d["types"][0].shape, d["loc"])


@register_pass
@dataclass
class LowerSparse(Pass):
    """Choose a dense, 2:4 / 1:2 structured-sparse or CSR kernel for each matmul and conv2d.

    For each op whose weight (second operand) is a constant: the target's kernels for the op in
    its compute format (`mp.precision`, else the operand type: run after assign-precision), the
    weight's pattern along its reduction axis (2:4 or 1:2; CSR needs `csr_min_sparsity` zeros),
    the shape thresholds and the target's cost model decide. An op whose second operand is
    computed (attention's q @ k^T) is dense with reason no-constant-weight, so every op gets a
    decision. Sets `mp.kernel`; a dense choice gets its reason code in `mp.sparse_reason`
    (no-constant-weight, no-sparse-kernel, pattern-invalid, dtype-unsupported, too-small,
    not-profitable; docs/sparse.md) and every choice a note in `mp.reason`. A sparse matmul
    reads its weight through `mp.sparse_encode` to a tensor type with the encoding ("2:4",
    "1:2", "csr"). Ops whose weight is already encoded are left as they are, and a re-run
    repeats no note, so the pass is idempotent.
    """

    name: ClassVar[str] = "lower-sparse"
    statistics: ClassVar[dict[str, str]] = {
        "ops-considered": "matmul/conv2d ops given a kernel decision",
        "ops-sparse": "ops given a sparse kernel (each kernel counted as kernel:NAME too)",
        "ops-dense": "ops kept dense (each reason code counted as dense:CODE too)",
        "encodes-inserted": "mp.sparse_encode ops created",
    }
    target: str = option("generic", "built-in target name or path to a .toml description")
    ops: tuple[str, ...] = option(WEIGHTED, "ops to choose a kernel for")
    min_size: int = option(1024, "weights with fewer values stay dense (too-small)")
    min_dim: int = option(16, "weights with fewer rows or columns stay dense (too-small)")
    min_speedup: float = option(1.0, "modeled speedup over dense a sparse kernel must exceed")
    csr_min_sparsity: float = option(0.8, "share of zeros a weight needs for CSR")

    def __post_init__(self) -> None:
        for op in self.ops:
            if op not in WEIGHTED:
                raise PipelineError(f"lower-sparse: '{op}' has no weight operand "
                                    f"(ops: {', '.join(WEIGHTED)})")

    def run(self, module: Module, ctx: PassContext) -> None:
        target = load_target(self.target, known_ops=OPS)
        store = WeightStore(module, ctx.weights_path)
        limits = Thresholds(self.min_size, self.min_dim, self.min_speedup, self.csr_min_sparsity)
        considered = 0
        for f in module.functions.values():
            encoded: dict[tuple[Value, str], Value] = {}
            for n in f.ops():
                if f.op(n) not in self.ops:
                    continue
                ins = f.operand_types(n)
                if len(ins) <= WEIGHT_OPERAND or ins[WEIGHT_OPERAND].encoding is not None:
                    continue
                weight = f.operands(n)[WEIGHT_OPERAND]
                w = weight_values(f, weight, store)
                considered += 1
                if w is None:
                    choice = Choice(DENSE, NO_CONSTANT_WEIGHT, _not_a_weight(f, weight))
                elif w.ndim < 2:
                    choice = Choice(DENSE, TOO_SMALL, f"weight is a vector of {w.size} values; "
                                                      "sparse kernels take a matrix")
                else:
                    choice = self._choose(f, n, w, target, limits)
                self._record(f, n, choice, ctx)
                if choice.kernel != DENSE and f.op(n) == "mp.matmul":
                    f.set_operand(n, WEIGHT_OPERAND, self._encode(f, weight, choice.kernel,
                                                                  encoded, ctx))
        ctx.stat("ops-considered", considered)
        if considered:
            module.attrs[TARGET] = target.source.removeprefix("builtin:")

    def _choose(self, f: Function, n: int, w: np.ndarray, target: Target,
                limits: Thresholds) -> Choice:
        d = f.data(n)
        op, attrs = d["op"], d["attrs"]
        ins, outs = f.operand_types(n), d["types"]
        plan = Plan.of(attrs)
        compute, accum = plan.precision or ins[0].elem, plan.accum
        flops = int(OPS[op].flops(ins, outs, check_attrs(OPS[op], attrs)))
        moved = other_bytes(op, ins, outs, compute, accum)
        return choose_kernel(target, op, compute, w, reduction_axis(op, w.ndim), flops, moved,
                             limits)

    def _record(self, f: Function, n: int, choice: Choice, ctx: PassContext) -> None:
        plan = Plan.at(f, n)
        note = (f"dense: {choice.reason} ({choice.detail})" if choice.reason
                else f"{choice.kernel}: {choice.detail}")
        prior = plan.reason or ""
        reason = plan.reason
        if note != prior and not prior.endswith(f"; {note}"):  # a re-run repeats no note
            reason = f"{prior}; {note}" if prior else note
        plan._replace(kernel=choice.kernel, reason=reason,
                      sparse_reason=choice.reason or None).write(f, n)
        if choice.reason:
            ctx.stat("ops-dense")
            ctx.stat(f"dense:{choice.reason}")
        else:
            ctx.stat("ops-sparse")
            ctx.stat(f"kernel:{choice.kernel}")

    def _encode(self, f: Function, weight: Value, kernel: str,
                encoded: dict[tuple[Value, str], Value], ctx: PassContext) -> Value:
        """The weight in the kernel's encoding: one mp.sparse_encode per (value, encoding),
        right after the weight's producer and shared by every op that runs that kernel on it."""
        encoding = ENCODING_OF_KERNEL[kernel]
        hit = encoded.get((weight, encoding))
        if hit is not None:
            return hit
        t = f.type_of(weight).with_encoding(encoding)
        src = f.data(weight[0])["name"]
        node = f.create_op("mp.sparse_encode", [weight], [t], after=weight[0],
                           name_hint=f"{src}_{kernel}")
        ctx.stat("encodes-inserted")
        encoded[(weight, encoding)] = (node, 0)
        return (node, 0)
