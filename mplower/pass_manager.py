"""Passes, their registry, the pipeline syntax and the instrumented pass manager.

A pass is a dataclass whose fields are its options and whose docstring is its documentation
(as in xDSL); `@register_pass` adds it to the registry that the CLI, `mplower passes` and
docs/passes.md are generated from. Built-in passes live in the `mplower.passes` package; other
packages add theirs through the entry-point group `mplower.passes`. Pipelines are written as in
mlir-opt: `name{opt=val other=val},name2`. The manager verifies after each pass, times each
pass, prints IR before/after passes on request and collects per-pass statistics. At the end
of a run it points the module's file attributes (`mp.weights`, `mp.policy`, `mp.target`) at
the files the run used, from the folder the module is written to (`place_module_files`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
import sys
import time
import typing
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TextIO

from mplower.ir.diagnostics import DiagnosticError, did_you_mean

if TYPE_CHECKING:  # the CLI imports this module before it knows whether it will parse IR
    from mplower.ir.graph import Module, Value
    from mplower.lowering.sharding import Executor

# What a pass that runs the model (calibrate) gets from its caller, since passes sit below the
# backend: runner(module, func, weights) compiles the function's fp32 reference and returns a
# callable that maps one batch of argument arrays to the reference value of every value of the
# function (None where there is none, e.g. downstream of an integer input); called as
# f(batch, observe) it instead hands each value to observe(value, array) as it is computed and
# keeps none (memory for the live values only). The backend
# implements it (mplower.backend.executor.reference_runner); the CLI and the ONNX backend pass
# it in `PassContext.runner`.
ReferenceRunner = Callable[["Module", str | None, str | None], Callable[..., dict["Value", Any]]]


class PipelineError(Exception):
    """A pipeline string, pass name or option value that cannot be used (a usage error)."""


@dataclass
class PassContext:
    """What a pass may use besides the module: statistics and the options of the run."""

    stats: Counter = field(default_factory=Counter)
    output_path: str | None = None  # where `-o` writes; passes write new weights beside it
    weights_path: str | None = None  # `--weights`: the user's explicit weights file
    runner: ReferenceRunner | None = None  # for the passes that run the model (calibrate)
    executor: Executor | None = None  # where their sample shards run (None: here; --workers)

    def stat(self, name: str, n: int = 1) -> None:
        self.stats[name] += n


class Pass:
    """Base of every pass. Subclasses are dataclasses; their fields are the pass's options."""

    name: ClassVar[str] = ""
    # Statistic names and what they count, for --statistics and docs/passes.md.
    statistics: ClassVar[dict[str, str]] = {}
    # The `mplower opt` arguments that docs/passes.md shows for this pass, for a pass that does
    # nothing useful with its defaults alone; tests/test_docs.py runs them from the repository
    # root. Empty: the page shows the pass on ir_examples/mlp.ir with its defaults.
    examples: ClassVar[tuple[str, ...]] = ()

    def run(self, module: Module, ctx: PassContext) -> None:
        raise NotImplementedError


def option(default: Any, help: str) -> Any:
    """A pass option: its default and the one-line help shown by `mplower passes`."""
    if isinstance(default, list | dict | set):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


PASSES: dict[str, type[Pass]] = {}


class PassNameConflict(TypeError):
    """A second, different class registered under a pass name that is taken."""

    def __init__(self, name: str, existing: type[Pass]) -> None:
        super().__init__(f"pass '{name}' is already registered by "
                         f"{existing.__module__}.{existing.__qualname__}")
        self.name, self.existing = name, existing


class PluginError(Exception):
    """An installed plugin that cannot be used as it is (it takes a pass name already in use)."""


class PluginWarning(UserWarning):
    """A plugin entry point that was skipped; the CLI prints it as one `mplower: warning:` line."""


def is_builtin(cls: type[Pass]) -> bool:
    """Whether the pass ships with mplower (the package `mplower.passes`), not with a plugin."""
    return cls.__module__.startswith("mplower.")


def register_pass(cls: type[Pass]) -> type[Pass]:
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a name")
    if not dataclasses.is_dataclass(cls):
        cls = dataclass(cls)
    existing = PASSES.get(cls.name)
    if existing is not None and existing is not cls and (
            existing.__module__, existing.__qualname__) != (cls.__module__, cls.__qualname__):
        raise PassNameConflict(cls.name, existing)
    PASSES[cls.name] = cls
    return cls


_loaded = False  # every built-in pass imported and every plugin registered
_plugins: list | None = None  # the entry points of the group mplower.passes, once looked up


def _plugin_entry_points() -> list:
    global _plugins
    if _plugins is None:
        from importlib.metadata import entry_points

        _plugins = list(entry_points(group="mplower.passes"))
    return _plugins


@functools.cache
def _builtin_modules() -> frozenset[str]:
    """The modules of the package mplower.passes, one pass each, named after the pass."""
    import mplower.passes as builtin

    return frozenset(info.name for info in pkgutil.iter_modules(builtin.__path__))


def find_pass(name: str) -> type[Pass] | None:
    """The pass registered as `name`, or None.

    Where no plugin is installed, a built-in pass is found by importing its own module alone
    (`assign-precision` is mplower.passes.assign_precision): importing every pass module is a
    large share of a short `mplower opt`'s start-up. With plugins installed, and for a name
    that is no built-in module's (a plugin's, a misspelt one: the suggestions need every
    name), every pass is loaded as `load_passes` does, so that a plugin that takes a built-in
    name is still an error.
    """
    if not _loaded and not _plugin_entry_points():
        module = name.replace("-", "_")
        if module in _builtin_modules():
            importlib.import_module(f"mplower.passes.{module}")
            if name in PASSES:
                return PASSES[name]
    return load_passes().get(name)


def load_passes() -> dict[str, type[Pass]]:
    """Import the built-in pass modules and the entry points of other packages, once.

    A plugin whose pass takes a name already registered (a built-in's or an earlier plugin's)
    raises PluginError: running the pipeline with either pass would not be what one of the two
    authors meant, so the user must choose by renaming or uninstalling. A plugin that fails to
    import or names something other than a Pass is skipped with one PluginWarning.
    """
    global _loaded
    if _loaded:
        return PASSES
    for module in sorted(_builtin_modules()):
        importlib.import_module(f"mplower.passes.{module}")
    for ep in _plugin_entry_points():
        plugin = f"plugin '{ep.name}' ({ep.value})"
        try:
            obj = ep.load()
            if not (isinstance(obj, type) and issubclass(obj, Pass)):
                raise TypeError(f"it names a {type(obj).__name__}, not a Pass subclass")
            register_pass(obj)
        except PassNameConflict as e:  # also raised by a class that registers itself on import
            existing = e.existing
            taken = ("a built-in pass" if is_builtin(existing) else
                     f"already registered by {existing.__module__}.{existing.__qualname__}")
            raise PluginError(f"{plugin} registers pass '{e.name}', which is {taken}; "
                              f"rename the plugin's pass or uninstall its package") from None
        except Exception as e:  # noqa: BLE001 -- a broken plugin must not take the built-ins down
            warnings.warn(f"{plugin} failed to load: {type(e).__name__}: {_short(str(e))}",
                          PluginWarning, stacklevel=2)
    _loaded = True
    return PASSES


def _short(text: str) -> str:
    """The first line of a message, so that a plugin problem stays one line."""
    lines = text.strip().splitlines()
    return lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""


# ---- pipeline syntax ---------------------------------------------------------------------

def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside braces and quotes."""
    parts, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                raise PipelineError(f"unbalanced '}}' in pipeline '{text}'")
        elif ch == sep and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if depth or quote:
        raise PipelineError(f"unterminated {'quote' if quote else '{'} in pipeline '{text}'")
    parts.append("".join(cur).strip())
    return [p for p in parts if p]


def parse_pipeline(text: str) -> list[Pass]:
    """`a{x=1 y=2},b` -> configured pass instances."""
    return [parse_pass(p) for p in split_top_level(text)]


def parse_pass(text: str) -> Pass:
    text = text.strip()
    name, opts = text, ""
    if "{" in text:
        if not text.endswith("}"):
            raise PipelineError(f"malformed pass '{text}': options go in braces at the end")
        name, opts = text[:text.index("{")].strip(), text[text.index("{") + 1:-1]
    cls = find_pass(name)
    if cls is None:
        raise PipelineError(f"unknown pass '{name}'{did_you_mean(name, PASSES)}")
    return cls(**parse_options(cls, opts))


def parse_options(cls: type[Pass], text: str) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for item in _split_options(text):
        if "=" not in item:
            key, raw = item, "true"  # a bare flag means true, as in mlir-opt
        else:
            key, raw = (s.strip() for s in item.split("=", 1))
        if key not in fields:
            hint = did_you_mean(key, fields)
            known = ", ".join(fields) or "none"
            raise PipelineError(f"pass '{cls.name}' has no option '{key}'{hint} "
                                f"(options: {known})")
        out[key] = convert_option(cls.name, key, hints[key], _unquote(raw))
    return out


def _split_options(text: str) -> list[str]:
    items, cur, quote, depth = [], [], "", 0
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch.isspace() and depth == 0:
            if cur:
                items.append("".join(cur))
                cur = []
            continue
        cur.append(ch)
    if cur:
        items.append("".join(cur))
    return items


def _unquote(raw: str) -> str:
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        return raw[1:-1]
    return raw


def convert_option(pass_name: str, key: str, hint: Any, raw: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        non_none = [a for a in args if a is not type(None)]
        if raw.lower() in ("none", "") and len(non_none) < len(args):
            return None
        hint = non_none[0]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    try:
        if hint is bool:
            low = raw.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if hint is int:
            return int(raw, 0)
        if hint is float:
            return float(raw)
        if origin in (list, tuple):
            elem = args[0] if args else str
            items = [s.strip() for s in raw.strip("[]").split(",") if s.strip()]
            return type(origin() if origin is list else ())(
                convert_option(pass_name, key, elem, s) for s in items)
        return raw
    except ValueError:
        tname = getattr(hint, "__name__", str(hint))
        raise PipelineError(f"option '{key}' of pass '{pass_name}' expects {tname}, "
                            f"got '{raw}'") from None


def describe_pass(p: Pass) -> str:
    """`name{opt=val ...}` with the options that differ from their defaults."""
    parts = []
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        if v != default:
            parts.append(f"{f.name}={_opt_str(v)}")
    return p.name + ("{" + " ".join(parts) + "}" if parts else "")


def _opt_str(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list | tuple):
        return ",".join(map(str, v))
    s = str(v)
    if any(c.isspace() or c in "{},\"'" for c in s):  # quoted, so that the text parses back
        q = "'" if '"' in s else '"'
        return f"{q}{s}{q}"
    return s


# ---- running -----------------------------------------------------------------------------

@dataclass
class Instrumentation:
    print_before: set[str] = field(default_factory=set)
    print_after: set[str] = field(default_factory=set)
    print_after_all: bool = False
    print_before_all: bool = False
    generic: bool = False
    verify_each: bool = True
    stream: TextIO | None = None  # IR dumps go to stderr, as mlir-opt's do


@dataclass
class PassManager:
    passes: list[Pass]
    instrumentation: Instrumentation = field(default_factory=Instrumentation)
    timings: list[tuple[str, float]] = field(default_factory=list)
    statistics: dict[str, Counter] = field(default_factory=dict)

    def run(self, module: Module, ctx: PassContext | None = None,
            verify: Callable[[Module], None] | None = None) -> None:
        from mplower.ir.printer import print_module
        from mplower.ir.verifier import verify as default_verify

        verify = verify or default_verify
        inst = self.instrumentation
        out = inst.stream or sys.stderr
        ctx = ctx or PassContext()
        named = {a: module.attrs.get(a) for a in file_attrs()}  # as the (untrusted) input has them
        for p in self.passes:
            if inst.print_before_all or p.name in inst.print_before:
                out.write(f"// -----// IR Dump Before {describe_pass(p)} //----- //\n")
                out.write(print_module(module, inst.generic))
            ctx.stats = Counter()
            t0 = time.perf_counter()
            p.run(module, ctx)
            self.timings.append((p.name, time.perf_counter() - t0))
            stats = self.statistics.setdefault(p.name, Counter())
            stats.update(ctx.stats)
            for key in p.statistics:
                stats.setdefault(key, 0)
            if inst.verify_each:
                t0 = time.perf_counter()
                _verify_after(p, module, verify)
                self.timings.append(("(verify)", time.perf_counter() - t0))
            if inst.print_after_all or p.name in inst.print_after:
                out.write(f"// -----// IR Dump After {describe_pass(p)} //----- //\n")
                out.write(print_module(module, inst.generic))
        place_module_files(module, ctx, named)


def _verify_after(p: Pass, module: Module, verify: Callable[[Module], None]) -> None:
    """Verify the module `p` produced. The input was verified when it was parsed, so a failure
    here is a bug of the pass, not of the input: the diagnostics say so and name the pass
    (they keep their locations, the ops the pass left invalid)."""
    try:
        verify(module)
    except DiagnosticError as e:
        err = DiagnosticError(*(dataclasses.replace(d, message=(
            f"internal error in pass '{p.name}' (a bug in mplower, not in the input; please "
            f"report it): the module it produced fails verification: {d.message}"))
            for d in e.diagnostics))
        err.source = e.source
        raise err from None


def format_timing(rows: list[tuple[str, float]]) -> str:
    """mlir-opt's `-mlir-timing` report: wall time per row, with the share of the total."""
    merged: dict[str, float] = {}
    for name, t in rows:
        merged[name] = merged.get(name, 0.0) + t
    total = sum(merged.values()) or 1e-12
    bar = "===" + "-" * 73 + "==="
    lines = [bar, "... Execution time report ...".center(79).rstrip(), bar,
             f"  Total Execution Time: {total:.4f} seconds", "",
             "  ----Wall Time----  ----Name----"]
    for name, t in merged.items():
        lines.append(f"  {t:8.4f} ({100 * t / total:5.1f}%)  {name}")
    lines.append(f"  {total:8.4f} (100.0%)  Total")
    return "\n".join(lines) + "\n"


def format_statistics(stats: dict[str, Counter]) -> str:
    bar = "===" + "-" * 73 + "==="
    lines = [bar, "... Pass statistics report ...".center(79).rstrip(), bar]
    for name, counter in stats.items():
        cls = PASSES.get(name)
        lines.append(f"'{name}'")
        for key in sorted(counter):
            help_ = cls.statistics.get(key, "") if cls else ""
            lines.append(f"  (S) {counter[key]:>6} {key}" + (f" - {help_}" if help_ else ""))
    return "\n".join(lines) + "\n"


def pass_options(cls: type[Pass]) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, help) of each option of a pass."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        hint = hints[f.name]
        tname = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
        rows.append((f.name, tname, default, f.metadata.get("help", "")))
    return rows


def file_attrs() -> dict[str, str]:
    """Module attributes that name a file relative to the module's IR file (mplower.io.atomic),
    and the suffix of the copy written beside `-o` when the file is outside the output's folder.
    (A function: the CLI imports this module before it knows whether it will load the dialect.)
    """
    from mplower.dialect.plan import POLICY, TARGET, WEIGHTS

    return {WEIGHTS: ".npz", POLICY: ".policy.toml", TARGET: ".target.toml"}


def place_module_files(module: Module, ctx: PassContext, named: dict[str, Any]) -> None:
    """Point the module's file attributes at the files this run used, from the folder the module
    is written to (`ctx.output_path`'s; printed, its input's), so that it runs from there.

    A file inside that folder is recorded relative to it; one outside is copied beside the
    output as `<stem>.npz`, `<stem>.policy.toml`, `<stem>.target.toml` (a sheet keeps its
    name), because the lowered module may not name a file outside its folder. The files used
    are the ones the user named (`--weights`, a pass's `policy=` / `target=`), the weights a
    pass wrote, and the ones the input names inside its own folder. A value the input carried
    that leaves its folder or names no file is left as written and never read: an IR file
    must not make mplower copy a file from outside the model's folder.
    """
    from mplower.dialect.plan import WEIGHTS
    from mplower.io.atomic import module_folder, module_relative, path_from
    from mplower.ir.diagnostics import DiagnosticError
    from mplower.lowering.tomlsheet import names_a_file

    out = Path(ctx.output_path).resolve() if ctx.output_path is not None else None
    folder = out.parent if out is not None else module_folder(module)
    for attr, suffix in file_attrs().items():
        value = module.attrs.get(attr)
        if not isinstance(value, str) or (attr != WEIGHTS and not names_a_file(value)):
            continue  # absent, or a built-in sheet's name
        changed = value != named[attr]  # a pass recorded it from a name on the command line
        if out is None and not changed:
            continue  # printed, the module stays in its input's folder: nothing moves
        if attr == WEIGHTS and ctx.weights_path is not None:
            path = Path(ctx.weights_path).resolve()
        elif changed:
            path = module_folder(module) / value
        else:
            try:
                path = module_relative(module, attr, value, "")
            except DiagnosticError:
                continue
        if not path.is_file():
            continue
        if out is not None and not path.resolve().is_relative_to(folder):
            copy = out.with_name(out.stem + suffix)
            _copy_file(path, copy, attr[len("mp."):])
            path = copy
        module.attrs[attr] = path_from(folder, path)


def _copy_file(source: Path, dest: Path, kind: str) -> None:
    """Copy `source` to `dest` atomically. A policy or target sheet without a `name` gets its
    file stem as its name, so that the copy shows the same name in reports."""
    import contextlib
    import shutil

    from mplower.io.atomic import atomic_output
    from mplower.ir.diagnostics import DiagnosticError, Location
    from mplower.lowering.tomlsheet import Sheet

    try:
        if kind == "weights":
            with open(source, "rb") as src, atomic_output(dest, "wb") as fh:
                shutil.copyfileobj(src, fh)
            return
        data = source.read_bytes()
        with contextlib.suppress(DiagnosticError, UnicodeDecodeError):  # then copied as it is
            data = Sheet.parse(data.decode("utf-8"), str(source)).named(kind, source.stem
                                                                         ).encode("utf-8")
        with atomic_output(dest, "wb") as fh:
            fh.write(data)
    except OSError as e:
        raise DiagnosticError.at(Location(str(dest), 0, 0),
                                 f"cannot copy {source} here: {e.strerror or e}") from None
