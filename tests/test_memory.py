"""The executor keeps freed tensor memory for the next run (mplower.backend.memory)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the settings are glibc's malloc's")

# Resident memory (from /proc) with a 20 MiB array touched, then after it is freed: a run's
# activation of that size either stays mapped for the next run or goes back to the kernel.
_CHILD = """
import sys
import numpy as np
from mplower.backend.memory import keep_freed_memory

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

applied = keep_freed_memory() if sys.argv[1] == "keep" else False
x = np.ones(5 << 20, np.float32)
touched = rss()
del x
print(applied, touched - rss())
"""


def _freed_bytes_returned(mode: str, env: dict[str, str]) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True,
                         check=True, env=env).stdout.split()
    return out[0], int(out[1])


def test_freed_activation_memory_stays_for_the_next_run_and_opting_out_restores_malloc() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("MPLOWER_MALLOC", None)
    applied, returned = _freed_bytes_returned("keep", env)
    assert applied == "True"
    assert returned < 1 << 20  # the 20 MiB stay resident, ready for reuse
    applied, returned = _freed_bytes_returned("default", env)
    assert applied == "False"
    assert returned >= 19 << 20  # glibc's default maps and unmaps a block this size
    applied, returned = _freed_bytes_returned("keep", {**env, "MPLOWER_MALLOC": "default"})
    assert applied == "False"
    assert returned >= 19 << 20


def test_run_lowered_applies_the_setting() -> None:
    child = ("import numpy as np\n"
             "from mplower.backend.executor import Program\n"
             "from mplower.backend.memory import keep_freed_memory\n"
             "from mplower.ir.parser import parse\n"
             "p = Program(parse('func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {\\n"
             "  %y = mp.relu %x : (tensor<4xf32>) -> tensor<4xf32>\\n"
             "  return %y : tensor<4xf32>\\n}\\n', 'm.ir'))\n"
             "print(keep_freed_memory.cache_info().currsize)\n"
             "p.run_lowered(p.prepare_inputs([np.ones(4, np.float32)]))\n"
             "print(keep_freed_memory.cache_info().currsize, keep_freed_memory())\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["0", "1", "True"]
