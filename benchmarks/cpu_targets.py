"""What the kernels cost when numba compiles them for another CPU than this one.

For each target (this machine's CPU, NUMBA_CPU_NAME=haswell and =generic, the named CPU's own
features, each in a numba cache of its own) the script starts one process per round, all
targets taking turns in every round, and each process times every case `--repeats` times on
one thread after a warm-up call, keeping the median; the figure is the median over rounds, with
the bits' hash, which every target must share (tests/test_cpu_targets.py). Cases: a ResNet-like
3x3 conv (64 -> 64 channels, 56x56, batch 1) plain and with the f16 rounding epilogue, the
same conv quantized to int8 as it is stored, and a 512x512x4096 float32 matmul. Run from the
repository root: `python3 benchmarks/cpu_targets.py [--rounds 5 --repeats 7]`.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _cases():
    import numpy as np

    from mplower.numerics.conv import conv2d
    from mplower.numerics.gemm import matmul

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 64, 56, 56)).astype(np.float32)
    w = (rng.standard_normal((64, 64, 3, 3)) * 0.05).astype(np.float32)
    a = rng.standard_normal((512, 4096)).astype(np.float32)
    b = rng.standard_normal((4096, 512)).astype(np.float32)
    geometry = ((1, 1), (1, 1, 1, 1), (1, 1), 1)
    return {
        "conv3x3": lambda: conv2d(x, w, *geometry),
        "conv3x3-f16": lambda: conv2d(x, w, *geometry, rounding="f16"),
        "conv3x3-int8-out": lambda: conv2d(x, w, *geometry,
                                           quantize=(np.float32(0.05), 0, "i8")),
        "matmul-512x512x4096": lambda: matmul(a, b),
    }


def measure(repeats: int) -> dict:
    """{case: [median seconds, hash of the bits]} in this process."""
    out = {}
    for name, run in _cases().items():
        y = run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        out[name] = [statistics.median(times), hashlib.sha256(y.tobytes()).hexdigest()[:16]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.repeats)))
        return
    caches = {cpu: tempfile.mkdtemp(prefix=f"numba-{cpu}-") for cpu in ("haswell", "generic")}
    targets = {"host": {}} | {cpu: {"NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": "",
                                    "NUMBA_CACHE_DIR": cache} for cpu, cache in caches.items()}
    results: dict[str, list[dict]] = {t: [] for t in targets}
    for _ in range(args.rounds + 1):  # round 0 compiles into each cache, and is not counted
        for target, env in targets.items():
            done = subprocess.run(
                [sys.executable, __file__, "--measure", "--repeats", str(args.repeats)],
                env=dict(os.environ, NUMBA_NUM_THREADS="1", **env), capture_output=True,
                text=True, check=True)
            results[target].append(json.loads(done.stdout.splitlines()[-1]))
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo
                  if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo
                  if line.startswith("flags")), [])
    print(f"`python3 benchmarks/cpu_targets.py --rounds {args.rounds} --repeats "
          f"{args.repeats}`, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
          f"{model} ({os.cpu_count()} CPUs; "
          + " ".join(f for f in ("sse4_1", "avx2", "fma", "f16c", "avx512f") if f in flags)
          + "), one numba thread; medians of rounds of medians\n")
    print("| case | " + " | ".join(f"{t} ms" for t in targets) + " | same bits |")
    print("|---|" + "---:|" * len(targets) + "---|")
    for case in results["host"][0]:
        ms = [statistics.median(r[case][0] for r in results[t][1:]) * 1e3 for t in targets]
        same = len({r[case][1] for t in targets for r in results[t]}) == 1
        print(f"| {case} | " + " | ".join(f"{v:.2f}" for v in ms) + f" | {same} |")
    for cache in caches.values():
        shutil.rmtree(cache)


if __name__ == "__main__":
    main()
