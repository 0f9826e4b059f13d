"""Located diagnostics: `file:line:col: error: message`, the source line and a caret.

Every user-facing failure in mplower is a `Diagnostic` carried by a `DiagnosticError`; the CLI
prints it and exits 1. Nothing below the CLI prints or exits. Lines longer than a terminal are
shown as a window around the column so that a 12 MB single-line file still gets a readable
message. The source's line starts are found once per text (`SourceText`), so rendering many
diagnostics costs the length of the text plus that of their lines, not a rescan per message;
`DiagnosticRenderer` shows the first few errors of a run (clang's `-ferror-limit`) and counts
the rest.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

_WINDOW = 120  # characters of a long source line shown around the caret
DEFAULT_ERROR_LIMIT = 20  # errors shown per run unless the user asks for more (0: all)
# CR LF, a lone CR and LF all end a line, for the parser and for the lines shown here.
LINE_BREAK = re.compile(r"\r\n?|\n")


@dataclass(frozen=True, slots=True)
class Location:
    file: str
    line: int  # 1-based; 0 when unknown
    col: int  # 1-based; 0 when unknown

    def __deepcopy__(self, memo: dict) -> Location:  # immutable: a module's copy shares it
        return self

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

    def render(self, source: str | SourceText | None = None) -> str:
        if isinstance(source, str):
            source = SourceText(source)
        out = [f"{self.loc}: {self.severity}: {self.message}"]
        line = source.line(self.loc.line) if source is not None else None
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


class SourceText:
    """A text whose lines are looked up by number; the line starts are found on first use."""

    def __init__(self, text: str):
        self.text = text
        self._spans: list[tuple[int, int]] | None = None  # (start, end) of each line

    def line(self, number: int) -> str | None:
        """Line `number` (1-based) without its line break, or None past the end."""
        if self._spans is None:
            self._spans, start = [], 0
            for m in LINE_BREAK.finditer(self.text):
                self._spans.append((start, m.start()))
                start = m.end()
            self._spans.append((start, len(self.text)))
        if not 0 < number <= len(self._spans):
            return None
        start, end = self._spans[number - 1]
        return self.text[start:end]


class DiagnosticRenderer:
    """Renders the diagnostics of one run up to `limit` errors in all (0: no limit).

    The last source is kept, so a text's lines are indexed once however many diagnostics point
    into it. Past the limit nothing more is rendered; `hidden` records what was left out.
    """

    def __init__(self, limit: int = DEFAULT_ERROR_LIMIT):
        self.limit = limit
        self.errors = 0
        self.hidden: list[str] = []  # severities of the diagnostics left out
        self._source: SourceText | None = None

    def render(self, diags: Sequence[Diagnostic], source: str | None) -> str:
        """The text for `diags` that fits within the limit, one diagnostic per line group."""
        text = None
        if source is not None:
            if self._source is None or self._source.text is not source:
                self._source = SourceText(source)
            text = self._source
        out = []
        for d in diags:
            if self.limit and self.errors >= self.limit:
                self.hidden.append(d.severity)
                continue
            self.errors += d.severity == "error"
            out.append(d.render(text) + "\n")
        return "".join(out)

    def summary(self) -> str | None:
        """`N more errors not shown`, or None when everything was shown."""
        if not self.hidden:
            return None
        n = len(self.hidden)
        kind = "error" if set(self.hidden) == {"error"} else "diagnostic"
        return f"{n} more {kind}{'s' if n != 1 else ''} not shown"


# What a terminal would break the shown line at or move the caret by, shown as one space each:
# only LF (and CR) end a line for the lexer and the editor, so columns count these as one
# character. (Python's str.splitlines also breaks at U+2028 and the rest: never used here.)
_SHOWN_AS_SPACE = str.maketrans(dict.fromkeys("\t\v\f\x1c\x1d\x1e\x85\u2028\u2029", " "))


def _window(line: str, col: int) -> tuple[str, int]:
    """The part of `line` to show and the caret's column within it."""
    line = line.translate(_SHOWN_AS_SPACE)
    if len(line) <= _WINDOW:
        return line, col
    lo = max(0, col - 1 - _WINDOW // 2)
    hi = min(len(line), lo + _WINDOW)
    prefix = "..." if lo > 0 else ""
    suffix = "..." if hi < len(line) else ""
    return prefix + line[lo:hi] + suffix, col - lo + len(prefix)
