"""`--verify-diagnostics`: MLIR's `// expected-error @+1 {{...}}` comments checked against output.

An expectation names a severity, a line (its own, `@+N`, `@-N`, `@above`, `@below`) and a text
that must occur in the message of a diagnostic emitted on that line. Every emitted diagnostic
must be expected and every expectation must be met; mismatches become diagnostics themselves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mplower.ir.diagnostics import Diagnostic, Location

_EXPECT = re.compile(
    r"//\s*expected-(error|warning|remark|note)\s*(@(?:[+-]\d+|above|below))?\s*\{\{(.*?)\}\}")


@dataclass
class Expectation:
    severity: str
    line: int
    text: str
    loc: Location
    met: bool = False


def collect(text: str, file: str, line_offset: int = 0) -> list[Expectation]:
    out = []
    for i, line in enumerate(text.split("\n"), start=1 + line_offset):
        for m in _EXPECT.finditer(line):
            sev, where, msg = m.groups()
            target = i
            if where == "@above":
                target = i - 1
            elif where == "@below":
                target = i + 1
            elif where:
                target = i + int(where[1:])
            out.append(Expectation(sev, target, msg, Location(file, i, m.start() + 1)))
    return out


def check(expected: list[Expectation], emitted: list[Diagnostic]) -> list[Diagnostic]:
    """Diagnostics describing every unexpected emission and every unmet expectation."""
    problems = []
    for d in emitted:
        for e in expected:
            if not e.met and e.severity == d.severity and e.line == d.loc.line and e.text in d.message:
                e.met = True
                break
        else:
            problems.append(Diagnostic(d.loc, f"unexpected {d.severity}: {d.message}"))
    for e in expected:
        if not e.met:
            problems.append(Diagnostic(e.loc, f"expected {e.severity} \"{e.text}\" on line "
                                              f"{e.line} was not produced"))
    return problems
