"""mplower's kernels give the same bits whatever CPU numba compiles them for.

numba compiles for this machine unless NUMBA_CPU_NAME names another CPU (`generic`: what a
portable cache is built for, and what numba's code looks like on an x86-64 without F16C). The
kernels written as LLVM IR choose their instructions from that compile target
(mplower.numerics.cpu); where a fast path needs an instruction the target lacks, a portable one
computes the same bits. `.ci/run` runs the determinism tests here under the host's CPU and then
under NUMBA_CPU_NAME=generic and =haswell (each with its own numba cache); the workload's bits
are compared with numpy's fixed-order references and with the host's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from mplower.numerics import gemm_kernel
from mplower.numerics.conv import conv2d
from mplower.numerics.cpu import Target, compile_target, probe
from mplower.numerics.gemm import integer_matmul, matmul
from mplower.numerics.pool import avg_pool2d, max_pool2d
from mplower.numerics.rounding import round_to
from mplower.numerics.special import erf

X86 = "x86_64-unknown-linux-gnu"
AARCH64 = "aarch64-unknown-linux-gnu"


def _conv_cases() -> dict[str, tuple]:
    """name -> (x, w, strides, padding, dilations, groups, keyword arguments of conv2d)."""
    rng = np.random.default_rng(7)

    def f32(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    one = ((1, 1), (0, 0, 0, 0), (1, 1))
    same = ((1, 1), (1, 1, 1, 1), (1, 1))
    x_int = rng.integers(-128, 128, (2, 8, 7, 7)).astype(np.int8)
    w_int = rng.integers(-128, 128, (16, 8, 3, 3)).astype(np.int8)
    return {
        # The smallest crash, and the first one found (1x1, in place).
        "smallest": (f32(1, 2, 2, 2), f32(8, 2, 1, 1), *one, 1, {}),
        "1x1": (f32(1, 8, 9, 9), f32(8, 8, 1, 1), *one, 1, {}),
        "3x3-bias-relu": (f32(2, 16, 12, 12), f32(32, 16, 3, 3), *same, 1,
                          {"bias": f32(32), "relu": True}),
        "grouped-strided": (f32(1, 16, 10, 10), f32(32, 8, 3, 3), (2, 2), (1, 1, 1, 1),
                            (1, 1), 2, {}),
        "depthwise": (f32(1, 16, 9, 9), f32(16, 1, 3, 3), *same, 16, {"bias": f32(16)}),
        # The epilogue's float16 and bf16 rounding in the tiles' registers (inputs wide
        # enough to overflow, underflow to f16 subnormals and hit ties), and the amax.
        "3x3-f16": (f32(2, 8, 9, 9, scale=3000.0), f32(16, 8, 3, 3), *same, 1,
                    {"rounding": "f16", "amax": []}),
        "1x1-f16-tiny": (f32(1, 8, 9, 9, scale=1e-5), f32(16, 8, 1, 1), *one, 1,
                         {"rounding": "f16"}),
        "3x3-bf16": (f32(2, 8, 9, 9), f32(16, 8, 3, 3), *same, 1, {"rounding": "bf16"}),
        # The integer quantize as each tile is stored (rint in registers).
        "3x3-quantize-i8": (f32(2, 8, 9, 9), f32(16, 8, 3, 3), *same, 1,
                            {"bias": f32(16), "quantize": (np.float32(0.25), 3, "i8")}),
        "int8-dequantize": (x_int, w_int, *same, 1,
                            {"scale": np.full(16, 0.01, np.float32), "relu": True}),
        "int8-exact": (x_int, w_int, *one, 1, {}),
    }


def _matmul_cases() -> dict[str, tuple]:
    """name -> (function, operands, keyword arguments)."""
    rng = np.random.default_rng(8)

    def f32(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    return {
        "matmul-rows": (matmul, (f32(3, 50), f32(50, 70)), {}),
        "matmul-in-place": (matmul, (f32(37, 70), f32(70, 45)), {"relu": True}),
        "matmul-packed": (matmul, (f32(40, 300), f32(300, 100)), {}),
        "matmul-f64": (matmul, (rng.standard_normal((20, 33)), rng.standard_normal((33, 40))),
                       {}),
        "integer-matmul": (integer_matmul, (rng.integers(-128, 128, (24, 90)).astype(np.int8),
                                            rng.integers(-128, 128, (90, 40)).astype(np.int8)),
                           {}),
    }


def outputs() -> dict[str, np.ndarray]:
    """Each kernel of the workload's result."""
    out = {}
    for name, (x, w, strides, padding, dilations, groups, kw) in _conv_cases().items():
        out[name] = conv2d(x, w, strides, padding, dilations, groups, **kw)
        if "amax" in kw:
            out[name + "-amax"] = np.asarray(kw["amax"], np.float32)
    for name, (fn, operands, kw) in _matmul_cases().items():
        out[name] = fn(*operands, **kw)
    wide, x, planes = _elementwise_inputs()
    out["round-f16"] = round_to(wide, "f16")[0]
    out["erf"] = erf(x)
    # The 3x3 stride-2 pools' kernel loads and stores the last columns through lane masks.
    out["max-pool-3x3s2"] = max_pool2d(planes, (3, 3), (2, 2), (1, 1, 1, 1))
    out["avg-pool-3x3s2"] = avg_pool2d(planes, (3, 3), (2, 2), (1, 1, 1, 1))
    return out


def _elementwise_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inputs of the f16 rounding, erf and the pools."""
    rng = np.random.default_rng(9)
    return (rng.standard_normal(4096).astype(np.float32) * 1e5,
            rng.standard_normal(4096).astype(np.float32) * 2,
            rng.standard_normal((1, 8, 17, 17)).astype(np.float32))


def digests() -> dict[str, str]:
    """A hash of each output's dtype, shape and bits."""
    return {name: hashlib.sha256(f"{y.dtype}{y.shape}".encode()
                                 + np.ascontiguousarray(y).tobytes()).hexdigest()
            for name, y in outputs().items()}


@pytest.mark.determinism
def test_workload_matches_numpy_references() -> None:
    """The host's bits, which the other targets must reproduce, are the right ones: each
    float32 conv and product against numpy's sequential sums (tests/conftest.py), the f16
    rounding against numpy's float16 cast, the quantize against rint, clip and cast, erf
    against math.erf, the max pool against numpy's windows (the average pool's order is
    compared across targets only)."""
    from conftest import sequential_matmul
    from test_conv_implicit import sequential_conv

    got = outputs()
    for name, (x, w, strides, padding, dilations, groups, kw) in _conv_cases().items():
        if x.dtype != np.float32:
            y = sequential_conv(x.astype(np.int64), w.astype(np.int64), strides, padding,
                                dilations, groups)
            if "scale" in kw:
                y = np.maximum(y.astype(np.float32) * kw["scale"].reshape(1, -1, 1, 1), 0)
            assert np.array_equal(got[name], y), name
            continue
        y = sequential_conv(x, w, strides, padding, dilations, groups, kw.get("bias"),
                            kw.get("relu", False))
        if kw.get("rounding") == "f16":
            with np.errstate(over="ignore"):
                y = y.astype(np.float16).astype(np.float32)
        elif "rounding" in kw:
            y = round_to(np.ascontiguousarray(y), kw["rounding"])[0]
        if "quantize" in kw:
            s, zp, _ = kw["quantize"]
            y = np.clip(np.rint(y / s) + np.float32(zp), -128, 127).astype(np.int8)
        assert got[name].tobytes() == np.ascontiguousarray(y).tobytes(), name
        if "amax" in kw:
            assert got[name + "-amax"][0] == np.abs(y).max()
    wide, x, planes = _elementwise_inputs()
    with np.errstate(over="ignore"):
        assert got["round-f16"].tobytes() == wide.astype(np.float16).astype(np.float32).tobytes()
    assert got["erf"].tobytes() == np.array([math.erf(v) for v in x], np.float32).tobytes()
    windows = np.lib.stride_tricks.sliding_window_view(
        np.pad(planes, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf), (3, 3),
        axis=(2, 3))[:, :, ::2, ::2]
    assert got["max-pool-3x3s2"].tobytes() == windows.max(axis=(4, 5)).tobytes()
    for name, (fn, (a, b), kw) in _matmul_cases().items():
        y = sequential_matmul(a.astype(np.int64), b.astype(np.int64)) if fn is integer_matmul \
            else sequential_matmul(a, b)
        if kw.get("relu"):
            y = np.maximum(y, 0)
        assert got[name].tobytes() == y.tobytes(), name


@pytest.mark.determinism
def test_kernels_give_the_hosts_bits_when_compiled_for_other_cpus() -> None:
    """NUMBA_CPU_NAME=generic (x86-64 baseline: no SSE4.1, no F16C) and =haswell (AVX2, FMA,
    F16C, no AVX-512): every kernel's bits are the host's. generic segfaulted in the
    implicit-GEMM conv before its float16 epilogue had a portable path.

    `.ci/run` names one file in MPLOWER_HOST_DIGESTS for all its runs: the first run (the host's
    CPU, the README's command) writes the workload's digests there, and every later run (other
    BLAS kernels, then numba compiling for generic and for haswell, each into a fresh cache)
    compares its own with them. Compiling the workload for two more CPUs takes minutes, so a
    plain pytest run without the variable skips this test."""
    path = os.environ.get("MPLOWER_HOST_DIGESTS")
    if not path:
        pytest.skip("runs under .ci/run, which sets MPLOWER_HOST_DIGESTS for every CPU target")
    ours = digests()
    target = os.environ.get("NUMBA_CPU_NAME") or "host"
    if not Path(path).exists():
        assert target == "host", f"{path}: no host digests to compare {target}'s with"
        Path(path).write_text(json.dumps(ours))
        return
    host = json.loads(Path(path).read_text())
    assert ours.keys() == host.keys()
    assert [k for k in host if ours[k] != host[k]] == [], target


@pytest.mark.parametrize("triple, cpu, expect", [
    (X86, "generic", Target(half=False, rint=False, wide=False)),
    (X86, "x86-64-v2", Target(half=False, rint=True, wide=False)),
    (X86, "x86-64-v3", Target(half=True, rint=True, wide=False)),
    (X86, "haswell", Target(half=True, rint=True, wide=False)),
    (X86, "x86-64-v4", Target(half=True, rint=True, wide=True)),
    (X86, "skylake-avx512", Target(half=True, rint=True, wide=True)),
    (AARCH64, "generic", Target(half=True, rint=True, wide=False)),
])
def test_probe_reads_each_targets_instructions_from_llvm(triple, cpu, expect) -> None:
    assert probe(triple, cpu, "") == expect


def test_explicit_features_override_the_cpu_name() -> None:
    assert probe(X86, "generic", "+f16c,+avx").half
    assert not probe(X86, "haswell", "-f16c").half
    assert not probe(X86, "skylake-avx512", "-avx512f").wide


def _vector_kernel(transform):
    """An njit function f(src, dst) that stores transform(builder, v) for each 16-float32
    vector v of src (a multiple of 16 long) in dst."""

    @intrinsic
    def step(typingctx, src, dst, offset):
        def codegen(context, builder, signature, args):
            vty = ir.VectorType(ir.FloatType(), 16)
            src_ptr, dst_ptr = (builder.bitcast(builder.gep(context.make_array(
                signature.args[i])(context, builder, args[i]).data, [args[2]]),
                vty.as_pointer()) for i in (0, 1))
            builder.store(transform(builder, builder.load(src_ptr, align=4)), dst_ptr,
                          align=4)
            return context.get_dummy_value()
        return types.void(src, dst, offset), codegen

    @njit
    def run(src, dst):
        for i in range(0, src.size, 16):
            step(src, dst, i)
    return run


def _float32_sample() -> np.ndarray:
    """Every sign, exponent and top 7 mantissa bits (all 2^16 upper halves), each with lower
    halves at float16's rounding boundaries (ties, either side, either parity of the kept
    bit) and random ones; then random bit patterns."""
    rng = np.random.default_rng(10)
    low = np.array([0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x2FFF, 0x3000,
                    0x3001, 0x7FFF, 0x8000, 0xF000, 0xFFFF], np.uint32)
    low = np.concatenate([low, rng.integers(0, 1 << 16, 18, dtype=np.uint32)])
    upper = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    u = np.concatenate([(upper[:, None] | low[None, :]).ravel(),
                        rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32)])
    return u.view(np.float32)


def _through(transform, x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    _vector_kernel(transform)(x, out)
    return out


def test_portable_f16_round_trip_is_numpys_and_the_cpus() -> None:
    """gemm_kernel._half_round_trip without the float16 conversion instructions: numpy's float16
    cast there and back on every non-NaN, quiet NaNs keeping sign and payload top bits; and,
    where this machine's target has the instructions, their bits on every input, signalling
    NaNs included."""
    x = _float32_sample()
    portable = _through(lambda b, v: gemm_kernel._half_round_trip(b, v, False), x)
    quiet = ~np.isnan(x) | ((x.view(np.uint32) & np.uint32(0x00400000)) != 0)
    with np.errstate(over="ignore"):
        expect = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(portable[quiet].view(np.uint32), expect[quiet].view(np.uint32))
    if compile_target().half:
        native = _through(lambda b, v: gemm_kernel._half_round_trip(b, v, True), x)
        assert np.array_equal(portable.view(np.uint32), native.view(np.uint32))


def test_portable_rint_is_numpys() -> None:
    """gemm_kernel._rint without a rounding instruction: np.rint's bits on every number (ties to
    even, -0.0 and the sign of results that round to zero, inf kept), and NaN for NaN (its
    payload does not matter: the quantize makes a NaN the zero point)."""
    x = _float32_sample()
    portable = _through(lambda b, v: gemm_kernel._rint(b, v, False), x)
    number = ~np.isnan(x)
    assert np.array_equal(portable[number].view(np.uint32), np.rint(x[number]).view(np.uint32))
    assert np.isnan(portable[~number]).all()
    if compile_target().rint:
        native = _through(lambda b, v: gemm_kernel._rint(b, v, True), x)
        assert np.array_equal(portable[number].view(np.uint32),
                              native[number].view(np.uint32))


CONV_IR = """\
func.func @main(%x: tensor<1x2x2x2xf32>) -> tensor<1x8x2x2xf32> {
  %w = mp.constant {value = dense<0.5> : tensor<8x2x1x1xf32>} : () -> tensor<8x2x1x1xf32>
  %0 = mp.conv2d %x, %w {strides = [1, 1], padding = [0, 0, 0, 0], dilations = [1, 1], \
groups = 1} : (tensor<1x2x2x2xf32>, tensor<8x2x1x1xf32>) -> tensor<1x8x2x2xf32>
  return %0 : tensor<1x8x2x2xf32>
}
"""


def test_run_with_numba_jit_disabled_says_so_in_one_line(tmp_path) -> None:
    """NUMBA_DISABLE_JIT=1 turns njit functions into Python, where the kernels' LLVM IR
    intrinsics cannot run: `mplower run` says to unset it (exit 2), not "internal error"."""
    model = tmp_path / "conv.ir"
    model.write_text(CONV_IR)
    done = subprocess.run(
        [sys.executable, "-c", "from mplower.cli.main import main; raise SystemExit(main())",
         "run", str(model), "--random-inputs", "--seed", "0"],
        env=dict(os.environ, NUMBA_DISABLE_JIT="1"), capture_output=True, text=True,
        timeout=600, check=False)
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith("mplower: error: ") and "NUMBA_DISABLE_JIT" in done.stderr
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr


