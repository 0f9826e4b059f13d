"""The generated blocks of docs/benchmarks.md: a script's figures between its two markers.

Each benchmark script that writes its figures into the page (`--write docs/benchmarks.md`)
replaces only the lines between its own `<!-- NAME begin -->` and `<!-- NAME end -->` comments,
so that rerunning it updates the figures and leaves the rest of the page as it is.
"""

from __future__ import annotations

from pathlib import Path


def replace_block(path: Path, lines: list[str], begin: str, end: str) -> None:
    """Put `lines` between the markers `begin` and `end` of the markdown file (appended, with
    its markers, where the file has none yet); the other benchmark scripts write theirs too."""
    text = path.read_text()
    block = "\n".join([begin, *lines, end])
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
