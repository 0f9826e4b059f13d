"""TOML sheets with located diagnostics: the loading layer shared by policy.py and target.py.

Policy sheets and target descriptions are small TOML files that users write by hand, so every
mistake in them must come back as a `DiagnosticError` pointing at the line that holds it.
`tomllib` reports positions only for syntax errors and keeps none for keys, so `Sheet` scans
the source once and records where each key (and each table header) was written; value
checkers then ask for the location of a key path such as `("override", 1, "compute")`, or of
one string inside a key's value (an op name in a list). The scan understands what these
sheets use (tables, arrays of tables, dotted and quoted keys, one-line inline tables) and
falls back to the nearest enclosing key it knows for anything else. Numbers are checked
against per-field `Bounds` (NaN, inf and integers beyond a float are refused like any value out
of range), and `locate` confines a sheet that a module names to the module's folder.
"""

from __future__ import annotations

import bisect
import math
import re
import tomllib
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mplower.io.atomic import module_relative
from mplower.ir.diagnostics import DiagnosticError, Location, did_you_mean
from mplower.ir.graph import Module
from mplower.ir.types import int_text
from mplower.numerics.formats import FORMATS

KeyPath = tuple[str | int, ...]

_PART = r'(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|\'[^\']*\')'
_DOTTED = rf"{_PART}(?:\s*\.\s*{_PART})*"
# A header is alone on its line, so that a one-element array inside a multi-line array
# (`  ["a"],`) is not taken for one.
_ARRAY_HEADER = re.compile(rf"\s*\[\[\s*({_DOTTED})\s*\]\]\s*(?:#.*)?$")
_TABLE_HEADER = re.compile(rf"\s*\[\s*({_DOTTED})\s*\]\s*(?:#.*)?$")
_KEY = re.compile(rf"\s*({_DOTTED})\s*=")
_TOML_POS = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")
_TOML_END = re.compile(r"\s*\(at end of document\)$")


def _split_dotted(text: str) -> tuple[str, ...]:
    return tuple(_key_part(m.group(0)) for m in re.finditer(_PART, text))


def _key_part(part: str) -> str:
    """The key a part of a dotted key names: a basic string's escapes (`"\u0066oo"`) decoded
    as TOML decodes them, so that the key is found where it was written."""
    if part.startswith('"') and "\\" in part:
        try:
            return tomllib.loads(f"k = {part}")["k"]
        except tomllib.TOMLDecodeError:
            pass
    return part.strip("'\"")


@dataclass
class Sheet:
    """A parsed TOML file and the offset in `text` where each key path was written."""

    path: str  # as shown in diagnostics
    text: str
    data: dict[str, Any]
    _offsets: dict[KeyPath, int] = field(default_factory=dict, repr=False)
    _line_starts: list[int] = field(default_factory=list, repr=False)

    @classmethod
    def parse(cls, text: str, path: str) -> Sheet:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            err = DiagnosticError.at(*_syntax_error(str(e), text, path))
            err.source = text  # the CLI would otherwise show a line of the model's IR
            raise err from None
        except ValueError:  # tomllib's int() of a literal past Python's limit on digits
            err = DiagnosticError.at(*_too_many_digits(text, path))
            err.source = text
            raise err from None
        sheet = cls(path, text, data)
        sheet._scan()
        return sheet

    @classmethod
    def read(cls, path: Path) -> Sheet:
        where = Location(str(path), 0, 0)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DiagnosticError.at(where, f"cannot read: {e.strerror}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            # Located as the TOML parser locates: lines end at LF, columns count characters.
            head = data[:e.start].decode("utf-8")
            loc = Location(str(path), head.count("\n") + 1, len(head) - head.rfind("\n"))
            err = DiagnosticError.at(loc, f"invalid UTF-8 byte 0x{data[e.start]:02x} at byte "
                                          f"{e.start}; a sheet is UTF-8 text")
            err.source = data.decode("utf-8", "replace")
            raise err from None
        return cls.parse(text, str(path))

    def named(self, table: str, name: str) -> str:
        """The sheet's text with `name = "NAME"` in its `[table]` when the table sets none
        (and is written as a `[table]` header, the form every sheet uses)."""
        off = self._offsets.get((table,))
        if "name" in self.data.get(table, {}) or off is None:
            return self.text
        line_start = self._line_starts[bisect.bisect_right(self._line_starts, off) - 1]
        line_end = self.text.find("\n", off)
        if line_end < 0 or not _TABLE_HEADER.match(self.text[line_start:line_end]):
            return self.text
        quoted = name.replace("\\", "\\\\").replace('"', '\\"')
        return f'{self.text[:line_end + 1]}name = "{quoted}"\n{self.text[line_end + 1:]}'

    def _scan(self) -> None:
        self._line_starts = [0] + [m.end() for m in re.finditer("\n", self.text)]
        arrays: dict[KeyPath, int] = {}  # array-of-tables path -> index of its last element

        def expand(parts: tuple[str, ...]) -> KeyPath:
            # `[a.b]` under `[[a]]` refers to the last element of the array `a`.
            out: list[str | int] = []
            for p in parts:
                out.append(p)
                if tuple(out) in arrays:
                    out.append(arrays[tuple(out)])
            return tuple(out)

        current: KeyPath = ()
        in_multiline = False
        for start in self._line_starts:
            end = self.text.find("\n", start)
            line = self.text[start:] if end < 0 else self.text[start:end]
            was_multiline = in_multiline
            if (line.count('"""') + line.count("'''")) % 2:
                in_multiline = not in_multiline
            if was_multiline:
                continue
            if m := _ARRAY_HEADER.match(line):
                parent = expand(_split_dotted(m.group(1))[:-1])
                path = (*parent, _split_dotted(m.group(1))[-1])
                arrays[path] = arrays.get(path, -1) + 1
                current = (*path, arrays[path])
                self._offsets.setdefault(path, start + m.start(1))
                self._offsets[current] = start + m.start(1)
            elif m := _TABLE_HEADER.match(line):
                current = expand(_split_dotted(m.group(1)))
                self._offsets.setdefault(current, start + m.start(1))
            elif m := _KEY.match(line):
                parts = _split_dotted(m.group(1))
                for i in range(1, len(parts) + 1):
                    self._offsets.setdefault((*current, *parts[:i]), start + m.start(1))

    def _location(self, offset: int) -> Location:
        line = bisect.bisect_right(self._line_starts, offset)
        return Location(self.path, line, offset - self._line_starts[line - 1] + 1)

    def _offset(self, keypath: KeyPath) -> int | None:
        """Offset of `keypath`, or of the closest enclosing key, searching one-line inline
        tables (`bf16 = { dense = 1e12 }`) textually for the keys the scan cannot see."""
        for n in range(len(keypath), 0, -1):
            if (off := self._offsets.get(keypath[:n])) is not None:
                break
        else:
            return None
        line_end = self.text.find("\n", off)
        line_end = len(self.text) if line_end < 0 else line_end
        for part in keypath[n:]:
            if not isinstance(part, str):
                break
            m = re.compile(rf"(?<![\w.\"'-])[\"']?{re.escape(part)}[\"']?\s*=").search(
                self.text, off, line_end)
            if m is None:
                break
            off = m.start()
        return off

    def loc(self, keypath: KeyPath) -> Location:
        """Where the key at `keypath` was written (or its closest enclosing key); for a key
        the scan did not see (written in a form it does not follow), where its name first
        appears in the text, else the sheet's first line."""
        off = self._offset(keypath)
        if off is None:
            names = [p for p in keypath if isinstance(p, str)]
            hit = self.text.find(names[-1]) if names and names[-1] else -1
            off = max(hit, 0)
        return self._location(off)

    def value_loc(self, keypath: KeyPath, value: str) -> Location:
        """Where the string `value` first appears, quoted, in the value of `keypath`."""
        off = self._offset(keypath)
        if off is None:
            return self.loc(keypath)
        hits = [i for q in '"\'' if (i := self.text.find(f"{q}{value}{q}", off)) >= 0]
        return self._location(min(hits)) if hits else self._location(off)

    def error(self, keypath: KeyPath, message: str, *, value: str | None = None) -> DiagnosticError:
        loc = self.loc(keypath) if value is None else self.value_loc(keypath, value)
        err = DiagnosticError.at(loc, message)
        err.source = self.text  # the CLI would otherwise show a line of the model's IR
        return err

    # -- typed access: each raises a located diagnostic on the wrong shape ------------------

    def table(self, parent: dict[str, Any], keypath: KeyPath, *, required: bool = False
              ) -> dict[str, Any]:
        value = parent.get(keypath[-1])
        if value is None:
            if required:
                raise self.error(keypath[:-1], f"missing table [{_dotted(keypath)}]")
            return {}
        if not isinstance(value, dict):
            raise self.error(keypath, f"'{_dotted(keypath)}' must be a table")
        return value

    def tables(self, parent: dict[str, Any], keypath: KeyPath) -> list[dict[str, Any]]:
        """The array of tables `[[name]]` at `keypath` (empty when absent)."""
        value = parent.get(keypath[-1], [])
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            name = _dotted(keypath)
            raise self.error(keypath, f"'{name}' must be an array of tables: [[{name}]]")
        return value

    def check_keys(self, table: dict[str, Any], keypath: KeyPath, allowed: Collection[str]
                   ) -> None:
        """Reject keys of `table` that are not in `allowed`, suggesting the closest one."""
        for key in table:
            if key not in allowed:
                where = f" in [{_dotted(keypath)}]" if keypath else ""
                raise self.error((*keypath, key),
                                 f"unknown key '{key}'{where}{did_you_mean(key, allowed)}")

    def string(self, table: dict[str, Any], keypath: KeyPath, default: str | None = None,
               *, required: bool = False) -> str | None:
        return self._typed(table, keypath, str, "a string", default, required)

    def boolean(self, table: dict[str, Any], keypath: KeyPath, default: bool) -> bool:
        return self._typed(table, keypath, bool, "true or false", default, False)

    def number(self, table: dict[str, Any], keypath: KeyPath, bounds: Bounds,
               default: float | None = None, *, required: bool = False) -> float | None:
        """A number within `bounds`; TOML's nan and inf, and integers too large for a float,
        are refused like any other value out of range."""
        value = table.get(keypath[-1])
        if value is None:
            if required:
                raise self.error(keypath[:-1], f"missing key '{_dotted(keypath)}'")
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(keypath, f"'{_dotted(keypath)}' must be a number")
        if (problem := bounds.problem(value)) is not None:
            raise self.error(keypath, f"'{_dotted(keypath)}' {problem}")
        return float(value)

    def strings(self, table: dict[str, Any], keypath: KeyPath) -> tuple[str, ...]:
        value = table.get(keypath[-1], [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(keypath, f"'{_dotted(keypath)}' must be a list of strings")
        return tuple(value)

    def _typed(self, table, keypath, kind, what, default, required):
        value = table.get(keypath[-1])
        if value is None:
            if required:
                raise self.error(keypath[:-1], f"missing key '{_dotted(keypath)}'")
            return default
        if not isinstance(value, kind):
            raise self.error(keypath, f"'{_dotted(keypath)}' must be {what}")
        return value

    def choice(self, value: str, keypath: KeyPath, choices: Collection[str], what: str) -> str:
        """Check that `value` (a string in the value of `keypath`) is one of `choices`; `what`
        names the kind of thing in the message ("format", "op")."""
        if value not in choices:
            raise self.error(keypath, f"unknown {what} '{value}'{did_you_mean(value, choices)}",
                             value=value)
        return value

    def format(self, value: str, keypath: KeyPath, allowed: Collection[str], role: str) -> str:
        """Check a format name written in the value of `keypath` (see `format_problem`)."""
        if (problem := format_problem(value, allowed, role)) is not None:
            raise self.error(keypath, problem, value=value)
        return value


@dataclass(frozen=True)
class Bounds:
    """The values a number in a sheet may take: finite and within [low, high] (`unit` is for
    the message)."""

    low: float
    high: float
    unit: str = ""

    def problem(self, value: float) -> str | None:
        """What is wrong with `value`, as the end of a sentence about it, or None."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, not {value}"
        # An int compares exactly, however large: no float conversion that could overflow.
        if not self.low <= value <= self.high:
            # int_text: a hex literal past 4300 decimal digits has no decimal form to show.
            shown = int_text(value) if isinstance(value, int) else str(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            return f"must be between {self.low:g} and {self.high:g}{self.unit}, not {shown}"
        return None


def format_problem(name: str, allowed: Collection[str], role: str) -> str | None:
    """What is wrong with `name` as a format for `role` ("compute", "accumulator"), if
    anything. A real format in the wrong place is told apart from a typo."""
    if name in allowed:
        return None
    if name in FORMATS:
        article = "an" if role[0] in "aeiou" else "a"
        return f"'{name}' is not {article} {role} format (expected one of: {', '.join(allowed)})"
    return f"unknown format '{name}'{did_you_mean(name, FORMATS)}"


def toml_string(s: str) -> str:
    """`s` as a TOML basic string: quotes, backslashes and control characters escaped."""
    out = s.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c
                         for c in out) + '"'


def _dotted(keypath: KeyPath) -> str:
    return ".".join(str(p) for p in keypath if isinstance(p, str))


def _syntax_error(message: str, text: str, path: str) -> tuple[Location, str]:
    if m := _TOML_POS.search(message):
        loc = Location(path, int(m.group(1)), int(m.group(2)))
        message = message[: m.start()]
    elif m := _TOML_END.search(message):
        # Lines as tomllib counts them: LF ends one, U+2028 (a break to str.splitlines) not.
        lines = text.split("\n")
        if len(lines) > 1 and not lines[-1]:
            lines.pop()
        lines[-1] = lines[-1].removesuffix("\r")
        loc = Location(path, len(lines), len(lines[-1]) + 1)  # just after the last character
        message = message[: m.start()] + " at end of file"
    else:
        loc = Location(path, 0, 0)
    return loc, f"invalid TOML: {message[:1].lower()}{message[1:]}"


def _too_many_digits(text: str, path: str) -> tuple[Location, str]:
    """Where the integer literal that Python refuses to convert (more than
    sys.get_int_max_str_digits() digits) is, and a message saying so."""
    import sys

    limit = sys.get_int_max_str_digits()
    for m in re.finditer(r"[0-9][0-9_]*", text):
        digits = len(m.group().replace("_", ""))
        if digits > limit:
            line = text.count("\n", 0, m.start()) + 1
            loc = Location(path, line, m.start() - text.rfind("\n", 0, m.start()))
            return loc, (f"invalid TOML: integer literal has {digits} digits; at most {limit} "
                         f"are supported")
    return Location(path, 1, 1), "invalid TOML: a number too long to read"


def names_a_file(spec: str) -> bool:
    """A sheet spec that ends in `.toml` or contains a path separator is a file; anything
    else is the name of a built-in sheet."""
    return spec.endswith(".toml") or "/" in spec or "\\" in spec


def locate(spec: str, kind: str, builtin_dir: Path, module: Module | None = None,
           deliberately: str = "") -> tuple[Path, str]:
    """The file a `spec` names and the `source` to record for it (its absolute path, or
    `builtin:NAME`).

    A file named on the command line (`module` None) may be anywhere, relative to the current
    folder. One named by the module attribute `mp.KIND` of `module` is relative to the IR
    file's folder and must stay inside it (mplower.io.atomic.module_relative; `deliberately`
    says how to name such a file on the command line instead).
    """
    if names_a_file(spec):
        if module is None:
            path = Path(spec)
        else:
            path = module_relative(module, f"mp.{kind}", spec, deliberately)
        try:
            is_file = path.is_file()
            resolved = path.resolve()
        except (OSError, RuntimeError) as e:  # a name too long, a loop of symbolic links
            why = (getattr(e, "strerror", None) or "a loop of symbolic links").lower()
            raise DiagnosticError.at(Location(_short(spec), 0, 0),
                                     f"cannot open {kind} file: {why}") from None
        if not is_file:
            raise DiagnosticError.at(Location(str(path), 0, 0), f"no such {kind} file")
        return path, str(resolved)
    names = builtin_names(builtin_dir)
    if spec not in names:
        raise DiagnosticError.at(
            Location(f"<{kind}>", 0, 0),
            f"unknown built-in {kind} '{spec}'{did_you_mean(spec, names)} "
            f"(built-ins: {', '.join(names)}; or give a path to a .toml file)")
    return builtin_dir / f"{spec}.toml", f"builtin:{spec}"


def _short(text: str) -> str:
    """`text` cut to 200 characters for a message (a name may be thousands long)."""
    return text if len(text) <= 200 else text[:197] + "..."


def builtin_names(builtin_dir: Path) -> list[str]:
    return sorted(p.stem for p in builtin_dir.glob("*.toml"))
