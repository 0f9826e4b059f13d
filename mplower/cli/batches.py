"""`mplower run --batch-inputs`: inputs with more rows than the function's batch, run batch by
batch, with one report over every row.

The rows of `--inputs` (every argument with the same count N along its first axis) run as N // B
whole batches through the compiled program, and a last partial batch of N % B rows through a
copy of the module retyped to that batch by set-batch: run at its own size, it computes only its
samples, so every count (overflow, underflow, NaN) and every drift figure is that of the N
samples, exactly. That is sound only where each row of a batch is computed from that row alone
(mplower's arithmetic is per-sample bit-identical at any batch size, tests/test_set_batch.py):
a model with an op that mixes the batch axis is refused, at the function. The runs are merged
into one RunResult: outputs and references stacked, per-op counts summed, per-op drift measured
over all rows, a value that does not carry the batch (a weight's rounding) counted once.

With `--workers N` or `--scheduler ADDRESS` the whole batches run on dask workers, one batch a
task (mplower.lowering.sharding): a worker compiles the module once and sends back each run as
plain arrays and counts (a RunResult's steps hold compiled kernels, which do not pickle), and
the runs are stacked in batch order, so the report is the same bytes as the serial run's.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np

from mplower.ir.diagnostics import DiagnosticError, Location


def split_rows(program, path: str) -> tuple[list[list[np.ndarray]], int]:
    """The batches of `path`'s arrays (the last one possibly partial) and the row count N."""
    from mplower.io.npz import read_npz

    loc = Location(path, 0, 0)
    arrays = read_npz(Path(path), loc, "inputs")
    batch = program.arg_types[0].shape[0] if program.arg_types[0].rank else None
    counts = {}
    for name, t in zip(program.arg_names, program.arg_types):
        if name not in arrays:
            have = ", ".join(sorted(arrays)) or "none"
            raise DiagnosticError.at(loc, f"input '{name}' is missing from {path} (it has: "
                                          f"{have})")
        a = arrays[name]
        if not t.rank or t.shape[0] != batch or a.ndim != t.rank or a.shape[1:] != t.shape[1:]:
            raise DiagnosticError.at(loc, (
                f"--batch-inputs: input '{name}' in {path} has shape {list(a.shape)}; "
                f"expected rows of the function's {list(t.shape)}: [N, "
                f"{', '.join(map(str, t.shape[1:]))}] (every argument batched along axis 0)"))
        counts[name] = a.shape[0]
    if len(set(counts.values())) != 1 or not next(iter(counts.values())):
        raise DiagnosticError.at(loc, f"--batch-inputs: the inputs in {path} must hold the same "
                                      f"number of rows, at least one: {counts}")
    n = next(iter(counts.values()))
    rows = [np.asarray(arrays[name]) for name in program.arg_names]
    return [[a[i:i + batch] for a in rows] for i in range(0, n, batch)], n


@dataclasses.dataclass
class _Run:
    """One batch's RunResult as plain data: per step (in program order) its counts, scale and
    drift, and the kept values."""

    outputs: list[Any]
    reference: list[Any] | None
    ops: list[tuple]
    values: list[Any]
    refs: list[Any]


class _Batches:
    """What every batch's task shares (a dask worker receives it once): the module and how to
    run it, and per thread the program compiled from it."""

    def __init__(self, module, func: str | None, weights: str | None, reference: bool,
                 program):
        self.module, self.func, self.weights, self.reference = module, func, weights, reference
        self._programs = {threading.get_ident(): program}  # this thread's: the caller's

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_programs": {}}  # compiled kernels stay where they were built

    def run(self, batch: list[np.ndarray]) -> list[_Run]:
        from mplower.backend.executor import Program

        program = self._programs.get(threading.get_ident())
        if program is None:
            program = self._programs[threading.get_ident()] = Program(
                self.module, self.func, self.weights)
        r = program.run(batch, self.reference, keep=self.reference)
        ops = [(o.counts, o.scale, o.rel_l2, o.sqnr_db, o.max_abs, o.nonfinite_mismatch)
               for o in r.ops]
        return [_Run(r.outputs, r.reference, ops, r.values, r.refs)]


def _run_batch(job: _Batches, batch: list[np.ndarray]) -> list[_Run]:
    return job.run(batch)


def _concat(a: list[_Run], b: list[_Run]) -> list[_Run]:
    return a + b


def _run_whole(module, program, batches: list[list[np.ndarray]], func: str | None,
               weights: str | None, reference: bool, executor) -> list:
    """The RunResult of each whole batch, in order, run here or on `executor`'s workers."""
    from mplower.backend.executor import OpResult, RunResult
    from mplower.lowering.sharding import reduce_shards

    if not batches:
        return []
    job = _Batches(module, func, weights, reference, program)
    runs = reduce_shards(executor, _run_batch, job, batches, _concat, tree=False)
    return [RunResult(r.outputs, r.reference,
                      [OpResult(step, counts, rel_l2=rel_l2, sqnr_db=sqnr_db, max_abs=max_abs,
                                nonfinite_mismatch=nonfinite, scale=scale)
                       for step, (counts, scale, rel_l2, sqnr_db, max_abs, nonfinite)
                       in zip(program.steps, r.ops, strict=True)],
                      r.values, r.refs) for r in runs]


def run_batches(module, program, batches: list[list[np.ndarray]], func: str | None,
                weights: str | None, reference: bool = True, executor=None):
    """One RunResult over every batch (module docstring); without `reference`, the lowered
    plan alone (`--no-reference`); the whole batches on `executor` (None: here)."""
    from mplower.backend.executor import OpResult, Program, RunResult
    from mplower.numerics.metrics import drift
    from mplower.passes.calibrate import grouped_module
    from mplower.passes.set_batch import set_batch

    f = module.function(func)
    batch = program.arg_types[0].shape[0]
    if grouped_module(module, func, 2) is None:
        raise DiagnosticError.at(f.loc, (
            f"--batch-inputs: @{f.name} mixes the rows of a batch (an op works along the batch "
            f"axis, or set-batch cannot retype it), so running the inputs batch by batch would "
            f"change the results; retype the model to all the rows with "
            f"`mplower opt --pass='set-batch{{size=N}}'` and run it once"))
    # Each op's drift is taken over all the batches at once, so every run keeps its values.
    # (The last run's diagnosis of a non-finite reference, RunResult.all_refs, is not merged.)
    runs = _run_whole(module, program, [b for b in batches if len(b[0]) == batch], func,
                      weights, reference, executor)
    last = batches[-1]
    if len(last[0]) != batch:
        small = copy.deepcopy(module)
        set_batch(small.function(func), len(last[0]))
        runs.append(Program(small, func, weights).run(last, reference, keep=reference))
    first = runs[0]
    if any([s.step.name for s in r.ops] != [s.step.name for s in first.ops] for r in runs):
        raise DiagnosticError.at(f.loc, "--batch-inputs: the last, partial batch compiles to "
                                        "other steps than a whole one; give whole batches")
    stacked = [np.concatenate([r.outputs[i] for r in runs]) if np.ndim(y) else y
               for i, y in enumerate(first.outputs)]
    reference = None if first.reference is None else [
        None if y is None else np.concatenate([r.reference[i] for r in runs])
        if np.ndim(y) else y for i, y in enumerate(first.reference)]
    ops = []
    for k, res in enumerate(first.ops):
        step = res.step
        per_run = [r.ops[k] for r in runs]
        carries = step.constant is None and step.out_type.rank and all(
            p.step.out_type.shape[0] == len(b[0]) for p, b in zip(per_run, batches))
        if not carries:  # a constant or a weight's transform: the same in every run
            ops.append(res)
            continue
        n = sum(p.step.out_type.shape[0] for p in per_run)
        merged = OpResult(dataclasses.replace(step, out_type=dataclasses.replace(
            step.out_type, shape=(n, *step.out_type.shape[1:]))),
            sum((p.counts for p in per_run[1:]), per_run[0].counts), scale=res.scale)
        if res.rel_l2 is not None or res.max_abs is not None:
            y = np.concatenate([np.asarray(r.values[r.ops[k].step.output]) for r in runs])
            ref = np.concatenate([np.asarray(r.refs[r.ops[k].step.output]) for r in runs])
            d = drift(y, ref)
            merged.rel_l2, merged.sqnr_db, merged.max_abs = d.rel_l2, d.sqnr_db, d.max_abs
            merged.nonfinite_mismatch = d.nonfinite_mismatch
        ops.append(merged)
    return RunResult(stacked, reference, ops)

