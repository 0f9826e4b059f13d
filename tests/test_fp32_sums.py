"""Float sums (reduce_sum, reduce_mean, softmax, layer_norm) are the correctly rounded sums of
their float32 terms, whatever axis is summed and however many rows the batch has.

The expected values are math.fsum (exact) rounded once to float32, never mplower's own code. A
float32 running sum over a non-innermost axis, numpy's order there, missed them by a few ulps
on most elements.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mplower.backend.executor import Program
from mplower.ir.parser import parse

N, K, M = 3, 512, 24


def _run(op: str, attrs: str, x: np.ndarray, out: str) -> np.ndarray:
    shape = "x".join(map(str, x.shape))
    text = (f"func.func @main(%x: tensor<{shape}xf32>) -> tensor<{out}xf32> {{\n"
            f"  %0 = {op} %x {attrs} : (tensor<{shape}xf32>) -> tensor<{out}xf32>\n"
            f"  return %0 : tensor<{out}xf32>\n}}\n")
    return Program(parse(text, "<test>")).run([x], reference=False).outputs[0]


def _terms(n: int = N, seed: int = 0) -> np.ndarray:
    # Magnitudes from 1e-3 to 1e3 around a common offset, as a layer norm's squares are: a
    # float32 running sum over 512 of them loses several ulps.
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, K, M)) * 10.0 ** rng.uniform(-3, 3, (n, K, M))
            + 5.0).astype(np.float32)


def _fsum(x: np.ndarray, axis: int) -> np.ndarray:
    moved = np.moveaxis(x.astype(np.float64), axis, -1)
    return np.array([math.fsum(r) for r in moved.reshape(-1, moved.shape[-1])]
                    ).reshape(moved.shape[:-1])


@pytest.mark.parametrize("op", ["mp.reduce_sum", "mp.reduce_mean"])
def test_reduce_over_a_middle_axis_is_the_correctly_rounded_sum(op):
    x = _terms()
    y = _run(op, "{axes = [1], keepdims = false}", x, f"{N}x{M}")
    exact = _fsum(x, 1) / (K if op == "mp.reduce_mean" else 1)
    assert np.array_equal(y, exact.astype(np.float32))


def test_reduce_sum_of_one_row_has_the_bits_it_has_inside_a_batch():
    x = _terms()
    whole = _run("mp.reduce_sum", "{axes = [1], keepdims = false}", x, f"{N}x{M}")
    for i in range(N):
        one = _run("mp.reduce_sum", "{axes = [1], keepdims = false}", x[i:i + 1], f"1x{M}")
        assert np.array_equal(one[0], whole[i])


def test_softmax_over_a_middle_axis_divides_by_the_correctly_rounded_sum():
    x = np.random.default_rng(1).standard_normal((N, K, M)).astype(np.float32)
    y = _run("mp.softmax", "{axis = 1}", x, f"{N}x{K}x{M}")
    e = np.exp(x - x.max(axis=1, keepdims=True))  # float32, as the op's definition computes it
    total = _fsum(e, 1)[:, None, :].astype(np.float32)
    assert np.array_equal(y, e / total)


def test_layer_norm_uses_correctly_rounded_means():
    x = _terms(2)[:, :, :8].transpose(0, 2, 1).copy()  # (2, 8, 512): normalized over 512
    text_shape = "2x8x512"
    text = (f"func.func @main(%x: tensor<{text_shape}xf32>) -> tensor<{text_shape}xf32> {{\n"
            f"  %g = mp.constant {{value = dense<1.0> : tensor<512xf32>}} : () -> "
            f"tensor<512xf32>\n"
            f"  %b = mp.constant {{value = dense<0.0> : tensor<512xf32>}} : () -> "
            f"tensor<512xf32>\n"
            f"  %0 = mp.layer_norm %x, %g, %b {{axis = -1, epsilon = 1.0e-5 : f32}} : "
            f"(tensor<{text_shape}xf32>, tensor<512xf32>, tensor<512xf32>) -> "
            f"tensor<{text_shape}xf32>\n"
            f"  return %0 : tensor<{text_shape}xf32>\n}}\n")
    y = Program(parse(text, "<test>")).run([x], reference=False).outputs[0]
    mean = (_fsum(x, 2) / 512).astype(np.float32)[..., None]
    d = x - mean
    var = (_fsum(d * d, 2) / 512).astype(np.float32)[..., None]
    expected = d / np.sqrt(var + np.float32(1e-5)) * np.float32(1) + np.float32(0)
    assert np.array_equal(y, expected)
