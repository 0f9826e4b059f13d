"""Located diagnostics: `file:line:col: error: message`, the source line and a caret.

Every user-facing failure in mplower is a `Diagnostic` carried by a `DiagnosticError`; the CLI
prints it and exits 1. Nothing below the CLI prints or exits. Lines longer than a terminal are
shown as a window around the column so that a 12 MB single-line file still gets a readable
message.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field

_WINDOW = 120  # characters of a long source line shown around the caret


@dataclass(frozen=True, slots=True)
class Location:
    file: str
    line: int  # 1-based; 0 when unknown
    col: int  # 1-based; 0 when unknown

    def __str__(self) -> str:
        if self.line <= 0:
            return self.file
        return f"{self.file}:{self.line}:{self.col}"


UNKNOWN = Location("<unknown>", 0, 0)


@dataclass
class Diagnostic:
    loc: Location
    message: str
    severity: str = "error"  # error | warning | remark | note
    notes: list[Diagnostic] = field(default_factory=list)

    def render(self, source: str | None = None) -> str:
        out = [f"{self.loc}: {self.severity}: {self.message}"]
        line = source_line(source, self.loc.line) if source is not None else None
        if line is not None and self.loc.col > 0:
            text, caret_col = _window(line, self.loc.col)
            out.append(text)
            out.append(" " * (caret_col - 1) + "^")
        for n in self.notes:
            out.append(n.render(source))
        return "\n".join(out)


class DiagnosticError(Exception):
    """Raised with one or more diagnostics; the CLI renders them against the source."""

    def __init__(self, *diagnostics: Diagnostic):
        super().__init__(diagnostics[0].message if diagnostics else "error")
        self.diagnostics = list(diagnostics)
        # The text the locations point into, when whoever raised it has the only copy (the CLI
        # has none for a file that is not valid UTF-8).
        self.source: str | None = None

    @classmethod
    def at(cls, loc: Location, message: str) -> DiagnosticError:
        return cls(Diagnostic(loc, message))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`"; did you mean 'x'?"` for the closest choice, or "" when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def source_line(source: str, line: int) -> str | None:
    if line <= 0:
        return None
    start = 0
    for _ in range(line - 1):
        start = source.find("\n", start)
        if start < 0:
            return None
        start += 1
    end = source.find("\n", start)
    return source[start:] if end < 0 else source[start:end]


def _window(line: str, col: int) -> tuple[str, int]:
    """The part of `line` to show and the caret's column within it."""
    line = line.replace("\t", " ")
    if len(line) <= _WINDOW:
        return line, col
    lo = max(0, col - 1 - _WINDOW // 2)
    hi = min(len(line), lo + _WINDOW)
    prefix = "..." if lo > 0 else ""
    suffix = "..." if hi < len(line) else ""
    return prefix + line[lo:hi] + suffix, col - lo + len(prefix)
