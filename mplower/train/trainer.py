"""One training step as a module: the gradient function, lowered by the plan, run by the executor.

The model's named float constants become arguments (the f32 master weights, fed every step),
`grad` appends the loss and the backward graph with the loss scale as the seed, and the
precision pipeline (`assign-precision`, `insert-casts`, or any `--pass-pipeline`) lowers the
whole step, forward and backward, as it would lower an inference module: with keep_io_types the
master weights arrive in f32 and are cast to the compute format inside, and the gradients
leave in f32. The executor counts what every rounding did; each count is attributed to a
forward op, in the forward or the backward phase (`mp.grad_of`, and a cast to the op whose
value it casts), which is the per-step incidence of docs/report.md. The optimizer and the loss
scale update run in f32 outside the module (mplower.train.optim, mplower.train.scaler).

Batches are drawn from a permutation of the samples per epoch, seeded; everything the step
computes is mplower's fixed-order arithmetic, so a run is the same bits for any thread count.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mplower.backend.executor import Program
from mplower.dialect.plan import GRAD_OF, TRAINABLE
from mplower.io.weights import Weights
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import Function, Module
from mplower.ir.types import DenseAttr
from mplower.numerics.formats import FLOATS
from mplower.numerics.metrics import finite_or_none
from mplower.numerics.rounding import Counts
from mplower.pass_manager import Pass, PassContext, PassManager
from mplower.passes.grad import Grad
from mplower.passes.set_batch import set_batch
from mplower.train.optim import Optimizer
from mplower.train.scaler import LossScaler

F32 = np.float32
SCALE_ARG = "loss_scale"  # the argument the backward seed (the loss scale) arrives in
FORWARD, BACKWARD = "forward", "backward"


def param_name(d: dict) -> str | None:
    """The parameter a constant (its node data) is, if training learns it: a float weight of
    the weights file (its key), or an inline constant marked `mp.trainable` (its SSA name)."""
    if d["op"] != "mp.constant" or d["types"][0].elem not in FLOATS:
        return None
    name = d["attrs"].get("name")
    if isinstance(name, str):
        return name
    return d["name"] if d["attrs"].get(TRAINABLE) is True else None


def promote_params(f: Function) -> dict[str, Any]:
    """Turn every parameter constant into an argument named after it; {name: type}."""
    params: dict[str, Any] = {}
    args: dict[str, int] = {}
    for n in f.ops():
        d = f.data(n)
        name = param_name(d)
        if name is None:
            continue
        if name not in args:
            args[name] = f.add_arg(name, d["types"][0], d["loc"])
            params[name] = d["types"][0]
        f.replace_all_uses((n, 0), (args[name], 0))
        f.erase(n)
    return params


def store_inline(module: Module, func: str | None, params: dict[str, np.ndarray]) -> set[str]:
    """Write the trained values of `module`'s inline trainable constants into their `value`;
    the names so stored (the rest belong in the weights file)."""
    f = module.function(func)
    stored = set()
    for n in f.ops():
        d = f.data(n)
        k = param_name(d)
        if k is not None and isinstance(d["attrs"].get("value"), DenseAttr):
            t = d["types"][0]
            f.set_attr(n, "value", DenseAttr(params[k].astype(F32).reshape(t.shape), t))
            stored.add(k)
    return stored


def _phases(f: Function) -> dict[int, tuple[str, str]]:
    """node -> (the forward op or argument its counts belong to, phase)."""
    out: dict[int, tuple[str, str]] = {}
    for a in f.args:
        name = f.data(a)["name"]
        out[a] = (f"%{name}", BACKWARD if name == SCALE_ARG else FORWARD)
    for n in f.ops():
        d = f.data(n)
        of = d["attrs"].get(GRAD_OF)
        if of is not None:
            out[n] = (f"%{of}", BACKWARD)
        elif d["op"] == "mp.cast":
            out[n] = out[f.operands(n)[0][0]]
        else:
            out[n] = (f"%{d['name']}", FORWARD)
    return out


class StepFailed(ValueError):
    """A training step that cannot go on: what went wrong; `fit` adds which step."""


def _nonfinite(a: np.ndarray) -> int:
    return int(a.size - np.count_nonzero(np.isfinite(a)))


def _listed(bad: dict[str, int]) -> str:
    """`w: 3 values, b: 1 value`."""
    return ", ".join(f"{k}: {n} value{'s' * (n != 1)}" for k, n in bad.items())


def _counts(c: Counts) -> dict[str, int]:
    return {"overflow": c.overflow, "underflow": c.underflow, "nan": c.nan}


@dataclass
class Trainer:
    """The compiled training step and evaluation of one model, and its f32 state."""

    module: Module
    loss: str
    labels: str
    pipeline: list[Pass]
    optimizer: Optimizer
    scaler: LossScaler
    func: str | None = None
    weights_path: str | None = None
    # Batch size of the step and the evaluation; None: the model's own (set-batch otherwise).
    batch: int | None = None
    params: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        model = self.module
        if self.batch is not None:
            model = copy.deepcopy(self.module)
            set_batch(model.function(self.func), self.batch)
        # Copies, not reparsed prints: every refusal below must point into the source.
        train = copy.deepcopy(model)
        f = train.function(self.func)
        types = promote_params(f)
        if not types:
            raise DiagnosticError.at(f.loc, f"@{f.name} has nothing to train: no float constant "
                                            "of the weights file (mp.weights) and none marked "
                                            f"{TRAINABLE}")
        weights = Weights(self.module, self.weights_path)
        source = self.module.function(self.func)
        initial = {}
        for n in source.ops():
            d = source.data(n)
            k = param_name(d)
            if k is not None and k not in initial:
                inline = d["attrs"].get("value")
                initial[k] = (inline.array if isinstance(inline, DenseAttr) else
                              weights.get(k, types[k], d["loc"])).astype(F32)
        # In the order of the gradients the step returns (grad's wrt).
        self.params = {k: initial[k] for k in types}
        grad = Grad(loss=self.loss, labels=self.labels, wrt=",".join(types), seed=SCALE_ARG)
        ctx = PassContext(weights_path=self.weights_path)
        PassManager([grad, *self.pipeline]).run(train, ctx)
        self.step_module = train
        self.program = Program(train, self.func, self.weights_path)
        phases = _phases(train.function(self.func))
        self._owner = [phases[s.node] for s in self.program.steps]
        forward = copy.deepcopy(model)
        promote_params(forward.function(self.func))
        PassManager(list(self.pipeline)).run(forward, PassContext(weights_path=self.weights_path))
        self.eval_program = Program(forward, self.func, self.weights_path)
        first = self.eval_program.arg_types[0]
        self.batch = first.shape[0] if first.rank else 1
        self.label_type = self.program.arg_types[self.program.arg_names.index(self.labels)]

    def targets(self, y: np.ndarray) -> np.ndarray:
        """Labels as the loss takes them: class indices one-hot for cross_entropy."""
        if self.loss == "cross_entropy" and y.ndim == 1:
            classes = self.label_type.shape[-1]
            if y.dtype.kind not in "iu" or y.min() < 0 or y.max() >= classes:
                raise ValueError(f"labels '{self.labels}' must be class indices in "
                                 f"[0, {classes})")
            return np.eye(classes, dtype=F32)[y]
        want = list(self.label_type.shape[1:])
        if list(y.shape[1:]) != want:  # else the step refuses it as a model input, unnamed
            hint = " (class indices go with --loss cross_entropy)" if y.ndim == 1 else ""
            raise ValueError(f"labels '{self.labels}' hold {list(y.shape[1:])} per sample; "
                             f"{self.loss} needs the output's {want}{hint}")
        return y.astype(F32)

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """One step on one batch (arguments by name, targets as `targets` made them).

        A step whose gradients hold inf or NaN is skipped under dynamic loss scaling (the
        scale backs off, as GradScaler); without it, or when the loss itself is not finite
        (the forward pass overflowed: no scale changes that), or when the update makes a
        weight inf or NaN, it raises StepFailed and leaves the weights as they were."""
        scale = self.scaler.scale
        feeds = {**batch, **self.params, SCALE_ARG: np.asarray(scale, F32)}
        result = self.program.run([feeds[n] for n in self.program.arg_names], reference=False)
        loss = float(result.outputs[0])
        if not np.isfinite(loss):
            largest = max(float(np.max(np.abs(w), initial=0.0)) for w in self.params.values())
            raise StepFailed(f"the loss is {loss}: the forward pass overflowed or met a NaN "
                             f"(the largest |weight| is {largest:.3g}), which no loss scale "
                             f"changes")
        inv = F32(1) / F32(scale)  # GradScaler unscales by multiplying with 1/scale in f32
        grads = {k: np.asarray(g, F32) * inv for k, g in zip(self.params, result.outputs[1:])}
        found_inf = not all(np.isfinite(g).all() for g in grads.values())
        if found_inf and not self.scaler.dynamic:
            bad = {k: _nonfinite(g) for k, g in grads.items() if _nonfinite(g)}
            raise StepFailed(f"the gradients hold inf or NaN ({_listed(bad)}) and there is no "
                             f"dynamic loss scaling to skip the step (--loss-scale dynamic)")
        skipped = self.scaler.update(found_inf)
        if not skipped:
            updated = dict(self.params)
            self.optimizer.step(updated, grads)
            bad = {k: _nonfinite(w) for k, w in updated.items() if _nonfinite(w)}
            if bad:
                raise StepFailed(f"the optimizer's update makes weights inf or NaN "
                                 f"({_listed(bad)}); a smaller lr keeps them finite")
            self.params.update(updated)
        totals = {FORWARD: Counts(), BACKWARD: Counts()}
        per_op: dict[str, dict[str, Counts]] = {}
        for (key, phase), res in zip(self._owner, result.ops):
            c = res.counts
            if c.overflow or c.underflow or c.nan:
                totals[phase] += c
                slot = per_op.setdefault(key, {FORWARD: Counts(), BACKWARD: Counts()})
                slot[phase] += c
        return {"loss": finite_or_none(float(result.outputs[0])), "loss_scale": float(scale),
                "skipped": skipped, "grads_finite": not found_inf,
                FORWARD: _counts(totals[FORWARD]), BACKWARD: _counts(totals[BACKWARD]),
                "ops": [{"name": k, FORWARD: _counts(v[FORWARD]), BACKWARD: _counts(v[BACKWARD])}
                        for k, v in per_op.items()]}

    def predict(self, x: np.ndarray) -> np.ndarray:
        """The model's first result for every sample of `x` with the current weights, in the
        plan's formats."""
        return predict(self.eval_program, x, self.params)

    def class_labels(self, y: np.ndarray) -> np.ndarray:
        """Evaluation labels as class indices: given so, or the argmax of rows of scores
        (one-hot) as wide as the output; anything else is a ValueError."""
        classes = self.label_type.shape[-1]
        if y.ndim == 2 and y.shape[1] == classes:
            y = np.argmax(y, axis=-1)
        if y.ndim != 1 or y.dtype.kind not in "iu":
            raise ValueError(f"labels '{self.labels}' must be class indices or rows of "
                             f"{classes} scores, got {list(y.shape[1:])} {y.dtype} per sample")
        if y.size and (y.min() < 0 or y.max() >= classes):
            raise ValueError(f"labels '{self.labels}' must be class indices in [0, {classes})")
        return y

    def accuracy(self, x: np.ndarray, classes: np.ndarray) -> float:
        """Top-1 accuracy against class indices (`class_labels`)."""
        return float(np.mean(np.argmax(self.predict(x), axis=-1) == classes))


def predict(program: Program, x: np.ndarray,
            feeds: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """The first result of `program` for every sample of `x`, fed to its first argument batch
    by batch (the last batch padded with zeros), the other arguments from `feeds`."""
    name, b = program.arg_names[0], program.arg_types[0].shape[0]
    outs = []
    for i in range(0, len(x), b):
        chunk = x[i:i + b]
        pad = np.zeros((b - len(chunk),) + chunk.shape[1:], chunk.dtype)
        args = {name: np.concatenate([chunk, pad]) if len(pad) else chunk, **(feeds or {})}
        y = program.run([args[n] for n in program.arg_names], reference=False).outputs[0]
        outs.append(y[:len(chunk)])
    return np.concatenate(outs)


def batches(n: int, size: int, steps: int, seed: int) -> list[np.ndarray]:
    """The sample indices of each step: consecutive slices of a seeded permutation per epoch,
    the last incomplete slice of an epoch dropped."""
    rng = np.random.default_rng(seed)
    per_epoch = n // size
    if per_epoch == 0:
        raise ValueError(f"the data has {n} samples, fewer than one batch of {size}")
    out: list[np.ndarray] = []
    while len(out) < steps:
        order = rng.permutation(n)
        out += [order[i * size:(i + 1) * size] for i in range(per_epoch)]
    return out[:steps]


def fit(trainer: Trainer, data: dict[str, np.ndarray], steps: int, seed: int,
        progress: Callable[[int, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """`steps` training steps on `data` (arrays by argument name and the labels' name); one
    report row per step. Data holding inf or NaN is a ValueError before the first step; a
    step that fails (Trainer.step) is a StepFailed naming it."""
    names = [n for n in trainer.program.arg_names if n in data]
    for n in names:  # before any step: a NaN sample would stop the run when drawn
        a = np.asarray(data[n])
        if a.dtype.kind == "f" and (bad := _nonfinite(a)):
            rows_bad = np.unique(np.nonzero(~np.isfinite(a))[0]) if a.ndim else []
            raise ValueError(f"'{n}' holds {bad} inf or NaN value{'s' * (bad != 1)} (in "
                             f"sample{'s' * (len(rows_bad) != 1)} "
                             f"{', '.join(map(str, rows_bad[:5]))}"
                             f"{', ...' if len(rows_bad) > 5 else ''}); training needs "
                             f"finite data")
    targets = trainer.targets(data[trainer.labels])
    rows = []
    for i, idx in enumerate(batches(len(targets), trainer.batch, steps, seed)):
        feeds = {n: data[n][idx] for n in names if n != trainer.labels}
        feeds[trainer.labels] = targets[idx]
        try:
            row = {"step": i, **trainer.step(feeds)}
        except StepFailed as e:
            raise StepFailed(f"step {i} (of {steps}, counted from 0): {e}; stopped there, "
                             f"nothing is written") from None
        rows.append(row)
        if progress is not None:
            progress(i, row)
    return rows
