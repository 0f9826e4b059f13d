"""Task metrics of the real-model benchmark, in the form `mplower --metric` calls:
`function(outputs, eval) -> float`, where `outputs` maps the model's output names to arrays
and `eval` is the evaluation npz (inputs and labels). Each is the metric its task is judged by.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def _first(outputs: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.asarray(next(iter(outputs.values())), np.float32)


def accuracy(outputs: Mapping[str, np.ndarray], eval: Mapping[str, np.ndarray]) -> float:
    """Top-1 accuracy of the first output's scores against `labels`."""
    scores = _first(outputs)
    return float(np.mean(scores.reshape(len(eval["labels"]), -1).argmax(1) == eval["labels"]))


def vad_accuracy(outputs: Mapping[str, np.ndarray], eval: Mapping[str, np.ndarray]) -> float:
    """Share of 32 ms chunks whose speech probability is on the right side of 0.5."""
    prob = _first(outputs).reshape(-1)
    return float(np.mean((prob > 0.5) == (eval["labels"] == 1)))


def _edit_distance(a: list[int], b: list[int]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def char_accuracy(outputs: Mapping[str, np.ndarray], eval: Mapping[str, np.ndarray]) -> float:
    """1 - character error rate of greedy CTC decoding (class 0 is the blank; repeats merge)
    against `targets` (class indices, -1 pads), over all characters of the set."""
    probs = _first(outputs)
    errors = total = 0
    for seq, target in zip(probs.argmax(-1), eval["targets"]):
        decoded, prev = [], 0
        for k in seq.tolist():
            if k != prev and k != 0:
                decoded.append(k)
            prev = k
        want = [int(t) for t in target if t >= 0]
        errors += _edit_distance(decoded, want)
        total += len(want)
    return 1.0 - errors / total


def text_f1(outputs: Mapping[str, np.ndarray], eval: Mapping[str, np.ndarray]) -> float:
    """Pixel F1 of the text map thresholded at 0.3 (DBNet's threshold in rapidocr) against the
    text lines' boxes; a predicted pixel within 2 px of a box counts as inside (the map covers
    the glyphs, the boxes their line)."""
    pred = _first(outputs)[:, 0] > 0.3
    mask = eval["mask"].astype(bool)
    grown = mask.copy()
    for axis in (1, 2):
        for s in (-2, -1, 1, 2):
            grown |= np.roll(mask, s, axis=axis)
    precision = (pred & grown).sum() / max(pred.sum(), 1)
    recall = (pred & mask).sum() / max(mask.sum(), 1)
    return float(2 * precision * recall / max(precision + recall, 1e-12))
