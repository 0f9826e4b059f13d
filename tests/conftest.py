"""Shared helpers for the core tests: the CLI run in-process, IR built from a body, both parse paths.

`cli` runs `mplower.cli.main.main` in this process and returns exit code, stdout and stderr (argparse's
own usage errors exit through SystemExit; their code is returned the same way). `func_ir` wraps
an op body in a function so that a test shows only the lines it is about. `general_path` parses
with the lexer's SIMPLE_OP fast path switched off, so that a test can compare the two paths.

Hypothesis profiles: `HYPOTHESIS_PROFILE=deep` runs the property tests that ask for
`examples(n)` at 5,000 examples each instead of n (minutes, not part of the normal suite).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

import mplower.dialect  # noqa: F401  (registers the mp ops: the IR layer alone knows none)
import mplower.ir.parser as parser_module
from mplower.cli.main import main
from mplower.ir.graph import Module
from mplower.ir.parser import parse
from mplower.ir.printer import print_module

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "ir_examples").glob("*.ir"))

DEEP_EXAMPLES = 5000
settings.register_profile("deep", max_examples=DEEP_EXAMPLES, deadline=None)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """A property test's example count: `n`, or the deep profile's."""
    return DEEP_EXAMPLES if PROFILE == "deep" else n


@dataclass
class CliResult:
    rc: int
    out: str
    err: str


@pytest.fixture
def unscheduled_helpers(monkeypatch: pytest.MonkeyPatch) -> list:
    """Worker helpers that the OS never runs (another process holds the core): work handed to
    them lands in the returned list and is never done, so the caller must do it all."""
    from mplower.numerics import workers

    dropped: list = []

    class Unscheduled:  # the helpers' queue, never read
        put = dropped.append

    monkeypatch.setattr(workers, "_ensure_helpers", lambda count: None)
    monkeypatch.setattr(workers, "_tasks", Unscheduled)
    return dropped


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    def run(*args: object) -> CliResult:
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # argparse's usage errors
            rc = e.code if isinstance(e.code, int) else 1
        out, err = capsys.readouterr()
        return CliResult(rc, out, err)

    return run


def func_ir(body: str, args: str = "%x: tensor<2x3xf32>", result: str = "tensor<2x3xf32>",
            name: str = "f") -> str:
    """`func.func @name(args) -> result { body }`; body lines are indented by two spaces."""
    lines = "".join(f"  {line}\n" for line in body.strip("\n").split("\n"))
    head = f"func.func @{name}({args})" + (f" -> {result}" if result else "")
    return f"{head} {{\n{lines}}}\n"


def roundtrip(text: str) -> str:
    return print_module(parse(text))


# The lexer's master regex without the SIMPLE_OP alternative: every op goes through the grammar.
_GENERAL_MASTER = re.compile(
    parser_module._SPACE + "(?:" + "|".join(f"(?P<{n}>{p})" for n, p in parser_module._TOKENS
                                           if n != "SIMPLE_OP") + ")")


@contextlib.contextmanager
def general_path() -> Iterator[None]:
    fast = parser_module._MASTER
    parser_module._MASTER = _GENERAL_MASTER
    try:
        yield
    finally:
        parser_module._MASTER = fast


def parse_general(text: str, file: str = "<stdin>") -> Module:
    with general_path():
        return parse(text, file)


def sequential_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (M, K) @ b (K, N) summed as mplower promises (mplower.numerics.gemm), written with
    numpy alone: c = 0, then c = c + a[:, k] * b[k, :] for k ascending, each product and each
    sum rounded to the operands' precision (elementwise numpy ops, so no BLAS and no FMA)."""
    c = np.zeros((a.shape[0], b.shape[1]), np.result_type(a, b))
    for k in range(a.shape[1]):
        c = c + a[:, k:k + 1] * b[k:k + 1, :]
    return c
