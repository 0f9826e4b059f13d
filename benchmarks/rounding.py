"""Speed of mplower's rounding and quantization kernels, and an exhaustive bit-exactness sweep.

The speed part times, on --size float32 values (16M by default, standard normal), each
rounding kernel against the ml_dtypes / numpy float16 round trip it must agree with
(`x.astype(T).astype(np.float32)`), `encode` against `x.astype(T)`, and `quantize` /
`dequantize` against the numpy formulation of ONNX's reference (`np.rint(x / s)`, int32, add the
zero point, clip, cast). Every figure is the median of --repeat runs after one warm-up call,
so numba compilation is excluded; allocation of the result is included on both sides.

`--sweep` instead runs every one of the 2^32 float32 bit patterns through `round_to` and
`encode` for each format in chunks of 2^24, and compares with ml_dtypes / numpy float16 (tf32,
which has no library type, with an independent float64 computation): NaN-ness first, then the
bits of the non-NaN results, then the NaN bit patterns, then the overflow/underflow/NaN counts
derived from the reference. It prints progress per chunk and a mismatch count per format.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import ml_dtypes
import numba
import numpy as np

from mplower.numerics.formats import FORMATS
from mplower.numerics.quant import dequantize, quantize
from mplower.numerics.rounding import encode, round_to

REFERENCE = {"bf16": ml_dtypes.bfloat16, "f16": np.float16,
             "f8E4M3FN": ml_dtypes.float8_e4m3fn, "f8E5M2": ml_dtypes.float8_e5m2,
             "f6E2M3FN": ml_dtypes.float6_e2m3fn, "f6E3M2FN": ml_dtypes.float6_e3m2fn,
             "f4E2M1FN": ml_dtypes.float4_e2m1fn, "f8E8M0FNU": ml_dtypes.float8_e8m0fnu}


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: compilation, first-touch of caches
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def tf32_numpy(x: np.ndarray) -> np.ndarray:
    """TF32 rounding in numpy: the same bit arithmetic as the kernel, one array op at a time."""
    u = x.view(np.uint32)
    a = u & np.uint32(0x7FFFFFFF)
    r = (a + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    r = np.where(a > 0x7F800000, np.uint32(0x7FC00000), r)
    return (r | (u & np.uint32(0x80000000))).view(np.float32)


def onnx_quantize_numpy(x: np.ndarray, scale, zero_point: int) -> np.ndarray:
    return np.clip(np.rint(x / scale).astype(np.int32) + zero_point, -128, 127).astype(np.int8)


def header(title: str) -> list[str]:
    machine = (f"{platform.platform()}, {platform.processor() or platform.machine()}, "
               f"{os.cpu_count()} CPUs, numba {numba.__version__} with "
               f"{numba.get_num_threads()} threads ({numba.threading_layer()})")
    versions = (f"numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__}, "
                f"Python {platform.python_version()}")
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    return [f"## {title}", "",
            f"- command: `{shlex.join([os.path.basename(sys.executable)] + sys.argv)}`",
            f"- machine: {machine}",
            f"- {versions}",
            f"- load average at start (1, 5, 15 min): {load}",
            f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}", ""]


def speed(size: int, repeat: int) -> str:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(size).astype(np.float32)
    warnings.simplefilter("ignore")
    title = (f"| operation ({size / 2**20:g}M float32) | mplower ms | reference | "
             "reference ms | speed-up |")
    lines = [title, "|---|---:|---|---:|---:|"]

    def row(what: str, ours: Callable, ref_name: str, ref: Callable) -> None:
        a, b = median_ms(ours, repeat), median_ms(ref, repeat)
        lines.append(f"| {what} | {a:.1f} | {ref_name} | {b:.1f} | {b / a:.1f}x |")

    for fmt, t in REFERENCE.items():
        row(f"`round_to(x, \"{fmt}\")`", lambda fmt=fmt: round_to(x, fmt),
            f"`x.astype({t.__name__}).astype(float32)`",
            lambda t=t: x.astype(t).astype(np.float32))
    row('`round_to(x, "tf32")`', lambda: round_to(x, "tf32"), "numpy bit arithmetic",
        lambda: tf32_numpy(x))
    row('`round_to(x, "f8E4M3FN", saturate=True)`',
        lambda: round_to(x, "f8E4M3FN", saturate=True),
        "`np.clip(x, -448, 448).astype(e4m3fn).astype(float32)`",
        lambda: np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    for fmt, t in REFERENCE.items():
        row(f"`encode(x, \"{fmt}\")`", lambda fmt=fmt: encode(x, fmt),
            f"`x.astype({t.__name__})`", lambda t=t: x.astype(t))

    scale = np.float32(0.02)
    row('`quantize(x, s, 3, "i8")` per tensor', lambda: quantize(x, scale, 3, "i8"),
        "numpy ONNX formula", lambda: onnx_quantize_numpy(x, scale, 3))
    x2 = x.reshape(-1, 1024)
    for axis in (0, 1):
        s = (rng.random(x2.shape[axis]) * 0.05 + 0.01).astype(np.float32)
        shape = (-1, 1) if axis == 0 else (1, -1)
        row(f'`quantize(x, s, 0, "i8", axis={axis})` on {x2.shape[0]}x{x2.shape[1]}',
            lambda s=s, axis=axis: quantize(x2, s, 0, "i8", axis=axis),
            "numpy ONNX formula", lambda s=s, shape=shape: onnx_quantize_numpy(
                x2, s.reshape(shape), 0))
    q = quantize(x, scale, 3, "i8")[0]
    row("`dequantize(q, s, 3)` from int8", lambda: dequantize(q, scale, 3),
        "`(q.astype(float32) - 3) * s`", lambda: (q.astype(np.float32) - np.float32(3)) * scale)
    return "\n".join(header("Rounding and quantization kernels") + lines) + "\n"


def tf32_float64(x: np.ndarray) -> np.ndarray:
    """TF32 via float64: round |x| / 2^(e-11) half to even, e from frexp (cf. tests)."""
    with np.errstate(invalid="ignore"):
        x64 = x.astype(np.float64)
    finite = np.isfinite(x64) & (x64 != 0)
    _, e = np.frexp(np.where(finite, x64, 1.0))
    quantum = np.ldexp(1.0, np.maximum(e - 11, -136))
    r = np.where(finite, np.round(x64 / quantum) * quantum, x64)
    r = np.where(np.abs(r) > FORMATS["tf32"].max_finite, np.copysign(np.inf, r), r)
    return r.astype(np.float32)


def expected_counts(x: np.ndarray, want: np.ndarray, ref: type | None) -> tuple[int, int, int]:
    """(overflow, underflow, nan) of rounding `x` to `want`, from the reference type's facts.

    Without inf and NaN (the MX elements) a value overflows when it rounds beyond max finite,
    i.e. from the midpoint between max and the next power of two up (max's mantissa is odd, so
    that tie rounds away), and a NaN input is counted as a NaN. E8M0 (unsigned) overflows for
    positive values that come out NaN.
    """
    x_nan, w_nan = np.isnan(x), np.isnan(want)
    underflow = ~x_nan & (x != 0) & (want == 0)
    if ref is not None and not np.isnan(np.array(np.nan).astype(ref)):
        info = ml_dtypes.finfo(ref)
        edge = (float(info.max) + 2.0 ** info.maxexp) / 2
        with np.errstate(invalid="ignore"):
            overflow = ~x_nan & (np.abs(x.astype(np.float64)) >= edge)
        return int(overflow.sum()), int(underflow.sum()), int(x_nan.sum())
    if ref is not None and not ml_dtypes.finfo(ref).min < 0:
        with np.errstate(invalid="ignore"):
            overflow = (x > 0) & w_nan
        return int(overflow.sum()), int(underflow.sum()), int(w_nan.sum())
    overflow = ~x_nan & ((np.isinf(want) & ~np.isinf(x)) | w_nan)
    return int(overflow.sum()), int(underflow.sum()), int(w_nan.sum())


def sweep(chunk_bits: int = 24, fmts: list[str] | None = None) -> str:
    warnings.simplefilter("ignore")
    fmts = fmts or [*REFERENCE, "tf32"]
    # value: non-NaN bits or NaN-ness differ; nan_bits: both NaN, patterns differ;
    # codes: encode() differs from the reference's bit pattern; counts: Counts differ.
    bad = {f: {"value": 0, "nan_bits": 0, "codes": 0, "counts": 0} for f in fmts}
    n_chunks = 1 << (32 - chunk_bits)
    t0 = time.perf_counter()
    for c in range(n_chunks):
        x = np.arange(c << chunk_bits, (c + 1) << chunk_bits, dtype=np.uint64).astype(
            np.uint32).view(np.float32)
        for fmt in fmts:
            got, counts = round_to(x, fmt)
            if fmt == "tf32":
                want = tf32_float64(x)
            else:
                codes = x.astype(REFERENCE[fmt])
                want = codes.astype(np.float32)
                uint = np.uint16 if FORMATS[fmt].bits == 16 else np.uint8
                bad[fmt]["codes"] += int(np.count_nonzero(encode(x, fmt) != codes.view(uint)))
            g_nan, w_nan = np.isnan(got), np.isnan(want)
            gb, wb = got.view(np.uint32), want.view(np.uint32)
            bad[fmt]["value"] += int(np.count_nonzero((g_nan != w_nan) | (~w_nan & (gb != wb))))
            if fmt != "tf32":  # the float64 reference does not model NaN payloads
                bad[fmt]["nan_bits"] += int(np.count_nonzero(g_nan & w_nan & (gb != wb)))
            expected = expected_counts(x, want, REFERENCE.get(fmt))
            bad[fmt]["counts"] += (counts.overflow, counts.underflow, counts.nan) != expected
        elapsed = time.perf_counter() - t0
        total = sum(sum(v.values()) for v in bad.values())
        print(f"chunk {c + 1}/{n_chunks}  {elapsed:.0f}s elapsed, "
              f"~{elapsed / (c + 1) * (n_chunks - c - 1):.0f}s left, mismatches so far: {total}",
              file=sys.stderr, flush=True)
    title = ("| format | reference | value mismatches | NaN-pattern mismatches | "
             "encode mismatches | chunks with wrong counts |")
    lines = [title, "|---|---|---:|---:|---:|---:|"]
    for fmt in fmts:
        ref = "float64 rounding" if fmt == "tf32" else REFERENCE[fmt].__name__
        b = bad[fmt]
        na = "n/a" if fmt == "tf32" else None
        lines.append(f"| {fmt} | {ref} | {b['value']} | {na or b['nan_bits']} | "
                     f"{na or b['codes']} | {b['counts']} |")
    lines.append(f"\nAll 2^32 float32 bit patterns, {n_chunks} chunks, "
                 f"{time.perf_counter() - t0:.0f} s.")
    return "\n".join(header("Exhaustive sweep of the rounding kernels") + lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1 << 24, help="elements (default 2^24)")
    ap.add_argument("--repeat", type=int, default=7, help="timed runs per figure (median)")
    ap.add_argument("--sweep", action="store_true",
                    help="check all 2^32 float32 patterns instead of timing (many minutes)")
    ap.add_argument("--formats", nargs="+", choices=[*REFERENCE, "tf32"],
                    help="sweep only these formats (default: all)")
    ap.add_argument("--out", help="also write the report to this file")
    args = ap.parse_args()
    report = sweep(fmts=args.formats) if args.sweep else speed(args.size, args.repeat)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
