"""What the weight-only algorithms read from a model: its layers and their calibration inputs.

A layer is a matmul `x @ W` with a constant 2-D W (K, N) and a non-constant x; layers that read
the same x share one input (the q, k and v projections of one normalized activation), so their
statistics are gathered once and AWQ gives them one input scale. `collect_layer_stats` runs the
module's fp32 reference (the `PassContext.runner` calibrate uses) over the calibration batches
and adds each layer input's rows to its mplower.numerics.weight_only.LayerStats as the value is
computed, so no activation is kept: memory is the K x K sums, whatever the data's size. The
statistics are those of the fp32 model (all layers' inputs from one reference run), not of a
model whose earlier layers are already quantized.

Each batch is a shard (mplower.lowering.sharding) that may run on a dask worker: a shard's sums
start from zero and add its batch exactly as the serial loop would, and the shards merge in
batch order, so the sums (and the module GPTQ or AWQ make of them) have the same bits with any
number of workers.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from mplower.ir.graph import Function, Module, Value
from mplower.lowering.calibration import ConstantValues
from mplower.lowering.sharding import Executor, reduce_shards
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


class _Collection:
    """What every batch's task shares (a dask worker receives it once): the module, the layer
    inputs, and per thread the fp32 reference (it holds the weights and takes a compile)."""

    def __init__(self, module: Module, func: str | None, inputs: list[Value],
                 runner: Callable, weights: str | None):
        self.module, self.func = module, func
        self.runner, self.weights = runner, weights
        f = module.function(func)
        self.widths = {v: f.type_of(v).shape[-1] for v in inputs}
        self._references: dict[int, Callable[..., Any]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_references": {}}  # compiled code stays where it was built

    def run(self, batch: list[np.ndarray], rows: int | None) -> dict[Value, LayerStats]:
        """The sums of one batch (with `rows`, of its leading rows alone)."""
        me = threading.get_ident()
        if me not in self._references:
            self._references[me] = self.runner(self.module, self.func, self.weights)
        stats = {v: LayerStats.zeros(k) for v, k in self.widths.items()}

        def observe(v: Value, y: np.ndarray | None) -> None:
            s = stats.get(v)
            if s is not None and y is not None:
                s.add(y if rows is None else y[:rows])

        self._references[me](batch, observe)
        return stats


def _batch_stats(job: _Collection, shard: tuple[list[np.ndarray], int | None]
                 ) -> dict[Value, LayerStats]:
    return job.run(*shard)


def _merge(a: dict[Value, LayerStats], b: dict[Value, LayerStats]) -> dict[Value, LayerStats]:
    out = {}
    for v, s in a.items():
        out[v] = copy.deepcopy(s)  # a partial stays as it was (a dask task may run again)
        out[v].merge(b[v])
    return out


def collect_layer_stats(module: Module, func: str | None, inputs: list[Value],
                        batches: list[list[np.ndarray]], last_rows: int | None,
                        runner: Callable, weights: str | None,
                        executor: Executor | None = None) -> dict[Value, LayerStats]:
    """LayerStats of each value in `inputs` over the batches, in batch order (with
    `last_rows`, the last batch's leading rows alone are samples: the rest is padding); one
    shard per batch on `executor` (None: here), merged in batch order (module docstring)."""
    job = _Collection(module, func, inputs, runner, weights)
    last = len(batches) - 1
    shards = [(batch, last_rows if i == last else None) for i, batch in enumerate(batches)]
    # A left fold in batch order: ((0 + H_0) + H_1) + ..., as the serial loop adds them.
    return reduce_shards(executor, _batch_stats, job, shards, _merge, tree=False)
