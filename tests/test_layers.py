"""The folder layout is the architecture: no module imports a layer above its own.

Layers, lowest first (docs/architecture.md, "Layers"): numerics, ir, dialect, io, lowering,
passes (with pass_manager), backend, report, onnx, hf, tune, train, cli (with docgen and
__main__). Every module of mplower/ and of passes/ (shipped as `mplower.passes`) is read with `ast`, and every import
in it counts, at the top or inside a function, absolute or relative, `import mplower.x` or
`from mplower import x`. This test is the import contract that CI runs (import-linter cannot
follow `mplower.passes` to the top-level passes/ folder of an editable install).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS = ("numerics", "ir", "dialect", "io", "lowering", "passes", "backend", "report", "onnx",
          "hf", "tune", "train", "cli")
# Modules that are not in a folder of their own name: their layer.
MODULE_LAYER = {"mplower.pass_manager": "passes", "mplower.docgen": "cli",
                "mplower.__main__": "cli"}

# Imports of a higher layer that other branches of issue 11 remove: each entry must still be a
# violation (so an entry is deleted when its fix merges, and none hides a new one).
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for mplower/ and passes/ (as mplower.passes)."""
    out = {}
    for base, package in ((ROOT / "mplower", "mplower"), (ROOT / "passes", "mplower.passes")):
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def layer_of(module: str) -> str | None:
    """The layer of a dotted mplower module; None for `mplower` itself (the package, not a
    layer) and anything outside mplower."""
    if module in MODULE_LAYER:
        return MODULE_LAYER[module]
    parts = module.split(".")
    if parts[0] != "mplower" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def imports_of(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported mplower module, line) for every import in the file, wherever it is."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, node.lineno))
            if layer_of(target) is None:  # `from mplower import ir`: the names are modules
                out += [(f"{target}.{a.name}", node.lineno) for a in node.names]
    return [(m, line) for m, line in out if m.split(".")[0] == "mplower"]


def violations() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> ['file:line', ...] for every import of a higher layer."""
    found: dict[tuple[str, str], list[str]] = {}
    for module, path in module_files().items():
        own = layer_of(module)
        if own is None:
            continue
        for target, line in imports_of(module, path):
            theirs = layer_of(target)
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(own):
                where = f"{path.relative_to(ROOT)}:{line}"
                found.setdefault((module, target), []).append(where)
    return found


def test_every_module_belongs_to_a_layer():
    unplaced = [m for m in module_files() if layer_of(m) is None and m != "mplower"]
    assert unplaced == []


def test_no_module_imports_a_higher_layer():
    found = violations()
    new = {k: v for k, v in found.items() if k not in KNOWN_VIOLATIONS}
    assert new == {}, "imports of a higher layer:\n" + "\n".join(
        f"  {where}: {a} ({layer_of(a)}) imports {b} ({layer_of(b)})"
        for (a, b), wheres in sorted(new.items()) for where in wheres)


def test_known_violations_are_still_violations():
    """Delete an entry of KNOWN_VIOLATIONS once the branch that fixes it is merged."""
    fixed = sorted(KNOWN_VIOLATIONS - set(violations()))
    assert fixed == []


def test_the_checker_sees_every_kind_of_import(tmp_path):
    """Relative, function-local and `from mplower import x` imports all count."""
    src = tmp_path / "m.py"
    src.write_text("from mplower import cli\n"
                   "def f():\n    from ..report import run\n    import mplower.backend.sparse\n"
                   "from . import gemm\n")
    got = sorted(imports_of("mplower.numerics.m", src))
    assert got == [("mplower", 1), ("mplower.backend.sparse", 4), ("mplower.cli", 1),
                   ("mplower.numerics", 5), ("mplower.report", 3)]
    assert [layer_of(m) for m, _ in got] == [None, "backend", "cli", "numerics", "report"]
