"""`sparsify`: magnitude-prune the weights of matmuls and convolutions to a sparsity pattern.

The weights are the constants that feed the second operand of the selected ops. 2:4 and 1:2
pruning keep the largest magnitudes of each group of consecutive values along the weight's
reduction axis (mplower.lowering.sparsity: K of a matmul's (K, N) weight, the input channel of a conv's
OIHW weight), as NVIDIA's ASP does for sparse tensor cores; unstructured pruning zeros the
smallest magnitudes of the whole tensor. A constant that is also used for anything else is left
alone, so that pruning never changes a value the user did not hand over as a weight. Inline
`dense<>` weights are rewritten in place; weights from the `.npz` keep their names, and the
whole file, pruned arrays replaced, is written to `<stem>.npz` beside `-o`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from mplower.dialect.mp import WEIGHTED
from mplower.dialect.plan import WEIGHTS
from mplower.io.npz import WeightStore, beside, write_npz
from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location, did_you_mean
from mplower.ir.graph import Function, Module
from mplower.ir.types import DenseAttr
from mplower.lowering.sparsity import (
    PATTERNS,
    WEIGHT_OPERAND,
    prune_magnitude,
    prune_structured,
    reduction_axis,
)
from mplower.pass_manager import Pass, PassContext, PipelineError, option, register_pass

UNSTRUCTURED = "unstructured"


@dataclass
class _Weight:
    """One constant op to prune, with the axis its pattern runs along."""

    f: Function
    node: int
    axis: int


@register_pass
@dataclass
class Sparsify(Pass):
    """Magnitude-prune the weight constants of matmul and conv2d to 2:4, 1:2 or unstructured.

    `pattern=2:4` keeps the two largest magnitudes of every four consecutive values along the
    weight's reduction axis (K of a matmul's (K, N) weight, the input channel of a conv2d's OIHW
    weight), the lower index on ties; `1:2` keeps one of every two; `unstructured` zeros the
    `sparsity` fraction of smallest magnitudes of the whole tensor. Weights with fewer than
    `min_size` values, of rank below 2, or whose constant has other uses are left as they are.
    Inline `dense<>` weights are rewritten in place. Weights from the module's `.npz` keep their
    names: all arrays, pruned ones replaced, are written to `<stem>.npz` beside `-o` and
    `mp.weights` names that file, so without `-o` the pass fails and says so. Run
    `lower-sparse` afterwards to choose the kernels.
    """

    name: ClassVar[str] = "sparsify"
    statistics: ClassVar[dict[str, str]] = {
        "weights-pruned": "weight tensors pruned",
        "values-pruned": "weight values set to zero that were not zero",
        "values-kept": "non-zero values left in the pruned weights",
        "weights-skipped-small": "weights with fewer than min_size values, left as they are",
        "weights-skipped-shared": "weight constants with other uses, left as they are",
    }
    # The pruned weights go to the .npz beside -o (mlp.sparse.npz), never over mlp.npz.
    examples: ClassVar[tuple[str, ...]] = (
        "ir_examples/mlp.ir --pass=sparsify -o mlp.sparse.ir",
        "ir_examples/mlp.ir --pass='sparsify{pattern=1:2}' -o mlp.sparse.ir",
    )
    pattern: str = option("2:4", "2:4 or 1:2 (along the reduction axis), or unstructured")
    sparsity: float = option(0.5, "fraction of values to zero with pattern=unstructured")
    ops: tuple[str, ...] = option(WEIGHTED, "ops whose weight operand is pruned")
    min_size: int = option(1024, "weights with fewer values are left as they are")

    def __post_init__(self) -> None:
        if self.pattern not in (*PATTERNS, UNSTRUCTURED):
            hint = did_you_mean(self.pattern, (*PATTERNS, UNSTRUCTURED))
            raise PipelineError(f"sparsify: unknown pattern '{self.pattern}'{hint} "
                                f"(2:4, 1:2 or unstructured)")
        if not 0.0 <= self.sparsity <= 1.0:
            raise PipelineError(f"sparsify: sparsity must be in [0, 1], got {self.sparsity}")
        for op in self.ops:
            if op not in WEIGHTED:
                raise PipelineError(f"sparsify: '{op}' has no weight operand to prune "
                                    f"(ops: {', '.join(WEIGHTED)})")

    def run(self, module: Module, ctx: PassContext) -> None:
        store = WeightStore(module, ctx.weights_path)
        named: dict[str, np.ndarray] = {}  # npz key -> pruned array
        first_named: Location | None = None
        rewrites: list[tuple[_Weight, np.ndarray]] = []
        for w in self._weights(module, ctx):
            d = w.f.data(w.node)
            attrs, t = d["attrs"], d["types"][0]
            name = attrs.get("name")
            if name is not None and name in named:
                continue  # another constant op of the same npz entry
            values = attrs["value"].array if name is None else store.get(name, t.shape, d["loc"])
            if values.size < self.min_size:
                ctx.stat("weights-skipped-small")
                continue
            if self.pattern == UNSTRUCTURED:
                pruned = prune_magnitude(values, self.sparsity)
            else:
                pruned = prune_structured(values, self.pattern, w.axis)
            kept = int(np.count_nonzero(pruned))
            ctx.stat("weights-pruned")
            ctx.stat("values-pruned", int(np.count_nonzero(values)) - kept)
            ctx.stat("values-kept", kept)
            if name is None:
                rewrites.append((w, pruned))
            else:
                named[name] = pruned
                first_named = first_named or d["loc"]
        if named:
            if ctx.output_path is None:
                raise DiagnosticError(Diagnostic(first_named, (
                    f"sparsify prunes weights stored in {store.path.name} ('{next(iter(named))}'"
                    f"{' and others' if len(named) > 1 else ''}); pass -o FILE so that the "
                    f"pruned weights can be written to FILE's .npz beside it")))
            arrays = dict(store.all(module.loc))
            arrays.update(named)
            out = beside(ctx.output_path)
            write_npz(out, arrays, module.loc)
            module.attrs[WEIGHTS] = out.name
            ctx.weights_path = str(out.resolve())  # later passes of this run read the new file
        for w, pruned in rewrites:
            t = w.f.types(w.node)[0]
            w.f.set_attr(w.node, "value", DenseAttr(pruned, t))

    def _weights(self, module: Module, ctx: PassContext) -> list[_Weight]:
        """The constants to prune: every use is the weight operand of a selected op, whose
        reduction axis is the same for all of them. Named constants are checked across every
        op that reads the same npz entry."""
        found: list[_Weight] = []
        blocked: set[str] = set()  # npz keys some constant op uses otherwise
        for f in module.functions.values():
            for n in f.ops():
                d = f.data(n)
                if d["op"] != "mp.constant":
                    continue
                rank = d["types"][0].rank
                uses = f.uses((n, 0))
                axes = {reduction_axis(f.op(u), rank) for u, pos in uses
                        if f.op(u) in self.ops and pos == WEIGHT_OPERAND}
                if not axes:
                    continue  # not a weight of the selected ops (a bias, a scale, ...)
                name = d["attrs"].get("name")
                if len(axes) > 1 or any(f.op(u) not in self.ops or pos != WEIGHT_OPERAND
                                        for u, pos in uses):
                    ctx.stat("weights-skipped-shared")
                    if name is not None:
                        blocked.add(name)
                    continue
                if rank >= 2:
                    found.append(_Weight(f, n, axes.pop()))
        kept = [w for w in found if w.f.attrs_of(w.node).get("name") not in blocked]
        ctx.stat("weights-skipped-shared", len(found) - len(kept))
        return kept

