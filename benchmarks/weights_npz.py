"""What a weights archive's unused members cost `mplower run`: wall time and peak RSS.

Builds, in benchmarks/out/weights_npz/, a one-matmul model whose `w.npz` holds its 8x3 weight
and an unused member of 2 GiB of float32 zeros (about 2 MB deflated), and inputs `in.npz`; then
runs `mplower run m.ir --inputs in.npz` in fresh processes and reports the median wall time and
the median peak RSS (wait4) of --repeat runs. Reading only the members the model names, the
unused member costs nothing; reading every member, it costs its 2 GiB and the time to inflate
them. Prints a markdown report headed by the command, machine and date (--out also writes it).
Run from the repository root: `python benchmarks/weights_npz.py`.
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
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
IR = """module attributes {mp.weights = "w.npz"} {
  func.func @main(%x: tensor<4x8xf32>) -> tensor<4x3xf32> {
    %w = mp.constant {name = "w"} : () -> tensor<8x3xf32>
    %0 = mp.matmul %x, %w : (tensor<4x8xf32>, tensor<8x3xf32>) -> tensor<4x3xf32>
    return %0 : tensor<4x3xf32>
  }
}
"""
UNUSED_BYTES = 2 ** 31


def build(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "m.ir").write_text(IR)
    np.savez(folder / "in.npz", x=np.ones((4, 8), np.float32))
    npz = folder / "w.npz"
    if not npz.exists():
        with zipfile.ZipFile(npz, "w", zipfile.ZIP_DEFLATED) as z:
            with z.open("w.npy", "w") as fh:
                np.lib.format.write_array(fh, np.arange(24, dtype=np.float32).reshape(8, 3))
            with z.open("unused.npy", "w", force_zip64=True) as fh:  # streamed: no 2 GiB array
                np.lib.format.write_array_header_1_0(fh, {
                    "descr": "<f4", "fortran_order": False, "shape": (UNUSED_BYTES // 4,)})
                chunk = bytes(1 << 24)
                for _ in range(UNUSED_BYTES // len(chunk)):
                    fh.write(chunk)
    return folder / "m.ir"


def measure(argv: list[str], cwd: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS in bytes) of one child process."""
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.chdir(cwd)
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.execv(argv[0], argv)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{shlex.join(argv)} failed")
    return wall, usage.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = build(ROOT / "benchmarks" / "out" / "weights_npz")
    argv = [sys.executable, "-m", "mplower", "run", "m.ir", "--inputs", "in.npz",
            "--format", "json"]
    runs = [measure(argv, model.parent) for _ in range(args.repeat)]
    wall = statistics.median(r[0] for r in runs)
    rss = statistics.median(r[1] for r in runs)
    npz = model.parent / "w.npz"
    report = "\n".join([
        f"- command: `python benchmarks/weights_npz.py --repeat {args.repeat}`",
        (f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, Python "
         f"{platform.python_version()}, numpy {np.__version__}"),
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        (f"- `w.npz`: {npz.stat().st_size / 1e6:.1f} MB on disk, an 8x3 weight the model uses "
         f"and an unused {UNUSED_BYTES >> 30} GiB member"),
        "",
        "| `mplower run m.ir --inputs in.npz` | median wall s | median peak RSS MB |",
        "|---|---:|---:|",
        f"| {args.repeat} runs | {wall:.2f} | {rss / 1e6:.0f} |",
        "",
    ])
    sys.stdout.write(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
