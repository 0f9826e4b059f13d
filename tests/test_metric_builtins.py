"""Task metrics (issue 32, section 3): the built-ins against numpy computed here independently,
the `--metric` spec, and the user's function with its errors located in their file.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from mplower.ir.diagnostics import DiagnosticError
from mplower.lowering.metrics import (
    MetricSpecError,
    bits_per_token,
    class_accuracy,
    eval_samples,
    metric_figures,
    parse_metric,
    perplexity,
    topk_accuracy,
)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def test_top1_and_topk_match_numpy_argmax_and_argsort():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 7)).astype(np.float32)
    labels = rng.integers(0, 7, 50)
    assert topk_accuracy(logits, labels, 1) == np.mean(logits.argmax(1) == labels)
    order = np.argsort(-logits, axis=1, kind="stable")
    for k in (2, 3, 7):
        want = np.mean([labels[i] in order[i, :k] for i in range(50)])
        assert topk_accuracy(logits, labels, k) == want


def test_top1_breaks_ties_as_numpy_argmax_and_a_nan_row_is_wrong():
    logits = np.array([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0], [np.nan, 5.0, 0.0]], np.float32)
    assert topk_accuracy(logits, np.array([0, 1, 1]), 1) == 2 / 3  # argmax: the first tied
    assert topk_accuracy(logits, np.array([1, 2, 1]), 1) == 0.0
    assert topk_accuracy(logits, np.array([1, 2, 1]), 2) == 2 / 3


def test_ignore_index_and_mask_leave_positions_out():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 6, 5))  # (batch, seq, classes): classes last
    labels = rng.integers(0, 5, (4, 6))
    labels[0, :2] = -100
    mask = np.ones((4, 6), np.int64)
    mask[3, 4:] = 0
    keep = (labels != -100) & (mask != 0)
    want = np.mean((logits.argmax(-1) == labels)[keep])
    assert topk_accuracy(logits, labels, 1, mask=mask) == want


def test_class_axis_one_as_torch_lays_out_segmentation():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((3, 4, 6, 6))  # (N, C, H, W)
    labels = rng.integers(0, 4, (3, 6, 6))
    assert topk_accuracy(logits, labels, 1) == np.mean(logits.argmax(1) == labels)


def test_class_accuracy_per_class():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((60, 3))
    labels = rng.integers(0, 3, 60)
    got = class_accuracy(logits, labels)
    pred = logits.argmax(1)
    assert got == {c: float(np.mean(pred[labels == c] == c)) for c in range(3)}


def test_perplexity_and_bits_per_token_match_numpy_with_hf_shift_and_ignore_index():
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((2, 9, 11)) * 3).astype(np.float32)
    ids = rng.integers(0, 11, (2, 9))
    ids[1, 6:] = -100  # padding
    lp = _log_softmax(logits[:, :-1])
    tgt = ids[:, 1:]
    keep = tgt != -100
    nll = -np.take_along_axis(lp, np.where(keep, tgt, 0)[..., None], -1)[..., 0][keep]
    assert perplexity(logits, ids, shift=1) == pytest.approx(math.exp(nll.mean()), rel=1e-12)
    assert bits_per_token(logits, ids, shift=1) == pytest.approx(nll.mean() / math.log(2),
                                                                 rel=1e-12)
    # Unshifted: targets aligned with the logits' positions.
    lp = _log_softmax(logits)
    keep = ids != -100
    nll = -np.take_along_axis(lp, np.where(keep, ids, 0)[..., None], -1)[..., 0][keep]
    assert perplexity(logits, ids) == pytest.approx(math.exp(nll.mean()), rel=1e-12)


def test_perplexity_with_a_masked_vocabulary_entry_of_minus_inf():
    logits = np.array([[0.0, -np.inf, 0.0]])
    assert perplexity(logits, np.array([0])) == pytest.approx(2.0)


@pytest.mark.parametrize(("spec", "builtin", "options", "direction"), [
    ("top1:labels", "top1", {}, "max"),
    ("top5:labels", "topk", {"k": "5"}, "max"),
    ("topk:y,k=3,output=1", "topk", {"k": "3", "output": "1"}, "max"),
    ("class_accuracy:labels,mask=m", "class_accuracy", {"mask": "m"}, "max"),
    ("perplexity:input_ids,shift=1,ignore_index=0", "perplexity",
     {"shift": "1", "ignore_index": "0"}, "min"),
    ("bits_per_token:t", "bits_per_token", {}, "min"),
])
def test_builtin_specs(spec, builtin, options, direction):
    m = parse_metric(spec)
    assert (m.builtin, dict(m.options), m.direction) == (builtin, options, direction)


@pytest.mark.parametrize(("spec", "direction", "message"), [
    ("top1", None, "--metric takes NAME:ARRAY"),
    ("top1:", None, "--metric takes NAME:ARRAY"),
    ("top1:labels,k=3", None, "top1 takes options output=, mask=, axis=, ignore_index=;"),
    ("topk:labels,k=0", None, "k must be at least 1"),
    ("topk:labels,k=x", None, "k takes an integer"),
    ("perplexity:t", "max", "perplexity is better when lower (min)"),
    ("top1:labels", "up", "--metric-direction takes max or min"),
    ("no/such/file.py:fn", None, "no file no/such/file.py"),
    ("pkg-name:fn", None, "not a built-in"),
])
def test_bad_specs_are_usage_errors(spec, direction, message):
    with pytest.raises(MetricSpecError, match=None) as e:
        parse_metric(spec, direction)
    assert message in str(e.value)


def test_figures_drop_is_worse_in_the_metrics_direction():
    rng = np.random.default_rng(5)
    ref = rng.standard_normal((40, 4))
    labels = ref.argmax(1)
    noisy = ref + rng.standard_normal((40, 4))
    got = metric_figures(parse_metric("top1:labels"), {"output_0": noisy}, {"output_0": ref},
                         {"labels": labels})
    acc = float(np.mean(noisy.argmax(1) == labels))
    assert got == {"metric": acc, "metric_reference": 1.0, "metric_drop": 1.0 - acc,
                   "metric_drop_rel": 1.0 - acc}
    got = metric_figures(parse_metric("perplexity:labels"), {"output_0": noisy},
                         {"output_0": ref}, {"labels": labels})
    assert got["metric_drop"] == got["metric"] - got["metric_reference"] > 0


def test_eval_samples_flattens_arrays_stacked_like_the_batches():
    stacked = eval_samples({"labels": np.arange(12).reshape(3, 4), "vocab": np.arange(5)}, 3, 4)
    assert stacked["labels"].tolist() == list(range(12)) and stacked["vocab"].shape == (5,)
    flat = eval_samples({"labels": np.arange(12)}, 3, 4)
    assert flat["labels"].shape == (12,)
    one_row = eval_samples({"targets": np.zeros((3, 9))}, 3, 1)  # (samples, seq): kept
    assert one_row["targets"].shape == (3, 9)


def test_user_function_from_a_file_and_from_a_module(tmp_path, monkeypatch):
    (tmp_path / "mymetric.py").write_text(
        "import numpy as np\n"
        "def error_rate(outputs, eval):\n"
        "    return float(np.mean(outputs['output_0'].argmax(1) != eval['y']))\n")
    y = np.array([0, 1, 1])
    out = {"output_0": np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])}
    m = parse_metric(f"{tmp_path / 'mymetric.py'}:error_rate", "min")
    assert m.evaluate(out, {"y": y}).value == pytest.approx(1 / 3)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mymetric", raising=False)
    m = parse_metric("mymetric:error_rate", "min")
    assert (m.module, m.function, m.direction) == ("mymetric", "error_rate", "min")
    assert m.evaluate(out, {"y": y}).value == pytest.approx(1 / 3)


@pytest.mark.parametrize(("body", "line", "message"), [
    ("def f(outputs, eval):\n    x = 1\n    return outputs['nope']\n", 3,
     "f() raised KeyError: 'nope'"),
    ("def f(outputs, eval):\n    return 'high'\n", 0, "returned str 'high'; a metric returns"),
    ("def g(outputs, eval):\n    return 1.0\n", 0, "has no function 'f'"),
    ("def f(outputs, eval)\n    return 1.0\n", 1, "expected ':'"),
    ("raise RuntimeError('boom')\n", 1, "while importing it, f() raised RuntimeError: boom"),
])
def test_user_function_errors_are_located_and_name_the_function(tmp_path, body, line, message):
    path = tmp_path / f"m{abs(hash(body))}.py"
    path.write_text(body)
    with pytest.raises(DiagnosticError) as e:
        parse_metric(f"{path}:f").evaluate({"output_0": np.zeros(2)}, {})
    d = e.value.diagnostics[0]
    assert d.loc.file == str(path) and d.loc.line == line, d
    assert d.message.startswith(f"metric {path}:f: ") and message in d.message, d.message
