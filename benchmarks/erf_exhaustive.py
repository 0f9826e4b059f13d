"""Checks mplower's float32 erf against math.erf on all 2^32 float32 bit patterns.

For each chunk of consecutive bit patterns (NaNs, infinities, zeros and subnormals included)
it compares the bits of `special.erf(x)` (the public entry: parallel blocks for these chunk
sizes) with np.float32(math.erf(float64(x))) computed by an independent compiled loop, counts
the elements that Ziv's rounding test sent to the fix-up, and measures the largest relative
distance between the kernel's float64 approximation and math.erf over the non-NaN inputs, the
figure that the kernel's error bound rests on. Prints progress per --progress chunks and a
summary in the format of docs/benchmarks.md (also to --out); about 3 minutes on two cores.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
import sys
import time

import numba
import numpy as np
from numba import njit, prange

from mplower.numerics import special

# NaN bit patterns (exponent all ones, mantissa not zero, either sign), which the fix-up takes.
_NANS = 2 * (2**23 - 1)


# Not cache=True: numba's cache is keyed on this file only, so a cached `reference` would go
# on checking the _erf_approx inlined when it was cached after special.py changed.
@njit(parallel=True, nogil=True)
def reference(x, y, error):
    """y = float32(math.erf(x)); error = |approximation - math.erf(x)| / |math.erf(x)|, 0 where
    math.erf(x) is 0 or NaN."""
    for i in prange(x.size):
        v = np.float64(x[i])
        exact = math.erf(v)
        y[i] = exact
        a = special._erf_approx(v)
        error[i] = abs(a - exact) / abs(exact) if exact != 0 and not math.isnan(exact) else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-bits", type=int, default=22, help="log2 of patterns per chunk")
    parser.add_argument("--progress", type=int, default=64, help="print every N chunks")
    parser.add_argument("--out", help="also write the summary to this file")
    args = parser.parse_args()
    size = 1 << args.chunk_bits
    chunks = (1 << 32) // size
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    start = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    expect = np.empty(size, np.float32)
    error = np.empty(size, np.float64)
    scratch = np.empty(size, np.float32)
    mismatches = flagged = inner = 0
    worst, worst_x = 0.0, 0.0
    t0 = time.perf_counter()
    for c in range(chunks):
        x = np.arange(c * size, (c + 1) * size, dtype=np.uint64).astype(np.uint32).view(np.float32)
        got = special.erf(x)
        reference(x, expect, error)
        bad = got.view(np.uint32) != expect.view(np.uint32)
        mismatches += int(np.count_nonzero(bad))
        inner += int(np.count_nonzero((np.abs(expect) < 1) & (expect != 0)))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            print(f"mismatch: x={x[i]!r} (0x{x.view(np.uint32)[i]:08x}) got {got[i]!r} "
                  f"expected {expect[i]!r}", flush=True)
        flagged += special._erf32_serial(x, scratch, special._ERROR_BOUND)
        i = int(np.argmax(error))
        if error[i] > worst:
            worst, worst_x = float(error[i]), float(x[i])
        if (c + 1) % args.progress == 0:
            print(f"{c + 1}/{chunks} chunks, {time.perf_counter() - t0:.0f} s, "
                  f"{mismatches} mismatches, {flagged} flagged", flush=True)
    seconds = time.perf_counter() - t0
    report = "\n".join([
        f"- command: `{shlex.join([os.path.basename(sys.executable)] + sys.argv)}`",
        (f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, numba {numba.__version__} "
        f"with {numba.get_num_threads()} threads, Python {platform.python_version()}"),
        f"- load average at start (1, 5, 15 min): {load}; date: {start}",
        (f"- all 2^32 float32 bit patterns in {chunks} chunks, {seconds:.0f} s: {mismatches} "
        f"mismatches; {flagged} sent to the fix-up, {_NANS} of them NaNs; the other "
        f"{flagged - _NANS} are {(flagged - _NANS) / inner:.2e} of the {inner} inputs whose "
        f"float32 erf is neither 0 nor +-1 nor NaN"),
        (f"- largest relative error of the approximation: {worst:.3g} "
        f"(2^{math.log2(worst):.1f}) at x = {worst_x!r}; bound "
        f"2^{math.log2(special._ERROR_BOUND):.0f}"), ""])
    print(report, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
