"""Task metrics: how good a plan's outputs are by the user's own measure (docs/metrics.md).

Guardrails such as rel-L2 compare a plan with the fp32 model; a task metric compares both with
the truth (labels, next tokens) or with whatever the user's function measures. A `Metric` is
either a built-in over the evaluation arrays (`top1:labels`, `topk:labels,k=5`,
`class_accuracy:labels`, `perplexity:targets`, `bits_per_token:targets`) or the user's function
named on the command line (`pkg.module:function`, `path/file.py:function`), called as
`function(outputs, eval) -> float`. Only a command line names code to run: a sheet or a model
never does (mplower.lowering.policy refuses a metric named in a sheet). `metric_figures` gives
the metric of a plan's outputs and of the fp32 reference, and the drop between them, as the
summary keys the `min_metric` / `max_metric` / `max_metric_drop` / `max_metric_drop_rel`
guardrails read (mplower.report.run.evaluate_guardrails).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mplower.dialect.plan import OUTPUT_NAMES
from mplower.ir.diagnostics import DiagnosticError, Location, did_you_mean
from mplower.ir.graph import Function

MAX, MIN = "max", "min"
DIRECTIONS = (MAX, MIN)
# HF's convention: a label of -100 is a position the loss leaves out (padding, the prompt).
IGNORE_INDEX = -100


# The user's functions loaded in this process, by (path, module, function): a Metric stays plain
# data that pickles (a dask worker loads the function itself on first use).
_LOADED: dict[tuple[str | None, str | None, str | None], Callable[..., Any]] = {}


class MetricSpecError(ValueError):
    """A `--metric` or `--metric-direction` that cannot be read (the CLI's usage error)."""


@dataclass(frozen=True)
class MetricValue:
    """A metric's value and, for some built-ins, a breakdown (class -> accuracy)."""

    value: float
    detail: dict[str, float] | None = None


# ---- the built-ins -------------------------------------------------------------------------

def _class_axis(logits: np.ndarray, labels: np.ndarray, axis: int | None) -> int:
    """The axis of `logits` that holds the classes: given, or the one whose removal leaves the
    labels' shape, the last first (HF's (batch, seq, vocab)), then axis 1 (torch's (N, C, d))."""
    if axis is not None:
        if not -logits.ndim <= axis < logits.ndim:
            raise ValueError(f"axis={axis} is out of range for outputs of rank {logits.ndim}")
        return axis % logits.ndim
    for a in sorted(range(logits.ndim), key=lambda a: (a != logits.ndim - 1, a != 1, a)):
        if logits.shape[:a] + logits.shape[a + 1:] == labels.shape:
            return a
    raise ValueError(f"the labels' shape {list(labels.shape)} is not the outputs' shape "
                     f"{list(logits.shape)} without a class axis")


def _rows(logits: np.ndarray, labels: np.ndarray, mask: np.ndarray | None, axis: int | None,
          ignore_index: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores of every counted position, shape (P, C), in float64; its label, shape (P,)):
    positions whose label is `ignore_index`, or whose mask is 0, are left out."""
    logits = np.asarray(logits)
    labels = np.asarray(labels)
    if logits.dtype.kind not in "fiu":
        raise ValueError(f"the outputs are {logits.dtype}, not numbers")
    if labels.dtype.kind not in "iub":
        raise ValueError(f"the labels are {labels.dtype}; class indices are integers")
    a = _class_axis(logits, labels, axis)
    n_classes = logits.shape[a]
    rows = np.moveaxis(logits.astype(np.float64), a, -1).reshape(-1, n_classes)
    lab = labels.astype(np.int64).ravel()
    keep = lab != ignore_index
    if mask is not None:
        mask = np.asarray(mask)
        if mask.shape != labels.shape:
            raise ValueError(f"the mask has shape {list(mask.shape)}, the labels "
                             f"{list(labels.shape)}")
        keep &= mask.ravel() != 0
    bad = keep & ((lab < 0) | (lab >= n_classes))
    if np.any(bad):
        raise ValueError(f"label {int(lab[bad][0])} is not a class index (0 to "
                         f"{n_classes - 1}, or {ignore_index} to leave a position out)")
    if not np.any(keep):
        raise ValueError("no position is counted (every label is the ignore index or masked)")
    return rows[keep], lab[keep]


def _rank(rows: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """The label's place in a stable descending sort of each row: the classes scored higher,
    and those scored the same at a lower index (numpy argmax's choice among ties). A row with a
    NaN ranks last (never counted correct)."""
    own = rows[np.arange(len(rows)), labels][:, None]
    before = np.arange(rows.shape[1])[None, :] < labels[:, None]
    with np.errstate(invalid="ignore"):
        rank = np.count_nonzero((rows > own) | ((rows == own) & before), axis=1)
    return np.where(np.isnan(rows).any(axis=1), rows.shape[1], rank)


def topk_accuracy(logits: np.ndarray, labels: np.ndarray, k: int = 1, *,
                  mask: np.ndarray | None = None, axis: int | None = None,
                  ignore_index: int = IGNORE_INDEX) -> float:
    """Fraction of counted positions whose label is among the `k` highest scores (ties go to
    the lower class index, as numpy's argmax)."""
    rows, lab = _rows(logits, labels, mask, axis, ignore_index)
    return float(np.mean(_rank(rows, lab) < k))


def class_accuracy(logits: np.ndarray, labels: np.ndarray, *, mask: np.ndarray | None = None,
                   axis: int | None = None, ignore_index: int = IGNORE_INDEX
                   ) -> dict[int, float]:
    """Top-1 accuracy of each class present in the labels (class -> accuracy)."""
    rows, lab = _rows(logits, labels, mask, axis, ignore_index)
    right = _rank(rows, lab) < 1
    return {int(c): float(np.mean(right[lab == c])) for c in np.unique(lab)}


def token_nll(logits: np.ndarray, targets: np.ndarray, *, mask: np.ndarray | None = None,
              axis: int | None = None, ignore_index: int = IGNORE_INDEX,
              shift: int = 0) -> float:
    """Mean negative log-likelihood (nats) of the targets under softmax(logits), over counted
    positions. `shift=1` is HF's causal-LM convention: logits at position t predict the label
    at t + 1 along axis 1 (the labels are the input ids)."""
    logits, targets = np.asarray(logits), np.asarray(targets)
    if shift:
        if logits.ndim < 2 or targets.ndim < 2:
            raise ValueError("shift needs a sequence axis (axis 1) in the outputs and targets")
        logits, targets = logits[:, :-shift], targets[:, shift:]
        mask = None if mask is None else np.asarray(mask)[:, shift:]
    rows, lab = _rows(logits, targets, mask, axis, ignore_index)
    top = rows.max(axis=1, keepdims=True)
    # log-softmax in float64, shifted by the row maximum; a -inf score (a masked vocabulary
    # entry) contributes exp(-inf) = 0.
    with np.errstate(invalid="ignore", over="ignore"):
        log_z = top[:, 0] + np.log(np.sum(np.exp(rows - top), axis=1))
    nll = log_z - rows[np.arange(len(rows)), lab]
    return float(np.mean(nll))


def perplexity(logits: np.ndarray, targets: np.ndarray, **options: Any) -> float:
    """exp(mean token NLL): `token_nll`'s options."""
    with np.errstate(over="ignore"):
        return float(np.exp(token_nll(logits, targets, **options)))


def bits_per_token(logits: np.ndarray, targets: np.ndarray, **options: Any) -> float:
    """Mean token NLL in bits: `token_nll`'s options."""
    return token_nll(logits, targets, **options) / math.log(2)


@dataclass(frozen=True)
class Builtin:
    direction: str
    options: tuple[str, ...]  # the `key=value` options it takes besides output/mask/axis


BUILTINS = {
    "top1": Builtin(MAX, ()),
    "topk": Builtin(MAX, ("k",)),
    "class_accuracy": Builtin(MAX, ()),
    "perplexity": Builtin(MIN, ("shift",)),
    "bits_per_token": Builtin(MIN, ("shift",)),
}
_COMMON = ("output", "mask", "axis", "ignore_index")


# ---- the metric as the command line names it -----------------------------------------------

@dataclass(frozen=True)
class Metric:
    """A task metric: a built-in (`builtin`, reading the evaluation array `array`) or the user's
    function (`module` and `function`; `path` when the module is a file). `spec` is what the
    user wrote, for messages and reports."""

    spec: str
    direction: str
    builtin: str | None = None
    array: str | None = None
    options: tuple[tuple[str, str], ...] = ()
    module: str | None = None
    path: str | None = None  # absolute
    function: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"spec": self.spec, "direction": self.direction}

    def evaluate(self, outputs: Mapping[str, np.ndarray],
                 eval: Mapping[str, np.ndarray]) -> MetricValue:
        """The metric of `outputs` (`output_0`, ... and any ONNX names) on the evaluation
        arrays `eval`; a problem is a located diagnostic naming the metric."""
        if self.builtin is not None:
            return self._builtin(outputs, eval)
        fn = self.load()
        try:
            got = fn(dict(outputs), eval)
        except Exception as e:  # noqa: BLE001  (the user's code: any bug of theirs, located)
            raise self._raised(e) from None
        if isinstance(got, (bool, np.bool_)) or not isinstance(got, (int, float, np.number)) \
                and not (isinstance(got, np.ndarray) and got.ndim == 0
                         and got.dtype.kind in "fiu"):
            raise _located(self._loc(), (
                f"metric {self.spec}: returned {type(got).__name__} {_short(got)}; a metric "
                f"returns one number (a float)"))
        return MetricValue(float(got))

    def check_eval(self, eval: Mapping[str, np.ndarray]) -> None:
        """Before any work: the evaluation arrays a built-in reads are there."""
        for name in (self.array, dict(self.options).get("mask")):
            if name is not None and name not in eval:
                raise _located(Location(f"--metric {self.spec}", 0, 0), (
                    f"metric {self.spec}: the evaluation data has no array '{name}' (it has: "
                    f"{', '.join(sorted(eval)) or 'none'}){did_you_mean(name, eval)}"))

    def _builtin(self, outputs: Mapping[str, np.ndarray],
                 eval: Mapping[str, np.ndarray]) -> MetricValue:
        opts = dict(self.options)
        out = opts.get("output", "0")
        key = f"output_{out}" if out.isdigit() else out
        where = Location(f"--metric {self.spec}", 0, 0)
        if key not in outputs:
            have = ", ".join(k for k in outputs if not k.startswith("output_")) or "none"
            raise _located(where, (
                f"metric {self.spec}: the model has no output '{out}' (outputs are numbered "
                f"from 0; ONNX names: {have})"))
        self.check_eval(eval)
        kw: dict[str, Any] = {"mask": eval[opts["mask"]] if "mask" in opts else None,
                              "axis": int(opts["axis"]) if "axis" in opts else None,
                              "ignore_index": int(opts.get("ignore_index", IGNORE_INDEX))}
        y, labels = np.asarray(outputs[key]), np.asarray(eval[self.array])
        try:
            if self.builtin == "top1":
                return MetricValue(topk_accuracy(y, labels, 1, **kw))
            if self.builtin == "topk":
                return MetricValue(topk_accuracy(y, labels, int(opts.get("k", 5)), **kw))
            if self.builtin == "class_accuracy":
                per = class_accuracy(y, labels, **kw)
                # The guardrail holds the class the plan hurts most, not an average over them.
                return MetricValue(min(per.values()), {str(c): a for c, a in per.items()})
            fn = perplexity if self.builtin == "perplexity" else bits_per_token
            return MetricValue(fn(y, labels, shift=int(opts.get("shift", 0)), **kw))
        except ValueError as e:
            raise _located(where, f"metric {self.spec}: {e}") from None

    def load(self) -> Callable[..., Any]:
        """The user's function, imported once (a file is loaded as a module of its own)."""
        key = (self.path, self.module, self.function)
        if key in _LOADED:
            return _LOADED[key]
        loc = self._loc()
        try:
            if self.path is not None:
                name = f"mplower_metric_{abs(hash(self.path)):x}"
                spec = importlib.util.spec_from_file_location(name, self.path)
                if spec is None or spec.loader is None:
                    raise _located(loc, f"metric {self.spec}: cannot load {self.path} "
                                                  f"as a Python module")
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
            else:
                module = importlib.import_module(self.module)
        except DiagnosticError:
            raise
        except SyntaxError as e:
            raise _located(Location(e.filename or loc.file, e.lineno or 0,
                                              e.offset or 0),
                                     f"metric {self.spec}: {e.msg}") from None
        except ModuleNotFoundError as e:
            raise _located(loc, f"metric {self.spec}: cannot import "
                                          f"'{self.module}': {e}") from None
        except Exception as e:  # noqa: BLE001  (importing the user's module ran their code)
            raise self._raised(e, "while importing it, ") from None
        fn = getattr(module, self.function, None)
        if not callable(fn):
            names = [n for n in vars(module) if callable(getattr(module, n))
                     and not n.startswith("_")]
            raise _located(loc, (
                f"metric {self.spec}: {self.path or self.module} has no function "
                f"'{self.function}'{did_you_mean(self.function, names)}"))
        _LOADED[key] = fn
        return fn

    def _loc(self) -> Location:
        return Location(self.path or f"--metric {self.spec}", 0, 0)

    def _raised(self, e: Exception, when: str = "") -> DiagnosticError:
        """A diagnostic at the line of the user's code that raised `e` (the innermost frame in
        their file, or their module's), naming the metric: no traceback."""
        frames = traceback.extract_tb(e.__traceback__)
        mine = [f for f in frames if self.path is not None and Path(f.filename) == Path(self.path)
                or self.module is not None and _in_module(f.filename, self.module)]
        frame = (mine or frames or [None])[-1]
        loc = (Location(frame.filename, frame.lineno or 0, 1) if frame is not None
               else self._loc())
        return _located(loc, (
            f"metric {self.spec}: {when}{self.function}() raised {type(e).__name__}: {e}"))


def _located(loc: Location, message: str) -> DiagnosticError:
    """A diagnostic at `loc` shown against the lines of its own file (the user's Python file),
    never the model's, whose text the CLI would show otherwise."""
    err = DiagnosticError.at(loc, message)
    try:
        err.source = Path(loc.file).read_text(encoding="utf-8", errors="replace")
    except OSError:  # `--metric top1:labels`: no file, no lines to show
        err.source = ""
    return err


def _in_module(filename: str, module: str) -> bool:
    mod = sys.modules.get(module)
    return bool(mod is not None and getattr(mod, "__file__", None)
                and Path(filename) == Path(mod.__file__))


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_metric(spec: str, direction: str | None = None, cwd: Path | None = None) -> Metric:
    """The metric `--metric SPEC` names, with `--metric-direction` (required for the user's
    function unless it is max, the default; a built-in's direction is its own).

    `NAME:ARRAY[,key=value]...` with NAME a built-in (`top5` is `topk` with k=5);
    `pkg.module:function`; `path/to/file.py:function` (relative to `cwd`)."""
    if direction is not None and direction not in DIRECTIONS:
        raise MetricSpecError(f"--metric-direction takes max or min, got '{direction}'")
    head, sep, rest = spec.rpartition(":")
    if not sep or not head or not rest:
        raise MetricSpecError(f"--metric takes NAME:ARRAY (a built-in: "
                              f"{', '.join(BUILTINS)}), pkg.module:function or "
                              f"file.py:function; got '{spec}'")
    first, _, after = spec.partition(":")  # a built-in's name is before the first colon
    if first in BUILTINS or _topk(first):
        return _builtin_metric(spec, first, after, direction)
    if head.endswith(".py") or "/" in head or "\\" in head:
        path = Path(head)
        path = (cwd or Path.cwd()) / path if not path.is_absolute() else path
        if not path.is_file():
            raise MetricSpecError(f"--metric {spec}: no file {head}")
        if not rest.isidentifier():
            raise MetricSpecError(f"--metric {spec}: '{rest}' is not a function name")
        return Metric(spec, direction or MAX, path=str(path.resolve()), function=rest)
    if not all(p.isidentifier() for p in head.split(".")) or not rest.isidentifier():
        raise MetricSpecError(
            f"--metric {spec}: not a built-in ({', '.join(BUILTINS)}"
            f"{did_you_mean(first, BUILTINS)}) nor pkg.module:function nor file.py:function")
    return Metric(spec, direction or MAX, module=head, function=rest)


def _topk(name: str) -> bool:
    return name.startswith("top") and name[3:].isdigit() and int(name[3:]) >= 1


def _builtin_metric(spec: str, name: str, rest: str, direction: str | None) -> Metric:
    array, *pairs = rest.split(",")
    if not array:
        raise MetricSpecError(f"--metric {spec}: {name} needs the evaluation array it reads "
                              f"({name}:labels)")
    options: dict[str, str] = {}
    if _topk(name) and name != "top1":
        name, options["k"] = "topk", name[3:]
    b = BUILTINS[name]
    for pair in pairs:
        key, eq, value = (s.strip() for s in pair.partition("="))
        allowed = (*_COMMON, *b.options)
        if not eq or key not in allowed:
            raise MetricSpecError(f"--metric {spec}: {name} takes options "
                                  f"{', '.join(k + '=' for k in allowed)}; got '{pair}'"
                                  f"{did_you_mean(key, allowed)}")
        if key in ("k", "shift", "axis", "ignore_index") and not _is_int(value):
            raise MetricSpecError(f"--metric {spec}: {key} takes an integer, got '{value}'")
        if key == "k" and int(value) < 1:
            raise MetricSpecError(f"--metric {spec}: k must be at least 1, got {value}")
        if key == "shift" and int(value) < 0:
            raise MetricSpecError(f"--metric {spec}: shift must be 0 or more, got {value}")
        options[key] = value
    if direction is not None and direction != b.direction:
        raise MetricSpecError(f"--metric-direction {direction}: {name} is better when "
                              f"{'higher' if b.direction == MAX else 'lower'} "
                              f"({b.direction}); leave --metric-direction out")
    return Metric(spec, b.direction, builtin=name, array=array,
                  options=tuple(sorted(options.items())))


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit()


# ---- the figures the guardrails read -------------------------------------------------------

METRIC_GUARDRAILS = ("min_metric", "max_metric", "max_metric_drop", "max_metric_drop_rel")
# The summary keys `metric_figures` writes (and the metric guardrails read).
METRIC_FIGURES = ("metric", "metric_reference", "metric_drop", "metric_drop_rel")


def eval_samples(arrays: Mapping[str, np.ndarray], batches: int, rows: int | None
                 ) -> dict[str, np.ndarray]:
    """The evaluation arrays with one row per sample, as the outputs are stacked over the
    batches: an array stacked like the inputs, (batches, rows, ...), is flattened to
    (batches * rows, ...); any other array (labels already (batches * rows,), a vocabulary
    table) is as it was."""
    out = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        if (rows is not None and rows != 1 and a.ndim >= 2
                and a.shape[:2] == (batches, rows)):
            a = a.reshape(batches * rows, *a.shape[2:])
        out[name] = a
    return out


def recorded_output_names(f: Function) -> list[str] | None:
    """The function's `mp.output_names` (from ONNX) when they are well formed, else None."""
    recorded = f.attrs.get(OUTPUT_NAMES)
    if isinstance(recorded, tuple) and all(isinstance(k, str) and k for k in recorded):
        return list(recorded)
    return None


def output_arrays(outputs: Sequence[Any], names: Sequence[str] | None = None
                  ) -> dict[str, np.ndarray]:
    """The outputs as a metric receives them: `output_0`, ... and, where the model recorded
    them (`mp.output_names`, from ONNX), the same arrays under those names too."""
    out = {f"output_{i}": np.asarray(y) for i, y in enumerate(outputs)}
    for name, y in zip(names or (), outputs):
        out.setdefault(name, np.asarray(y))
    return out


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def metric_figures(metric: Metric, outputs: Mapping[str, np.ndarray],
                   reference: Mapping[str, np.ndarray] | None,
                   eval: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The summary keys of a task metric: `metric` (the plan's), `metric_reference` (the fp32
    reference's, None without one), `metric_drop` (how much worse the plan is, in the metric's
    units: reference - plan for a max metric, plan - reference for a min one) and
    `metric_drop_rel` (the drop over |reference|). Non-finite values are None."""
    got = metric.evaluate(outputs, eval)
    ref = metric.evaluate(reference, eval) if reference is not None else None
    drop = rel = None
    if ref is not None and math.isfinite(got.value) and math.isfinite(ref.value):
        drop = ref.value - got.value if metric.direction == MAX else got.value - ref.value
        rel = drop / abs(ref.value) if ref.value else None
    out: dict[str, Any] = {"metric": _finite(got.value),
                           "metric_reference": _finite(ref.value) if ref else None,
                           "metric_drop": drop, "metric_drop_rel": rel}
    if got.detail is not None:
        out["metric_detail"] = got.detail
        out["metric_reference_detail"] = ref.detail if ref else None
    return out
