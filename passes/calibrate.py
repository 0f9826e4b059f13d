"""`calibrate`: run the fp32 reference over a calibration set and record every tensor's range.

The one pass that executes the model. Calibration is by definition "run the model on data", but
passes sit below the backend, so the pass gets the fp32 reference from its caller:
`PassContext.runner` (mplower.pass_manager.ReferenceRunner), which the CLI and the ONNX backend
fill with mplower.backend.executor.reference_runner. A calibration driver in a layer above the
passes instead would make `calibrate` the only step of a pipeline that cannot be written in
`--pass-pipeline`, which is worse for users.

The data file is an .npz keyed by argument name; each array is one batch of the argument's shape,
a stack of such batches (leading axis), or any number of samples along the batch axis (the last
batch padded, its padding left out of every statistic), and every argument has as many.
Batches run through the module's fp32 reference (the module is not changed), several at a time
stacked along the batch axis where the model keeps the rows of a batch apart (a copy retyped by
set-batch), and each value's statistics are gathered as it is computed, with
mplower.lowering.calibration's mergeable histograms (a relu's follow from its operand's), then
recorded per value: `mp.range = [lo, hi]` (what quantize uses),
`mp.calib` (the method), `mp.observed` (the extremes, when the method clipped them), `mp.tiny`
(a power of two at or below the 1% quantile of the non-zero magnitudes, for range-analysis) and,
on the activations that feed a matmul or conv, `mp.channel_absmax` over the reduction channels
(for smooth-quant). Weights (constant-only values) are not recorded: quantize reads them.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from mplower.passes.set_batch import set_batch

from mplower.dialect.mp import WEIGHTED
from mplower.io.npz import read_npz
from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location
from mplower.ir.graph import Function, Module, Value
from mplower.ir.opdef import Trait, attr_int, attr_ints, check_attrs, lookup, ops_with
from mplower.lowering.calibration import (
    METHODS,
    ConstantValues,
    Progress,
    TensorStats,
    constant_nodes,
    record,
)
from mplower.lowering.sharding import Executor, reduce_shards, shard_ranges
from mplower.numerics.formats import FORMATS
from mplower.pass_manager import Pass, PassContext, ReferenceRunner, option, register_pass


def channel_axes(f: Function, constants: set[int]) -> dict[Value, int]:
    """Activations that enter a matmul or conv against a weight, and their reduction axis."""
    out: dict[Value, int] = {}
    for n in f.ops():
        op = f.op(n)
        if op not in WEIGHTED:
            continue
        ins = f.operands(n)
        if ins[0][0] in constants or ins[1][0] not in constants:
            continue
        t = f.type_of(ins[0])
        out[ins[0]] = (t.rank - 1) if op == "mp.matmul" else 1
    return out


def split_batches(f: Function, arrays: dict[str, np.ndarray], loc: Location,
                  what: str = "calibration") -> list[list[np.ndarray]]:
    """Per batch, the arrays of every argument in order (one batch, a stack of batches, or
    samples that fill whole batches); `what` names the data in messages (`mplower tune` reads
    evaluation data too). A partial last batch is refused: see `split_samples`."""
    batches, rows = split_samples(f, arrays, loc, what)
    if rows is not None:
        batch = f.type_of((f.args[0], 0)).shape[0]
        n = (len(batches) - 1) * batch + rows
        raise DiagnosticError.at(loc, (
            f"{what} data holds {n} samples, not a whole number of batches of {batch}; give "
            f"a multiple of {batch} samples, or retype the model with set-batch"))
    return batches


def split_samples(f: Function, arrays: dict[str, np.ndarray], loc: Location,
                  what: str = "calibration") -> tuple[list[list[np.ndarray]], int | None]:
    """Per batch, the arrays of every argument in order, and how many rows of the last batch
    are samples (None: all of them). Each array is one batch of the argument's shape, a stack
    [N, *shape] of batches, or N samples [N, *shape[1:]] along the batch axis (every argument
    with the same batch): any N, the last batch padded with copies of its last sample."""
    names = [f.data(a)["name"] for a in f.args]
    missing = [n for n in names if n not in arrays]
    if missing:
        have = ", ".join(sorted(arrays)) or "none"
        raise DiagnosticError.at(loc, f"{what} data lacks argument(s) "
                                      f"{', '.join(missing)} (it has: {have})")
    shapes = [f.type_of((a, 0)).shape for a in f.args]
    per_arg = []
    samples: dict[str, int] = {}
    for name, shape in zip(names, shapes):
        arr = np.asarray(arrays[name])
        if tuple(arr.shape) == shape:
            per_arg.append([arr])
        elif arr.ndim == len(shape) + 1 and tuple(arr.shape[1:]) == shape:
            per_arg.append(list(arr))
        elif shape and arr.ndim == len(shape) and tuple(arr.shape[1:]) == shape[1:] \
                and len({s[0] for s in shapes if s}) == 1:
            samples[name] = arr.shape[0]
            per_arg.append(arr)
        else:
            raise DiagnosticError.at(loc, (
                f"{what} array '{name}' has shape {list(arr.shape)}; expected one batch "
                f"{list(shape)}, a stack [N, {', '.join(map(str, shape))}] or samples "
                f"[N, {', '.join(map(str, shape[1:]))}]"))
    rows = None
    if samples:
        if len(samples) != len(names) or len(set(samples.values())) != 1:
            raise DiagnosticError.at(loc, (
                f"{what} arrays must all be batches or all be samples of one count, got "
                f"{ {n: list(np.shape(arrays[n])) for n in names} }"))
        n, batch = next(iter(samples.values())), shapes[0][0]
        rows = n % batch
        for i, arr in enumerate(per_arg):
            if rows:  # padded by its last sample: real values, which the statistics drop
                pad = np.repeat(arr[-1:], batch - rows, axis=0)
                arr = np.concatenate([arr, pad])
            per_arg[i] = list(arr.reshape(-1, batch, *arr.shape[1:]))
        rows = rows or None
    counts = {len(b) for b in per_arg}
    if len(counts) != 1:
        raise DiagnosticError.at(loc, f"{what} arrays hold different numbers of batches: "
                                      f"{dict(zip(names, (len(b) for b in per_arg)))}")
    if counts == {0}:  # statistics, references and drift of no batch at all mean nothing
        shapes_text = ", ".join(f"'{n}' {list(np.shape(arrays[n]))}" for n in names)
        raise DiagnosticError.at(loc, f"{what} data {loc.file} holds no batch (a stack of "
                                      f"zero: {shapes_text}); give at least one")
    return [list(batch) for batch in zip(*per_arg)], rows


def check_partial_batch(module: Module, func: str | None, loc: Location) -> None:
    """A padded last batch gives the statistics of its samples alone only where every row of
    a batch is computed from that row alone (`grouped_module` says so); refuse it elsewhere."""
    if grouped_module(module, func, 2) is None:
        raise DiagnosticError.at(loc, (
            "calibration data does not fill its last batch, and this model mixes the rows of "
            "a batch (an op works along the batch axis, or set-batch cannot retype it), so "
            "padding would change the statistics; give a whole number of batches"))


# Ops whose every row of the batch (axis 0) is computed from that row alone, whatever their
# attributes: numpy-broadcasting elementwise ops, NCHW convolutions and windows, reshapes (whose
# rows stay whole: every value's leading dimension is checked to follow the batch).
_ROW_WISE = ops_with(Trait.ELEMENTWISE) | {
    "mp.conv2d", "mp.max_pool2d", "mp.avg_pool2d", "mp.global_avg_pool", "mp.lrn",
    "mp.reshape", "mp.expand", "mp.slice"}
# ... these where the axis they work along is not the batch's (every op with an `axis`, `axes`
# or `perm` is held to that), and matmul where its second operand is a weight or is batched.
_ALONG_AXIS = {"mp.softmax", "mp.log_softmax", "mp.layer_norm", "mp.rms_norm", "mp.argmax",
               "mp.reduce_sum", "mp.reduce_mean", "mp.reduce_max", "mp.concat", "mp.flatten",
               "mp.cumsum", "mp.split", "mp.transpose", "mp.matmul"}


def _rows_independent(f: Function, grown: Function, constants: set[int], factor: int) -> bool:
    """Whether every value of `grown` (f retyped by set-batch to `factor` times its batch)
    holds the rows of `factor` separate runs of f, stacked: the statistics of a group of
    samples are then those of the samples one by one. Conservative: an op this does not know
    to keep rows apart says no."""
    for n in f.ops():
        if n in constants or n == f.return_node:
            continue
        op = f.op(n)
        attrs = check_attrs(lookup(op), f.attrs_of(n))  # with the defaults
        for (old, new) in zip(f.types(n), grown.types(n)):
            if old.rank == 0 or new.shape[0] != factor * old.shape[0]:
                return False
        rank = f.operand_types(n)[0].rank if f.operands(n) else 0
        axes = [attr_int(attrs["axis"])] if "axis" in attrs else []
        if "axes" in attrs:
            axes += list(attr_ints(attrs["axes"])) or [0]  # no axes: all of them
        if any(rank and a % rank == 0 for a in axes) or (
                "perm" in attrs and attr_ints(attrs["perm"])[0] != 0):
            return False
        if op == "mp.matmul" and f.operands(n)[1][0] not in constants \
                and f.operand_types(n)[1].rank <= 2:
            return False  # a second operand that carries the batch: the rows meet in K
        if op not in _ROW_WISE and op not in _ALONG_AXIS:
            return False
    return True


def grouped_module(module: Module, func: str | None, factor: int) -> Module | None:
    """A copy of the module whose function takes `factor` batches stacked along the batch
    axis, or None where set-batch refuses or the rows would not stay apart."""
    f = module.function(func)
    if factor == 1:
        return module
    if any(f.type_of((a, 0)).rank == 0 or f.type_of((a, 0)).shape[0]
           != f.type_of((f.args[0], 0)).shape[0] for a in f.args):
        return None  # an argument that does not carry the batch cannot be stacked
    grown = copy.deepcopy(module)
    g = grown.function(func)
    try:
        set_batch(g, factor * f.type_of((f.args[0], 0)).shape[0])
    except DiagnosticError:
        return None
    return grown if _rows_independent(f, g, constant_nodes(f), factor) else None


# Samples per forward where the user does not say: measured on the 2-core VM (docs/benchmarks.md,
# issue 12), stacking samples pays where a model's tensors are small (per-op overhead: 15x on
# the digits MLP, 5% on ShuffleNet at 2.2 MB). With the conv of im2col-sized temporaries it
# cost where they left the cache (ResNet-50, 3.2 MB: 10% slower in pairs); the implicit-GEMM
# conv reads the input in place, and 256 ResNet-50 samples calibrate in 14.4 s in fours or
# eights against 15.9 s one at a time (peak 585-634 MiB against 546).
_GROUP_BYTES = 32 << 20


def auto_group(f: Function, count: int = 0) -> int:
    """As many batches as keep the function's largest non-constant float32 value within
    _GROUP_BYTES; given the `count` of batches, a group of at least half that many which
    divides it where there is one, so that every group has one size: a group of another size
    is another stacked module and reference, which reads the weights again (0.4 s for
    ResNet-50's 256 samples in tens, the last group six)."""
    constants = constant_nodes(f)
    largest = max((4 * math.prod(t.shape) for n in [*f.args, *f.ops()] if n not in constants
                   for t in f.types(n)), default=1)
    group = max(1, _GROUP_BYTES // max(largest, 1))
    if count > group and count % group:
        return next((g for g in range(group, (group + 1) // 2 - 1, -1) if count % g == 0),
                    group)
    return group


class _Calibration:
    """What every shard of one calibration shares (a dask worker receives it once): the module,
    the values counted, and per thread the reference it ran last (a reference holds the
    weights and takes a compile: built again only for a shard of another size)."""

    def __init__(self, module: Module, func: str | None, runner: ReferenceRunner,
                 weights: str | None, bins: int, histogram: bool):
        self.module, self.func, self.runner, self.weights = module, func, runner, weights
        self.bins, self.histogram = bins, histogram
        f = self.f = module.function(func)
        self.constants = constant_nodes(f)
        ret = f.return_node
        self.tracked = [(n, k) for n in [*f.args, *f.ops()] if n != ret and n not in
                        self.constants for k, t in enumerate(f.types(n))
                        if FORMATS[t.elem].is_float]
        relu_of = {(n, 0): f.operands(n)[0] for n in f.ops() if f.op(n) == "mp.relu"}
        self.derived: dict[Value, Value] = {}
        # Where a relu output needs channel maxima, its operand keeps them.
        self.channel = dict(channel_axes(f, self.constants))
        floats = set(self.tracked)
        for v in reversed(self.tracked):
            x = relu_of.get(v)
            if x is None or x not in floats or (v in self.channel and
                                                self.channel.get(x, self.channel[v])
                                                != self.channel[v]):
                continue
            self.derived[v] = x
            if v in self.channel:
                self.channel[x] = self.channel[v]
        self._references: dict[int, tuple[int, Callable[..., Any]]] = {}
        self._unstackable: set[int] = set()  # batch counts grouped_module refuses

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_references": {}}  # compiled code stays where it was built

    def reference(self, size: int) -> tuple[Callable[..., Any], bool]:
        """The reference that runs `size` batches, and whether it takes them stacked (where
        the model keeps rows apart) or one at a time."""
        if size in self._unstackable:
            size = 1
        me = threading.get_ident()
        held = self._references.get(me)
        if held is not None and held[0] == size:
            return held[1], size > 1
        grown = grouped_module(self.module, self.func, size) if size > 1 else self.module
        if grown is None:
            self._unstackable.add(size)
            return self.reference(1)
        self._references.pop(me, None)  # one at a time: each holds the weights
        reference = self.runner(grown, self.func, self.weights)
        self._references[me] = (size, reference)
        return reference, size > 1

    def run(self, shard: _Shard) -> dict[Value, TensorStats]:
        """The statistics of the shard's batches, per counted value."""
        f, constants, channel = self.f, self.constants, self.channel
        counted = {v: TensorStats(self.bins, self.histogram) for v in self.tracked
                   if v not in self.derived}
        nonfinite: set[Value] = set()  # values that held inf or NaN in some batch
        constant_values: list[ConstantValues] = []  # read only where a result is not finite

        def carries_nonfinite(u: Value) -> bool:
            if u in nonfinite or self.derived.get(u) in nonfinite:
                return True
            if u[0] not in constants or not FORMATS[f.type_of(u).elem].is_float:
                return False
            if not constant_values:
                constant_values.append(ConstantValues(self.module, f, self.weights))
            return not np.all(np.isfinite(constant_values[0].get(u)))

        def observe(v: Value, y: np.ndarray | None) -> None:
            s = counted.get(v)
            if s is None or y is None:  # None: no fp32 counterpart (an integer input)
                return
            if shard.rows is not None:  # every value carries the batch on axis 0
                y = y[:shard.rows]        # (check_partial_batch)
            before = s.nonfinite.copy()
            s.add(y, channel.get(v))
            if np.array_equal(s.nonfinite, before):
                return
            # Ranges are over the finite values; the inf and NaN are counted (mp.nonfinite).
            # An -inf mask given as data, or made from a -inf constant or operand, is
            # intentional; inf or NaN from finite operands is the fp32 reference overflowing,
            # and NaN in the data is no value at all.
            nonfinite.add(v)
            new = s.nonfinite - before
            if v[0] in f.args:
                if new[2]:
                    raise DiagnosticError.at(f.data(v[0])["loc"], (
                        f"calibration: argument {f.value_name(v)}: {int(new[2])} values are "
                        f"NaN (an infinity, such as an attention mask's -inf, is taken as it "
                        f"is)"))
                return
            if not any(carries_nonfinite(u) for u in f.operands(v[0])):
                raise DiagnosticError.at(f.data(v[0])["loc"], (
                    f"calibration: the fp32 reference of {f.value_name(v)}: "
                    f"{int(new.sum())} values are NaN or infinite from finite operands (the "
                    f"op overflows f32 on this data)"))

        reference, stacked = self.reference(len(shard.batches))
        if stacked:
            reference([np.concatenate(arrays) for arrays in zip(*shard.batches)], observe)
        else:
            for batch in shard.batches:
                reference(batch, observe)
        return counted


@dataclass
class _Shard:
    """Consecutive calibration batches that one task runs; `rows`: the padded last batch,
    alone, of which only that many leading rows are samples."""

    batches: list[list[np.ndarray]]
    rows: int | None = None


def _shard_stats(job: _Calibration, shard: _Shard) -> dict[Value, TensorStats]:
    return job.run(shard)


def _merge_stats(a: dict[Value, TensorStats], b: dict[Value, TensorStats]
                 ) -> dict[Value, TensorStats]:
    out = {}
    for v, s in a.items():
        out[v] = copy.deepcopy(s)  # a partial stays as it was (a dask task may run again)
        out[v].merge(b[v])
    return out


def calibrate_function(module: Module, func: str | None, batches: list[list[np.ndarray]],
                       runner: ReferenceRunner, weights: str | None, bins: int,
                       progress: Progress | None = None, histogram: bool = True,
                       group: int = 1, last_rows: int | None = None,
                       executor: Executor | None = None) -> dict[Value, TensorStats]:
    """Statistics of every float, non-constant value of the function over all batches
    (`histogram=False`: without the magnitude histograms, which only the clipping methods
    read). The batches are cut into shards of `group` consecutive batches, each run through
    the reference at once, stacked along the batch axis, where the model keeps their rows
    apart (`grouped_module`), and the shards run on `executor` (mplower.lowering.sharding:
    here, or on dask workers); their statistics merge exactly, so they are the same for any
    group and any number of workers. A relu's come from its operand's (TensorStats.relu),
    uncounted. With `last_rows`, only that many leading rows of the last batch are samples
    (the rest padding, `split_samples`): every value's statistics take those rows alone,
    which is exact where the model keeps rows apart (`check_partial_batch`)."""
    job = _Calibration(module, func, runner, weights, bins, histogram)
    whole = len(batches) - (last_rows is not None)
    shards = [_Shard(batches[r.start:r.stop]) for r in shard_ranges(whole, group)]
    if last_rows is not None:
        shards.append(_Shard(batches[-1:], last_rows))

    def done(i: int) -> None:
        if progress is not None:
            progress.update(len(shards[i].batches))

    counted = reduce_shards(executor, _shard_stats, job, shards, _merge_stats, tree=False,
                            done=done)
    return {v: counted[job.derived[v]].relu() if v in job.derived else counted[v]
            for v in job.tracked}


@register_pass
@dataclass
class Calibrate(Pass):
    """Run the fp32 reference over a calibration set and record each tensor's range.

    `data` is an .npz keyed by argument name (`x` for `%x`); each array is one batch of the
    argument's shape, a stack of such batches, or any number of samples along the batch axis
    (a partial last batch is padded, and its padding counts in no statistic; refused where
    the model mixes the rows of a batch). Statistics use a fixed, mergeable
    power-of-two histogram grid, so the ranges are bit-identical however the same samples are
    split into batches or ordered. Records `mp.range` (and `mp.calib`, `mp.observed`,
    `mp.tiny`, `mp.channel_absmax` where useful) on each value's producer; function arguments
    keep theirs in the function's `arg_attrs`. Methods: minmax, percentile (of |x|), entropy
    (TensorRT's KL search), mse. `group` batches at a time run through the reference stacked
    along the batch axis, where every op keeps the rows of a batch apart (otherwise one at a
    time); the ranges do not depend on it. Each group is a shard that `mplower opt --workers N`
    (or `--scheduler ADDRESS`) runs on a dask worker, with the same ranges, to the bit
    (docs/distributed.md). A progress bar is drawn on a terminal for long runs.
    """

    name: ClassVar[str] = "calibrate"
    statistics: ClassVar[dict[str, str]] = {
        "batches": "calibration batches run through the fp32 reference",
        "tensors-calibrated": "values given a calibrated range",
        "ranges-clipped": "values whose calibrated range is narrower than the observed one",
    }
    examples: ClassVar[tuple[str, ...]] = (
        "ir_examples/mlp.ir --pass='calibrate{data=ir_examples/mlp_inputs.npz}'",
        "ir_examples/mlp.ir --pass='calibrate{data=ir_examples/mlp_inputs.npz method=entropy}'",
    )
    data: str = option("", "calibration .npz keyed by argument name (a batch or a stack)")
    method: str = option("minmax", "range estimator: minmax, percentile, entropy or mse")
    percentile: float = option(99.99, "percentile of |x| kept by method=percentile")
    bins: int = option(2048, "histogram bins over [0, 2**e) (a power of two)")
    symmetric: bool = option(True, "entropy/mse: optimize for symmetric int8 (127 steps a side) "
                                   "or, when false, 255 steps over one-sided data")
    func: str = option("", "function to calibrate (default: main or the only one)")
    group: int = option(0, "batches run through the reference at once, stacked along the "
                           "batch axis where the model keeps rows apart (0: as many as keep "
                           "its largest value within 32 MiB; the ranges are the same for any "
                           "group, the memory grows with it)")

    def run(self, module: Module, ctx: PassContext) -> None:
        loc = module.loc
        if self.method not in METHODS:
            raise DiagnosticError.at(loc, f"calibrate: unknown method '{self.method}'; "
                                          f"expected one of {', '.join(METHODS)}")
        if self.bins < 2 or self.bins & (self.bins - 1):
            raise DiagnosticError.at(loc, f"calibrate: bins must be a power of two, "
                                          f"got {self.bins}")
        if self.group < 0:
            raise DiagnosticError.at(loc, f"calibrate: group must be 0 (automatic) or more, "
                                          f"got {self.group}")
        if not 0 < self.percentile <= 100:
            raise DiagnosticError.at(loc, f"calibrate: percentile must be in (0, 100], "
                                          f"got {self.percentile}")
        if not self.data:
            raise DiagnosticError.at(loc, "calibrate needs data=CALIB.npz (arrays keyed by "
                                          "argument name)")
        data_loc = Location(self.data, 0, 0)
        arrays = read_npz(Path(self.data), data_loc, "calibration data")
        func = self.func or None
        try:
            f = module.function(func)
        except KeyError as e:
            raise DiagnosticError(Diagnostic(loc, f"calibrate: {e.args[0]}")) from None
        batches, last_rows = split_samples(f, arrays, data_loc)
        if last_rows is not None:
            check_partial_batch(module, func, data_loc)
        if ctx.runner is None:
            raise DiagnosticError.at(loc, "calibrate runs the model: its caller must give "
                                          "PassContext a runner (mplower.backend.executor."
                                          "reference_runner; the mplower CLI does)")
        progress = Progress(len(batches), "calibrate")
        try:
            stats = calibrate_function(module, func, batches, ctx.runner, ctx.weights_path,
                                       self.bins, progress, histogram=self.method != "minmax",
                                       group=self.group or auto_group(f, len(batches)),
                                       last_rows=last_rows, executor=ctx.executor)
        finally:
            progress.close()
        axes = channel_axes(f, constant_nodes(f))
        for v, s in stats.items():
            if s.count == 0 and not s.has_nonfinite:
                continue
            lo, hi = record(f, v, s, self.method, self.percentile, self.symmetric,
                            channels=v in axes)
            ctx.stat("tensors-calibrated")
            if (lo, hi) != (s.min, s.max):
                ctx.stat("ranges-clipped")
        ctx.stat("batches", len(batches))
