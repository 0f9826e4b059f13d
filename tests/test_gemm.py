"""mplower's float matrix product (mplower.numerics.gemm): its summation order and what follows.

Every expected value is the sequential sum written with numpy elementwise operations
(conftest.sequential_matmul), never BLAS: the product must equal it bit for bit, including for
f32 operands whose products round. The `determinism` tests also run under a second BLAS kernel
setting in .ci/run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from conftest import sequential_matmul

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.opdef import OPS, check_attrs
from mplower.numerics.gemm import SERIAL_BELOW, matmul

ROOT = Path(__file__).resolve().parent.parent


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


# Tile edges (rows not a multiple of 8, columns not of 32 or 512), an empty contraction, and
# each path both serial and parallel: fewer than 8 rows (row by row), 8 to 16 (panels read in
# place), more (panels read in place where b is wide and read by few rows, 33 x 257 and
# 150 x 400; else packed and summed in slices of K by blocks of rows and panels: 520 x 300 is
# 25 blocks, the last ones partial, and K = 520 three slices).
SHAPES = [(1, 1, 1), (3, 5, 7), (37, 300, 71), (1, 513, 700), (33, 17, 257), (5, 0, 3),
          (12, 40, 50), (150, 700, 400), (9, 2100, 1800), (4, 3000, 3000), (520, 520, 300)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_equals_the_sequential_numpy_sum_bit_for_bit(shape, dtype) -> None:
    m, k, n = shape
    rng = np.random.default_rng(m * 1000 + k)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    got = matmul(a, b)
    assert got.dtype == dtype
    assert bits(got) == bits(sequential_matmul(a, b))


def test_gemm_shapes_cover_every_path_serial_and_parallel() -> None:
    paths = {(m * k * n >= SERIAL_BELOW, (m >= 8) + (m > 16)) for m, k, n in SHAPES if k}
    assert paths == {(parallel, path) for parallel in (False, True) for path in (0, 1, 2)}


def test_gemm_rounds_each_product_before_adding_it() -> None:
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 needs 25 bits: rounded first (to 1 + 2^-11, a tie to
    # even) and then added to -1 it gives 2^-11; a fused multiply-add would give 2^-11 + 2^-24.
    a = np.array([[-1.0, 1 + 2.0**-12]], np.float32)
    b = np.array([[1.0], [1 + 2.0**-12]], np.float32)
    fused = np.float32(-1.0 + np.float64(a[0, 1]) * np.float64(b[1, 0]))
    assert fused == np.float32(2.0**-11 + 2.0**-24)
    assert matmul(a, b)[0, 0] == np.float32(2.0**-11)


@pytest.mark.parametrize("sa, sb", [((3, 1, 20, 30), (4, 30, 5)), ((30,), (2, 30, 6)),
                                    ((2, 4, 30), (30,)), ((30,), (30,)), ((4, 30), (3, 1, 30, 2))])
def test_gemm_keeps_numpy_matmul_shapes_and_broadcasting(sa, sb) -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32)
    got = matmul(a, b)
    assert got.shape == np.matmul(a, b).shape
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    a3 = np.broadcast_to(a2, batch + a2.shape[-2:]).reshape(-1, *a2.shape[-2:])
    b3 = np.broadcast_to(b2, batch + b2.shape[-2:]).reshape(-1, *b2.shape[-2:])
    expect = np.stack([sequential_matmul(x, w) for x, w in zip(a3, b3)])
    assert bits(got) == bits(expect.reshape(got.shape))


def test_gemm_of_integers_is_numpys_exact_integer_product() -> None:
    a = np.arange(12, dtype=np.int64).reshape(3, 4) - 5
    b = np.arange(8, dtype=np.int64).reshape(4, 2) * 1000
    got = matmul(a, b)
    assert got.dtype == np.int64 and np.array_equal(got, np.matmul(a, b))


def test_gemm_rejects_a_contraction_mismatch() -> None:
    with pytest.raises(ValueError, match=r"contraction mismatch: \(2, 3\) @ \(4, 5\)"):
        matmul(np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32))


@pytest.mark.determinism
def test_gemm_result_does_not_depend_on_thread_count() -> None:
    threadpoolctl = pytest.importorskip("threadpoolctl")
    rng = np.random.default_rng(2)
    a = rng.standard_normal((3, 129, 700)).astype(np.float32)
    b = rng.standard_normal((700, 300)).astype(np.float32)
    first = bits(matmul(a, b))
    threads = numba.get_num_threads()
    try:
        for n in range(1, min(2, numba.config.NUMBA_NUM_THREADS) + 1):
            numba.set_num_threads(n)
            with threadpoolctl.threadpool_limits(limits=n, user_api="blas"):
                assert bits(matmul(a, b)) == first
    finally:
        numba.set_num_threads(threads)


def conv(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, **attrs) -> np.ndarray:
    opdef = OPS["mp.conv2d"]
    ins = [x, w] + ([bias] if bias is not None else [])
    return opdef.reference(ins, check_attrs(opdef, attrs), None)[0]


@pytest.mark.determinism
def test_a_row_or_an_image_gives_the_same_bits_alone_and_anywhere_in_a_batch() -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((48, 700)).astype(np.float32)
    b = rng.standard_normal((700, 90)).astype(np.float32)
    whole = matmul(a, b)
    for i in (0, 1, 17, 47):
        assert bits(matmul(a[i:i + 1], b)) == bits(whole[i:i + 1])
        assert bits(matmul(a[i], b)) == bits(whole[i])
    assert bits(matmul(a[::-1], b)) == bits(whole[::-1])
    x = rng.standard_normal((5, 8, 12, 12)).astype(np.float32)
    w = rng.standard_normal((16, 4, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32)
    attrs = {"groups": 2, "padding": [1, 1, 1, 1], "strides": [2, 1]}
    batch = conv(x, w, bias, **attrs)
    for i in range(5):
        assert bits(conv(x[i:i + 1], w, bias, **attrs)) == bits(batch[i:i + 1])
    assert bits(conv(x[::-1], w, bias, **attrs)) == bits(batch[::-1])


@pytest.mark.determinism
def test_identical_conv_channels_give_identical_bits() -> None:
    # The squeezenet symptom: one output channel repeated must come out the same every time.
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((2, 64, 9, 9)) * 1e4).astype(np.float32)
    w = np.repeat(rng.standard_normal((1, 64, 3, 3)).astype(np.float32), 40, axis=0)
    y = conv(x, w)
    assert all(bits(y[:, c]) == bits(y[:, 0]) for c in range(40))
    cols = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(2, 3))
    cols = cols.transpose(0, 2, 3, 1, 4, 5).reshape(-1, 64 * 9)
    expect = sequential_matmul(cols, w[:1].reshape(1, -1).T).reshape(2, 7, 7)
    assert bits(y[:, 0]) == bits(expect)


_CHILD = """
import hashlib, sys
import numpy as np
from mplower.backend.executor import Program
from mplower.ir.parser import parse
from mplower.numerics.gemm import matmul
from mplower.pass_manager import PassContext, load_passes
from mplower.passes.insert_casts import materialize
rng = np.random.default_rng(5)
h = hashlib.sha256()
a = rng.standard_normal((3, 130, 700)).astype(np.float32)
h.update(matmul(a, rng.standard_normal((700, 270)).astype(np.float32)).tobytes())
for name, policy in (("transformer", "bf16"), ("mlp", "fp16"), ("cnn", "bf16")):
    path = "ir_examples/%s.ir" % name
    module = parse(open(path).read(), path)
    module.path = path
    load_passes()["assign-precision"](policy=policy).run(module, PassContext())
    materialize(module)
    prog = Program(module)
    x = np.load("ir_examples/%s_inputs.npz" % name)["x"]
    result = prog.run([x], keep=True)
    for y in result.outputs + result.reference + result.values + result.refs:
        if isinstance(y, np.ndarray):
            h.update(np.ascontiguousarray(y).tobytes())
    for r in result.ops:
        h.update(repr((r.counts, r.rel_l2, r.sqnr_db, r.max_abs)).encode())
print(h.hexdigest())
"""


@pytest.mark.determinism
def test_results_are_bit_identical_under_every_openblas_kernel_and_thread_count() -> None:
    # The six children run two at a time (most of a child is its start-up, one core's work).
    children = {}
    for core in ("Haswell", "SkylakeX", None):
        for threads in ("1", "2"):
            env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
            env.update({"OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads,
                        "NUMBA_NUM_THREADS": threads})
            if core is not None:
                env["OPENBLAS_CORETYPE"] = core
            children[(core, threads)] = env
    digests = {}
    keys = list(children)
    for pair in (keys[i:i + 2] for i in range(0, len(keys), 2)):
        procs = {key: subprocess.Popen([sys.executable, "-c", _CHILD], cwd=ROOT,
                                       env=children[key], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True) for key in pair}
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err
            digests[key] = out.strip()
    assert len(digests) == 6 and len(set(digests.values())) == 1, digests


@pytest.mark.parametrize("shape", [(3, 40, 50), (16, 64, 100), (37, 300, 71)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gemm_bias_and_relu_epilogue_is_numpys_add_then_maximum_on_every_path(shape) -> None:
    m, k, n = shape
    rng = np.random.default_rng(m + k)
    a = rng.standard_normal((2, m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    a[0, 1, 3] = np.nan
    a[1, 2] = 0.0  # a row of +0 sums, plus a -0.0 bias: +0, and relu keeps +0
    bias = rng.standard_normal(m).astype(np.float32)
    bias[2] = -0.0
    got = matmul(a, b, bias=bias, relu=True)
    plain = np.stack([sequential_matmul(x, b) for x in a])
    expect = np.maximum(plain + bias.reshape(-1, 1), np.float32(0))
    assert bits(got) == bits(expect)
    assert bits(matmul(a, b, bias=bias)) == bits(plain + bias.reshape(-1, 1))


@pytest.mark.parametrize("k", [300, 1500])  # one exact chunk (the tile path), and several
def test_integer_gemm_dequantize_epilogue_is_numpys_float32_arithmetic(k) -> None:
    from mplower.numerics.gemm import integer_matmul

    rng = np.random.default_rng(k)
    a = rng.integers(-128, 128, (40, k)).astype(np.int8)
    b = rng.integers(0, 256, (k, 70)).astype(np.uint8)
    scale = (rng.random(40) * 1e-4).astype(np.float32)
    bias = rng.standard_normal(40).astype(np.float32)
    q = (a.astype(np.int64) @ b.astype(np.int64)).astype(np.int32)
    for kwargs, expect in (
            ({"scale": scale}, q.astype(np.float32) * scale[:, None]),
            ({"scale": scale, "bias": bias, "relu": True},
             np.maximum(q.astype(np.float32) * scale[:, None] + bias[:, None], np.float32(0)))):
        got = integer_matmul(a, b, **kwargs)
        assert got.dtype == np.float32 and bits(got) == bits(expect)


@pytest.mark.parametrize("rows", [3, 12, 40])  # row by row, panels in place, packed panels
def test_a_packed_weight_gives_the_bits_of_the_plain_product(rows) -> None:
    from mplower.numerics.gemm import PackedMatrix

    rng = np.random.default_rng(rows)
    a = rng.standard_normal((2, rows, 300)).astype(np.float32)
    b = rng.standard_normal((300, 70)).astype(np.float32)
    packed = PackedMatrix(b, np.float32)
    assert bits(matmul(a, packed)) == bits(np.stack([sequential_matmul(x, b) for x in a]))
    bias = rng.standard_normal(rows).astype(np.float32)
    assert bits(matmul(a[0], packed, bias=bias, relu=True)) == bits(
        np.maximum(sequential_matmul(a[0], b) + bias[:, None], np.float32(0)))
    # An integer weight packed as the float32 it is exact in: np.matmul's integer product.
    q = rng.integers(-128, 128, (300, 70)).astype(np.int8)
    ai = rng.integers(-128, 128, (rows, 300)).astype(np.int8)
    got = matmul(ai.astype(np.float32), PackedMatrix(q, np.float32))
    assert np.array_equal(got, (ai.astype(np.int64) @ q.astype(np.int64)).astype(np.float32))
    with pytest.raises(ValueError, match="packed for float32, the product runs in float64"):
        matmul(a.astype(np.float64), packed)
