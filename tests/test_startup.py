"""What the short commands import: lit tests and scripts start `mplower` hundreds of times.

Start-up time itself is measured by benchmarks/startup.py (speed goals never live in timed
tests); these tests pin its cause instead, as values: which heavy libraries a fresh process has
in sys.modules after a command that does not need them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Libraries that cost a large share of a start-up and that none of these commands uses
# (scipy comes in with numba).
HEAVY = ("numba", "scipy", "onnx", "dask", "matplotlib", "jax")


def imported_after(argv: list[str], **env_extra: str) -> dict:
    """Exit code, stdout, the HEAVY libraries and the pass modules loaded after `mplower ARGV`,
    run in a fresh interpreter from the repository root."""
    code = (
        "import contextlib, io, json, os, sys\n"
        "from mplower.cli.main import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    rc = main({argv!r})\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "passes = sorted(m for m in sys.modules if m.startswith('mplower.passes.'))\n"
        "print(json.dumps({'rc': rc, 'stdout': out.getvalue(), 'heavy': heavy,\n"
        "                  'passes': passes,\n"
        "                  'blas_threads': os.environ.get('OPENBLAS_NUM_THREADS')}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"} | env_extra
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_opt_assign_precision_imports_no_numba_onnx_dask_matplotlib() -> None:
    result = imported_after(["opt", "ir_examples/mlp.ir", "--pass=assign-precision",
                             "-o", os.devnull])
    assert (result["rc"], result["heavy"]) == (0, [])


def test_opt_imports_the_pass_modules_of_its_pipeline_not_the_whole_library() -> None:
    result = imported_after(["opt", "ir_examples/mlp.ir", "--pass=cse", "-o", os.devnull])
    assert (result["rc"], result["passes"]) == (0, ["mplower.passes.cse"])


def test_opt_assign_precision_prints_the_plan_without_heavy_imports() -> None:
    result = imported_after(["opt", "ir_examples/mlp.ir", "--pass=assign-precision"])
    assert (result["rc"], result["heavy"]) == (0, [])
    assert "mp.precision = bf16" in result["stdout"]


def test_passes_lists_every_builtin_pass_without_heavy_imports() -> None:
    # The registry stays complete although no pass module may import a heavy library at load.
    result = imported_after(["passes"])
    assert (result["rc"], result["heavy"]) == (0, [])
    modules = {p.stem.replace("_", "-") for p in (ROOT / "passes").glob("*.py")
               if p.stem != "__init__"}
    listed = {line.split()[0] for line in result["stdout"].splitlines()
              if line and not line[0].isspace()}
    assert modules <= listed


def test_report_of_a_module_without_sparse_ops_imports_no_numba() -> None:
    # Only the sparse reality check runs kernels, and mlp.ir has no sparse op to measure.
    result = imported_after(["report", "ir_examples/mlp.ir"])
    assert (result["rc"], result["heavy"]) == (0, [])
    assert "mp.matmul" in result["stdout"]


def test_commands_load_openblas_with_one_thread_unless_told_otherwise() -> None:
    # OpenBLAS's thread pool costs ~0.1 s of CPU per start and mplower's float products never
    # use BLAS (numerics/gemm.py), so the command sets one thread before numpy loads...
    assert imported_after(["passes"])["blas_threads"] == "1"
    # ... and keeps the user's own setting.
    assert imported_after(["passes"], OPENBLAS_NUM_THREADS="2")["blas_threads"] == "2"
