"""Front-end speed and memory of mplower against xdsl-opt and iree-opt on large generated IR.

The script writes chains of N alternating `mp.add` / `mp.mul` ops on `tensor<4x8xf32>` (two
discardable attributes per op) in MLIR generic form, which xDSL, upstream MLIR (iree-opt) and
mplower all parse, and times a parse-and-print round trip (`FILE -o OUT`) of each tool in a
fresh subprocess: wall time (median of --repeat runs) and peak resident memory (the largest of
the runs, from GNU time when installed, which also covers wrappers that spawn the real binary).
With --mplower-phases it also times mplower's parse, verify and print in-process, in a fresh
interpreter per run. Tools that are not installed, and mplower stages that do not work yet, are
skipped with a note in the report. The per-1k-op columns show linearity: start-up dominates at
1k ops, the marginal cost between sizes does not include it.

With --error-paths it times mplower's error paths instead (issue 10): `mplower opt` on a file
whose every op is a verifier error (the default 20-error limit, and --error-limit=0 for all),
and on a file whose one op line holds a long run of spaces before its attribute dictionary.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TYPE = "tensor<4x8xf32>"
TOOLS = ("xdsl-opt", "iree-opt", "mplower")
PHASES = ("parse", "verify", "print")


def write_chain(path: Path, n_ops: int) -> None:
    """A `module { func.func @main }` whose body is a single use-def chain of n_ops ops."""
    with path.open("w") as f:
        f.write("module {\n")
        f.write(f"  func.func @main(%arg0: {TYPE}, %arg1: {TYPE}) -> {TYPE} {{\n")
        for i in range(n_ops):
            op = "mp.add" if i % 2 == 0 else "mp.mul"
            lhs = "%arg0" if i == 0 else f"%{i - 1}"
            rhs = f"%arg{(i + 1) % 2}"
            f.write(
                f'    %{i} = "{op}"({lhs}, {rhs}) {{mp.tag = "n{i}", mp.k = {i % 100} : i64}}'
                f" : ({TYPE}, {TYPE}) -> {TYPE}\n"
            )
        f.write(f"    func.return %{n_ops - 1} : {TYPE}\n  }}\n}}\n")


def write_errors(path: Path, n_errors: int) -> None:
    """A function whose n ops each declare a wrong result type: n verifier errors."""
    with path.open("w") as f:
        f.write(f"func.func @main(%x: {TYPE}) -> {TYPE} {{\n")
        for i in range(n_errors):
            f.write(f"  %{i} = mp.relu %x : ({TYPE}) -> tensor<8x4xf32>\n")
        f.write(f"  return %x : {TYPE}\n}}\n")


def write_spaces(path: Path, n_spaces: int) -> None:
    """One op whose line holds n spaces before an attribute dictionary the fast path refuses."""
    path.write_text(f"func.func @main(%x: {TYPE}) -> {TYPE} {{\n"
                    f"  %0 = mp.add %x, %x{' ' * n_spaces}{{mp.a = [1]}} : ({TYPE}, {TYPE}) -> "
                    f"{TYPE}\n  return %0 : {TYPE}\n}}\n")


def error_paths(args) -> int:
    """Median wall time of `mplower opt` on the error-path inputs, as a markdown report."""
    exe = console_script("mplower")
    if exe is None:
        progress("mplower: not installed")
        return 1
    cases = [(f"{n} verifier errors", write_errors, n, []) for n in args.errors] + [
        (f"{n} verifier errors, --error-limit=0", write_errors, n, ["--error-limit=0"])
        for n in args.errors] + [
        (f"{n} spaces in one op line", write_spaces, n, []) for n in args.spaces]
    rows, notes = [], []
    for label, write, n, extra in cases:
        path = args.workdir / f"{write.__name__}_{n}.ir"
        write(path, n)
        argv = [exe, "opt", str(path), "-o", os.devnull, *extra]
        times = []
        for _ in range(args.repeat):
            run = run_once(argv, args.timeout, None)
            if run.returncode < 0:
                notes.append(f"{label}: killed after {args.timeout:.0f} s")
                break
            expect = 1 if "errors" in label else 0
            if run.returncode != expect:
                notes.append(f"{label}: exit status {run.returncode}, expected {expect}")
                break
            times.append(run.seconds)
            progress(f"  {label:45s} {run.seconds:8.3f} s")
        if len(times) == args.repeat:
            rows.append(f"| {label} | {statistics.median(times):.3f} |")
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        "# mplower error-path benchmark",
        "",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        f"- machine: {platform.platform()}, {cpu_model()}, nproc {nproc}",
        f"- Python {platform.python_version()}; mplower: `{exe} opt FILE -o /dev/null`",
        f"- median of {args.repeat} runs, wall time including start-up and printing the errors",
        "",
        "| input | median s |",
        "|---|---:|",
        *rows,
    ]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


def console_script(name: str) -> str | None:
    """Prefer the script beside this interpreter: a pyenv shim would add a shell start-up."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def iree_opt_binary() -> str | None:
    """The native iree-opt: the `iree-opt` console script only starts Python to spawn it.

    Located without importing iree.compiler, which would load its MLIR libraries into this
    process and so raise the memory floor of every child it forks (see run_once).
    """
    try:
        spec = importlib.util.find_spec("iree.compiler")
    except ModuleNotFoundError:  # no `iree` package at all (the bench extra is optional)
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            native = Path(folder) / "_mlir_libs" / "iree-opt"
            if native.exists():
                return str(native)
    return console_script("iree-opt")


def gnu_time() -> str | None:
    """GNU time, if installed: it measures its child's peak RSS from a 1 MB process of its own."""
    exe = shutil.which("time")
    if exe is None:
        return None
    probe = subprocess.run([exe, "-f", "%M", "-o", os.devnull, "true"], check=False)
    return exe if probe.returncode == 0 else None


def tool_commands(names: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """argv templates (FILE and OUT are substituted per run) and notes for tools not found."""
    commands, notes = {}, []
    found = {
        "xdsl-opt": console_script("xdsl-opt"),
        "iree-opt": iree_opt_binary(),
        "mplower": console_script("mplower"),
    }
    for name in names:
        exe = found[name]
        if exe is None:
            notes.append(f"{name}: not installed, skipped.")
        elif name == "mplower":
            commands[name] = [exe, "opt", "FILE", "-o", "OUT"]
        else:
            commands[name] = [exe, "--allow-unregistered-dialect", "FILE", "-o", "OUT"]
    return commands, notes


@dataclass
class Run:
    seconds: float
    peak_rss: int  # bytes
    returncode: int
    stdout: str
    stderr: str


def run_once(argv: list[str], timeout: float, time_exe: str | None) -> Run:
    """Run argv to completion; wall time from here, peak RSS from GNU time or wait4.

    A child's peak RSS starts at its parent's RSS when it forks (Linux carries the pre-exec
    high-water mark across exec), so wait4 on a child of this Python process never reads below
    this process's own size. Under GNU time the floor is time's own ~1 MB.
    """
    with tempfile.TemporaryDirectory() as tmp:
        rss_file = Path(tmp) / "rss"
        if time_exe is not None:
            argv = [time_exe, "-f", "%M", "-o", str(rss_file), *argv]
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with out.open("w") as out_f, err.open("w") as err_f:
            start = time.perf_counter()
            proc = subprocess.Popen(
                argv, stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL, start_new_session=True
            )
            # Kill the whole session: killing GNU time alone would orphan the tool.
            killer = threading.Timer(timeout, kill_group, (proc.pid,))
            killer.start()
            _, status, usage = os.wait4(proc.pid, 0)
            seconds = time.perf_counter() - start
            killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        # GNU time may write "Command exited with non-zero status N" first, and nothing at all
        # when the timeout killed it too.
        words = rss_file.read_text().split() if rss_file.exists() else []
        if words and words[-1].isdigit():
            peak = int(words[-1]) * 1024
        else:
            # ru_maxrss is KiB on Linux and bytes on macOS.
            peak = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return Run(seconds, peak, proc.returncode, out.read_text(), err.read_text())


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class Row:
    tool: str
    ops: int
    seconds: float
    peak_rss: int | None = None


def failure(run: Run, out: Path | None) -> str | None:
    """Why a run does not count, or None: a tool that exits 0 without writing OUT is not ready."""
    if run.returncode < 0:
        return f"killed by signal {-run.returncode} (past --timeout?)"
    if run.returncode != 0:
        lines = (run.stderr.strip() or run.stdout.strip() or "(no output)").splitlines()
        # A diagnostic's "error:" line says more than a traceback's or a hint's last line.
        line = next((x for x in lines if "error" in x.lower()), lines[-1])
        return f"exit status {run.returncode}: {line.strip()[:200]}"
    if out is not None and (not out.exists() or out.stat().st_size == 0):
        return "exited 0 but wrote no output file (not implemented yet?)"
    return None


def measure_tool(name, template, path, n_ops, args, notes) -> Row | None:
    out = args.workdir / f"{path.stem}.{name}.out.mlir"
    argv = [str(path) if a == "FILE" else str(out) if a == "OUT" else a for a in template]
    runs = []
    for _ in range(args.repeat):
        out.unlink(missing_ok=True)
        run = run_once(argv, args.timeout, args.time_exe)
        why = failure(run, out)
        if why is not None:
            notes.append(f"{name} on {n_ops} ops: {why}; skipped.")
            return None
        runs.append(run)
        progress(
            f"  {name:9s} {n_ops:>7d} ops  {run.seconds:8.3f} s  {run.peak_rss / 2**20:7.1f} MB"
        )
    times = [r.seconds for r in runs]
    return Row(name, n_ops, statistics.median(times), max(r.peak_rss for r in runs))


def measure_phases(path, n_ops, args, notes) -> list[Row]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--phase-worker", str(path)]
    samples = []
    for _ in range(args.repeat):
        run = run_once(argv, args.timeout, args.time_exe)
        why = failure(run, None)
        if why is not None:
            notes.append(f"mplower phases on {n_ops} ops: {why}; skipped.")
            return []
        samples.append(json.loads(run.stdout) | {"peak_rss": run.peak_rss})
        progress(
            f"  phases    {n_ops:>7d} ops  "
            + "  ".join(f"{p} {samples[-1][p]:.3f} s" for p in PHASES)
        )
    rows = [Row(f"mplower {p}", n_ops, statistics.median(s[p] for s in samples)) for p in PHASES]
    total = [sum(s[p] for p in PHASES) for s in samples]
    peak = max(s["peak_rss"] for s in samples)
    rows.append(Row("mplower parse+verify+print", n_ops, statistics.median(total), peak))
    return rows


def phase_worker(path: str) -> int:
    """Runs in a fresh interpreter: one parse, verify and print, timed, as JSON on stdout."""
    try:
        from mplower.ir.parser import parse_file
        from mplower.ir.printer import print_module
        from mplower.ir.verifier import verify
    except ImportError as e:
        print(f"mplower is not ready: {e}", file=sys.stderr)
        return 3
    t0 = time.perf_counter()
    module = parse_file(path)
    t1 = time.perf_counter()
    verify(module)
    t2 = time.perf_counter()
    text = print_module(module)
    t3 = time.perf_counter()
    assert text, "print_module returned nothing"
    print(json.dumps({"parse": t1 - t0, "verify": t2 - t1, "print": t3 - t2}))
    return 0


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def versions() -> str:
    found = []
    for dist in ("xdsl", "iree-base-compiler", "mplower"):
        try:
            found.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{dist} (not installed)")
    return ", ".join(found)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def report(rows: list[Row], commands: dict[str, list[str]], notes: list[str], args) -> str:
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        "# mplower front-end benchmark",
        "",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        f"- machine: {platform.platform()}, {cpu_model()}, nproc {nproc}",
        f"- Python {platform.python_version()}; {versions()}",
        f"- input: alternating mp.add / mp.mul chain on {TYPE}, 2 attributes per op, generic form",
        f"- {args.repeat} runs each: median wall time, peak RSS = largest of the runs, "
        + (
            f"measured by `{args.time_exe} -f %M`"
            if args.time_exe
            else "from wait4 (GNU time not found: floor is this script's own RSS)"
        ),
    ]
    for name, template in commands.items():
        lines.append(f"- {name}: `{shlex.join(template)}`")
    if args.mplower_phases:
        lines.append(
            "- mplower phases: parse_file, verify, print_module, in a fresh interpreter per run"
        )
    lines += [
        "",
        "| tool | ops | median s | s per 1k ops | peak RSS MB | time / mplower opt |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    mplower_s = {r.ops: r.seconds for r in rows if r.tool == "mplower"}
    order = {tool: i for i, tool in enumerate(dict.fromkeys(r.tool for r in rows))}
    rows = sorted(rows, key=lambda r: (order[r.tool], r.ops))  # one block per tool: linearity
    for r in rows:
        rss = f"{r.peak_rss / 2**20:.1f}" if r.peak_rss is not None else "—"
        ratio = f"{r.seconds / mplower_s[r.ops]:.2f}" if r.ops in mplower_s else "—"
        lines.append(
            f"| {r.tool} | {r.ops} | {r.seconds:.3f} | {r.seconds / r.ops * 1000:.4f} | {rss} | {ratio} |"
        )
    slopes = marginal_costs(rows)
    if slopes:
        lines += [
            "",
            "Marginal seconds per 1k ops between consecutive sizes (start-up cancels out):",
            "",
        ]
        lines += [f"- {tool}: {text}" for tool, text in slopes.items()]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def marginal_costs(rows: list[Row]) -> dict[str, str]:
    by_tool: dict[str, list[Row]] = {}
    for r in rows:
        by_tool.setdefault(r.tool, []).append(r)
    slopes = {}
    for tool, rs in by_tool.items():
        rs.sort(key=lambda r: r.ops)
        parts = [
            f"{a.ops}->{b.ops}: {(b.seconds - a.seconds) / (b.ops - a.ops) * 1000:.4f}"
            for a, b in itertools.pairwise(rs)
        ]
        if parts:
            slopes[tool] = ", ".join(parts)
    return slopes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="op counts, comma-separated")
    parser.add_argument("--tools", default=",".join(TOOLS), help="subset of " + ",".join(TOOLS))
    parser.add_argument("--repeat", type=int, default=3, help="runs per tool and size (median)")
    parser.add_argument(
        "--mplower-phases", action="store_true", help="also time parse/verify/print"
    )
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=REPO / "benchmarks" / "out" / "frontend",
        help="where the generated IR and tool outputs go (default: the git-ignored benchmarks/out/)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--phase-worker", metavar="FILE", help=argparse.SUPPRESS)
    parser.add_argument("--error-paths", action="store_true",
                        help="time mplower's error paths instead of the round trip")
    parser.add_argument("--errors", default="20000,100000",
                        type=lambda s: [int(n) for n in s.split(",")],
                        help="--error-paths: verifier error counts, comma-separated")
    parser.add_argument("--spaces", default="128000,1024000",
                        type=lambda s: [int(n) for n in s.split(",")],
                        help="--error-paths: lengths of the run of spaces, comma-separated")
    args = parser.parse_args(argv)
    if args.phase_worker:
        return phase_worker(args.phase_worker)
    if args.error_paths:
        args.workdir.mkdir(parents=True, exist_ok=True)
        return error_paths(args)

    sizes = [int(s) for s in args.sizes.split(",")]
    names = [t for t in args.tools.split(",") if t]
    unknown = sorted(set(names) - set(TOOLS))
    if unknown:
        parser.error(f"unknown tool(s) {', '.join(unknown)}; choose from {', '.join(TOOLS)}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    commands, notes = tool_commands(names)
    args.time_exe = gnu_time()

    rows: list[Row] = []
    failed: set[str] = set()  # a tool that fails at one size is not retried on larger ones
    for n_ops in sizes:
        path = args.workdir / f"chain_{n_ops}.mlir"
        write_chain(path, n_ops)
        progress(f"{path} ({path.stat().st_size / 2**20:.1f} MB)")
        for name, template in commands.items():
            if name in failed:
                continue
            row = measure_tool(name, template, path, n_ops, args, notes)
            if row is None:
                failed.add(name)
            else:
                rows.append(row)
        if args.mplower_phases and "phases" not in failed:
            phase_rows = measure_phases(path, n_ops, args, notes)
            if not phase_rows:
                failed.add("phases")
            rows += phase_rows

    text = report(rows, commands, notes, args)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
