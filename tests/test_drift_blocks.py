"""`drift` works block by block (memory of the full report) and gives the bits of whole-array
float64 arithmetic, whatever the layout of its operands."""

import gc
import math
import tracemalloc
import weakref

import numpy as np
import pytest

from mplower.numerics import metrics


def _whole(y: np.ndarray, ref: np.ndarray) -> tuple[float, float, float, int]:
    """The figures as whole float64 copies give them (the previous implementation)."""
    r = ref.astype(np.float64)
    diff = y.astype(np.float64)
    with np.errstate(invalid="ignore"):
        diff -= r
    if not np.all(np.isfinite(diff)):
        keep = np.isfinite(diff)
        r, diff = r[keep], diff[keep]
    r *= r
    signal = float(np.sum(r))
    max_abs = float(np.max(np.abs(diff))) if diff.size else 0.0
    diff *= diff
    noise = float(np.sum(diff))
    return (float(np.sqrt(noise / signal)), metrics.sqnr_from(signal, noise), max_abs, 0)


def _cases():
    rng = np.random.default_rng(0)
    for n in (1, 7, 129, 1000, 4097, 100_003):
        a = rng.standard_normal(n).astype(np.float32)
        yield a, a + np.float32(1e-3) * rng.standard_normal(n).astype(np.float32)
    x = rng.standard_normal((37, 41, 53)).astype(np.float32)
    y = x + np.float32(1e-3) * rng.standard_normal(x.shape).astype(np.float32)
    yield x, y
    yield x.transpose(2, 0, 1), y.transpose(2, 0, 1)
    yield np.ascontiguousarray(x.transpose(1, 2, 0)), y.transpose(1, 2, 0)
    yield x[::-1, :, ::-3], y[::-1, :, ::-3]
    yield np.asfortranarray(x), y
    yield np.broadcast_to(x[:1], x.shape), y
    masked_x, masked_y = x.copy(), y.copy()
    masked_x[0, 0, :5] = masked_y[0, 0, :5] = -np.inf  # an attention mask in both
    yield masked_x, masked_y
    yield masked_x.transpose(1, 0, 2), masked_y.transpose(1, 0, 2)


@pytest.mark.parametrize("block", [1000, metrics.BLOCK])
def test_drift_in_blocks_is_bit_identical_to_whole_array_float64(monkeypatch, block):
    monkeypatch.setattr(metrics, "BLOCK", block)
    for y, ref in _cases():
        d = metrics.drift(y, ref)
        assert (d.rel_l2, d.sqnr_db, d.max_abs, d.nonfinite_mismatch) == _whole(y, ref), \
            (y.shape, y.strides)


def test_drift_counts_a_nonfinite_mismatch_across_blocks(monkeypatch):
    monkeypatch.setattr(metrics, "BLOCK", 1000)
    y = np.ones(5000, np.float32)
    ref = y.copy()
    ref[4321] = np.nan
    d = metrics.drift(y, ref)
    assert (d.rel_l2, d.sqnr_db, d.max_abs, d.nonfinite_mismatch) == (
        math.inf, -math.inf, math.inf, 1)


def test_drift_holds_no_float64_copy_of_its_operands():
    # 4M elements: whole-array float64 copies were 3 x 32 MiB; the blocks are 2 MiB each.
    y = np.ones((4, 1024, 1024), np.float32)
    ref = y * np.float32(1.5)
    tracemalloc.start()
    metrics.drift(y, ref)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * metrics.BLOCK * 8


def test_drift_leaves_no_reference_cycle_that_keeps_its_operands():
    # The executor frees each tensor after its last reader: drift must not keep one alive
    # until the garbage collector runs.
    gc.disable()
    try:
        y = np.ones((64, 64), np.float32)
        ref = y * np.float32(2)
        alive = weakref.ref(y), weakref.ref(ref)
        metrics.drift(y.T, ref.T)
        del y, ref
        assert [w() for w in alive] == [None, None]
    finally:
        gc.enable()
