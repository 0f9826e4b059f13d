"""Every shell block of README.md and docs/*.md runs as written.

A fenced block tagged `sh`, `bash` or `shell` runs as a bash script (`set -e`, pipefail); a
`console` block, or an untagged one whose lines start with `$ `, runs its `$ ` commands (with
their `\\` continuation lines) and ignores the output printed under them. The blocks of one
document run in order in one scratch folder that holds `ir_examples` and `benchmarks` (links to
the checkout), so a walk-through can build on its earlier steps, `cd` included. `mplower`,
`python` and `python3` on the PATH are this checkout's.

An HTML comment on the line before a block changes that:
`<!-- docs-run: skip REASON -->` (a synopsis with placeholders, or a block needing the network),
`<!-- docs-run: slow REASON -->` (runs only with MPLOWER_DOCS_SLOW=1: minutes of work), and
`<!-- docs-run: python -->` (a python block that is a step of the walk-through runs too).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_TAGS = {"sh", "bash", "shell"}
MARK = re.compile(r"<!--\s*docs-run:\s*(skip|slow|python)\b\s*(.*?)\s*-->")
SLOW = os.environ.get("MPLOWER_DOCS_SLOW") == "1"


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    kind: str  # "sh", "console", "python" or "other"
    text: str
    mark: str  # "", "skip", "slow" or "python"
    reason: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    def script(self) -> str:
        if self.kind == "sh":
            return self.text
        if self.kind == "python":
            return f"python - <<'MPLOWER_DOCS_EOF'\n{self.text}\nMPLOWER_DOCS_EOF\n"
        commands, more = [], False
        for line in self.text.splitlines():
            if line.startswith("$ ") or more:
                commands.append(line[2:] if line.startswith("$ ") and not more else line)
                more = line.rstrip().endswith("\\")
        return "\n".join(commands) + "\n"


def blocks(doc: Path) -> list[Block]:
    lines = doc.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        body = "\n".join(lines[i + 1:end])
        tag = fence.group(1)
        mark = MARK.search(lines[i - 1]) if i else None
        if tag in SHELL_TAGS:
            kind = "sh"
        elif tag == "console" or (tag == "" and any(x.startswith("$ ")
                                                    for x in body.splitlines())):
            kind = "console"
        elif tag == "python" and mark and mark.group(1) == "python":
            kind = "python"
        else:
            kind = "other"
        out.append(Block(doc, i + 1, kind, body, mark.group(1) if mark else "",
                         mark.group(2) if mark else ""))
        i = end + 1
    return out


def _runnable(doc: Path) -> list[Block]:
    return [b for b in blocks(doc) if b.kind != "other"]


def _bin(tmp: Path) -> Path:
    """`mplower`, `python` and `python3` of this interpreter and checkout."""
    bin_dir = tmp / ".bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):
        (bin_dir / name).symlink_to(sys.executable)
    mp = bin_dir / "mplower"
    mp.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m mplower "$@"\n')
    mp.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("doc", [d for d in DOCS if _runnable(d)],
                         ids=lambda d: str(d.relative_to(ROOT)))
def test_doc_shell_blocks_run_as_written(doc: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    for name in ("ir_examples", "benchmarks"):
        (work / name).symlink_to(ROOT / name)
    env = dict(os.environ, PATH=f"{_bin(tmp_path)}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=str(ROOT), MPLOWER_DOCS_RUN="1")
    cwd, ran = work, 0
    for block in _runnable(doc):
        if block.mark == "skip" or (block.mark == "slow" and not SLOW):
            continue
        state = tmp_path / ".cwd"
        script = f"set -eo pipefail\n{block.script()}\npwd > '{state}'\n"
        res = subprocess.run(["bash", "-c", script], check=False, cwd=cwd, env=env,
                             capture_output=True,
                             text=True, timeout=900)
        assert res.returncode == 0, (
            f"{block.where}: the block exits {res.returncode}\n--- block ---\n{block.text}\n"
            f"--- stderr ---\n{res.stderr[-3000:]}\n--- stdout ---\n{res.stdout[-1500:]}")
        cwd = Path(state.read_text().strip())
        ran += 1
    assert ran or all(b.mark in ("skip", "slow") for b in _runnable(doc))


def test_every_shell_block_runs_or_says_why_not() -> None:
    """A shell block is run, or marked with a reason: new docs cannot drift unrun."""
    unmarked = [b.where for d in DOCS for b in _runnable(d) if b.mark in ("skip", "slow")
                and not b.reason]
    assert unmarked == [], f"docs-run skip/slow marks without a reason: {unmarked}"
    run = [b for d in DOCS for b in _runnable(d) if b.mark not in ("skip", "slow")]
    assert len(run) >= 20, [b.where for b in run]


def test_the_block_parser_reads_console_commands_and_continuations(tmp_path: Path) -> None:
    doc = tmp_path / "d.md"
    doc.write_text("x\n```\n$ echo a \\\n    b\nprinted\n$ echo c\n```\n"
                   "<!-- docs-run: skip needs the network -->\n```sh\npip download x\n```\n"
                   "```python\nprint(1)\n```\n")
    first, second, third = blocks(doc)
    assert (first.kind, first.script()) == ("console", "echo a \\\n    b\necho c\n")
    assert (second.kind, second.mark, second.reason) == ("sh", "skip", "needs the network")
    assert third.kind == "other"
