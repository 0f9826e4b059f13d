"""What the weight-only algorithms read from a model: its layers and their calibration inputs.

A layer is a matmul `x @ W` with a constant 2-D W (K, N) and a non-constant x; layers that read
the same x share one input (the q, k and v projections of one normalized activation), so their
statistics are gathered once and AWQ gives them one input scale. `collect_layer_stats` runs the
module's fp32 reference (the `PassContext.runner` calibrate uses) over the calibration batches
and adds each layer input's rows to its mplower.numerics.weight_only.LayerStats as the value is
computed, so no activation is kept: memory is the K x K sums, whatever the data's size. The
statistics are those of the fp32 model (all layers' inputs from one reference run), not of a
model whose earlier layers are already quantized.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mplower.ir.graph import Function, Module, Value
from mplower.lowering.calibration import ConstantValues
from mplower.numerics.weight_only import LayerStats


def layer_groups(f: Function, targets: list[int], consts: ConstantValues
                 ) -> dict[Value, list[int]]:
    """The targets that are layers (module docstring), grouped by the input they read."""
    groups: dict[Value, list[int]] = {}
    for n in targets:
        if f.op(n) != "mp.matmul":
            continue
        x, w = f.operands(n)[:2]
        if x in consts or w not in consts or f.type_of(w).rank != 2:
            continue
        groups.setdefault(x, []).append(n)
    return groups


def collect_layer_stats(module: Module, func: str | None, inputs: list[Value],
                        batches: list[list[np.ndarray]], last_rows: int | None,
                        runner: Callable, weights: str | None) -> dict[Value, LayerStats]:
    """LayerStats of each value in `inputs` over the batches, in batch order (with
    `last_rows`, the last batch's leading rows alone are samples: the rest is padding)."""
    f = module.function(func)
    stats = {v: LayerStats.zeros(f.type_of(v).shape[-1]) for v in inputs}
    reference = runner(module, func, weights)
    for i, batch in enumerate(batches):
        rows = last_rows if last_rows is not None and i == len(batches) - 1 else None

        def observe(v: Value, y: np.ndarray | None, rows: int | None = rows) -> None:
            s = stats.get(v)
            if s is not None and y is not None:
                s.add(y if rows is None else y[:rows])

        reference(batch, observe)
    return stats
