"""The one table renderer of the reports: aligned text columns, or a markdown table.

The run report, the precision policy sheet and the sparse reality check all print their rows
through `table`, so the three read alike and a change of layout is made once.
"""

from __future__ import annotations

from collections.abc import Sequence


def table(header: Sequence[str], rows: Sequence[Sequence[str]], fmt: str,
          rule: bool = False) -> list[str]:
    """The lines of a table of string cells. `fmt` "markdown" gives a GitHub table (a `|` in a
    cell is escaped); anything else aligned columns two spaces apart, with no trailing blanks
    and, with `rule`, a line of dashes under the header."""
    if fmt == "markdown":
        return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                *("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows)]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    if rule:
        lines.append("  ".join("-" * w for w in widths))
    return lines + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
