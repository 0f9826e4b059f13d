"""Start-up time of the `mplower` command against `xdsl-opt`, each in fresh processes.

lit tests and scripts call `mplower opt` hundreds of times on small files, so what they wait
for is the interpreter start, the imports and the first run of the pass, not the pass on a
large module. The script runs each command --repeat times in a fresh subprocess, interleaved
round by round so that outside load hits every contender alike, after --warmup untimed rounds
(numba's on-disk cache and the OS page cache filled), and reports the median and the fastest
wall time. The reference is `xdsl-opt` on a one-op file (skipped with a note when xDSL is not
installed: `pip install -e .[bench]`); `python3 -c pass` shows the interpreter's own floor.
Console scripts are run from the interpreter's bin folder, not through a version-manager
shim, so that neither side pays a shell wrapper.

It also lists which of the heavy optional libraries the `opt --pass=assign-precision` path
imports (none should be: tests/test_startup.py pins that).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from docblock import replace_block

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = "ir_examples/mlp.ir"
HEAVY = ("numba", "onnx", "dask", "matplotlib", "jax", "scipy", "onnxruntime", "torch")
ONE_OP = """\
func.func @main(%a: f32) -> f32 {
  %0 = arith.addf %a, %a : f32
  func.return %0 : f32
}
"""


def console_script(name: str) -> str | None:
    """The console script installed beside this interpreter, else the one on PATH."""
    beside = Path(os.path.realpath(sys.executable)).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def time_once(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one run of cmd in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, check=False, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} exited {done.returncode}:\n"
                         f"{done.stderr.decode(errors='replace')}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def heavy_imports() -> list[str]:
    """The heavy libraries in sys.modules after `mplower opt EXAMPLE --pass=assign-precision`."""
    code = ("import sys\nfrom mplower.cli.main import main\n"
            f"rc = main(['opt', {EXAMPLE!r}, '--pass=assign-precision', '-o', {os.devnull!r}])\n"
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules) if rc == 0 else 'failed')")
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO,
                          capture_output=True, text=True)
    return done.stdout.split()


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=20, help="timed runs per command")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--out", type=Path, help="also write the report to this file")
    ap.add_argument("--write", type=Path,
                    help="markdown file whose startup.py section to replace (docs/benchmarks.md)")
    args = ap.parse_args(argv)

    notes: list[str] = []
    commands: dict[str, list[str]] = {"python3 -c pass": [sys.executable, "-c", "pass"]}
    mplower = console_script("mplower")
    if mplower is None:
        raise SystemExit("the mplower console script is not installed (pip install -e .)")
    commands[f"mplower opt {EXAMPLE} --pass=assign-precision"] = [
        mplower, "opt", EXAMPLE, "--pass=assign-precision"]
    commands["mplower passes"] = [mplower, "passes"]
    tmp = tempfile.TemporaryDirectory()
    xdsl = console_script("xdsl-opt")
    if xdsl is None:
        notes.append("xdsl-opt is not installed (`pip install -e .[bench]`); no reference row.")
    else:
        one_op = Path(tmp.name) / "one_op.mlir"
        one_op.write_text(ONE_OP)
        commands["xdsl-opt one_op.mlir"] = [xdsl, str(one_op)]

    # An installed package has its bytecode compiled; a source checkout run with
    # PYTHONDONTWRITEBYTECODE would compile mplower's modules on every start instead, which
    # no user pays. The warm-up rounds write the bytecode (and numba's cache, if used).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    walls: dict[str, list[float]] = {name: [] for name in commands}
    cpus: dict[str, list[float]] = {name: [] for name in commands}
    for round_ in range(args.warmup + args.repeat):
        for name, cmd in commands.items():
            wall, cpu = time_once(cmd, env)
            if round_ >= args.warmup:
                walls[name].append(wall)
                cpus[name].append(cpu)
    tmp.cleanup()

    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    lines = [
        (f"- command: `{shlex.join(['python3', 'benchmarks/startup.py'] + sys.argv[1:])}`; "
         f"date {date}, load average {os.getloadavg()[0]:.2f}; mplower {version('mplower')}, "
         f"xdsl {version('xdsl')}"),
        (f"- machine: {cpu_model()}, {nproc} cores available, {platform.platform()}, "
         f"Python {platform.python_version()}"),
        (f"- each command in a fresh process, interleaved: {args.repeat} timed runs after "
         f"{args.warmup} warm-up rounds; one_op.mlir is a func.func with one arith.addf"),
        "",
        "| command | wall median (s) | wall fastest (s) | CPU median, user + system (s) |",
        "|---|---:|---:|---:|",
    ]
    for name, w in walls.items():
        lines.append(f"| `{name}` | {statistics.median(w):.3f} | {min(w):.3f} | "
                     f"{statistics.median(cpus[name]):.3f} |")
    heavy = heavy_imports()
    lines += ["", "Heavy libraries that `mplower opt ... --pass=assign-precision` imports: "
              + (", ".join(heavy) if heavy else "none") + "."]
    opt = next(k for k in walls if k.startswith("mplower opt"))
    ref = "xdsl-opt one_op.mlir"
    if ref in walls:
        wall = [statistics.median(walls[k]) for k in (opt, ref)]
        cpu = [statistics.median(cpus[k]) for k in (opt, ref)]
        met = wall[0] <= wall[1] and cpu[0] <= cpu[1]
        lines.append(f"Start-up no slower than xdsl-opt's (median wall {wall[0]:.3f} against "
                     f"{wall[1]:.3f} s, CPU {cpu[0]:.3f} against {cpu[1]:.3f} s): "
                     + ("met." if met else "NOT met."))
    lines += [f"Note: {n}" for n in notes]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
    if args.write:
        replace_block(args.write, lines, "<!-- startup.py begin -->", "<!-- startup.py end -->")
    return 0


if __name__ == "__main__":
    sys.exit(main())
