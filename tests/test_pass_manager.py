"""The pass manager: pipeline syntax, typed options, describe_pass, entry points, instrumentation."""

from __future__ import annotations

import dataclasses
import io
from collections import Counter
from typing import ClassVar

import pytest
from conftest import func_ir

import mplower.pass_manager as pm
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import Module
from mplower.ir.parser import parse
from mplower.ir.printer import print_module
from mplower.pass_manager import (
    Instrumentation,
    Pass,
    PassContext,
    PassManager,
    PipelineError,
    describe_pass,
    format_statistics,
    format_timing,
    load_passes,
    option,
    parse_pass,
    parse_pipeline,
    pass_options,
    register_pass,
    split_top_level,
)

T = "tensor<4xf32>"
SMALL = func_ir(f"%a = mp.exp %x : ({T}) -> {T}\n%b = mp.exp %x : ({T}) -> {T}\n"
                f"%dead = mp.relu %x : ({T}) -> {T}\n"
                f"%s = mp.add %a, %b : ({T}, {T}) -> {T}\nreturn %s : {T}",
                args=f"%x: {T}", result=T)


@dataclasses.dataclass
class Options(Pass):
    """A pass with one option of every kind (never registered globally)."""

    name: ClassVar[str] = "test-options"
    count: int = option(1, "an int")
    ratio: float = option(0.5, "a float")
    flag: bool = option(False, "a bool")
    label: str = option("x", "a string")
    # option() gives list defaults a default_factory, as the passes' own options do.
    sizes: list[int] = option([1, 2], "a list of ints")  # noqa: RUF009
    names: list[str] = option([], "a list of strings")  # noqa: RUF009
    limit: int | None = option(None, "an optional int")

    def run(self, module: Module, ctx: PassContext) -> None:
        ctx.stat("runs")


@pytest.fixture
def options_pass(monkeypatch):
    load_passes()
    monkeypatch.setitem(pm.PASSES, Options.name, Options)
    return Options


# ---- pipeline syntax -----------------------------------------------------------------------

@pytest.mark.parametrize("text, parts", [
    ("a{x=1 y=true},b", ["a{x=1 y=true}", "b"]),
    ("a , b ,c", ["a", "b", "c"]),
    ('a{s="x,}{y"},b', ['a{s="x,}{y"}', "b"]),
    ("a{s='p,q'}", ["a{s='p,q'}"]),
    ("a{l=[1,2]},b{}", ["a{l=[1,2]}", "b{}"]),
    (",a,,b,", ["a", "b"]),
    ("", []),
])
def test_split_top_level_splits_outside_braces_and_quotes(text, parts):
    assert split_top_level(text) == parts


@pytest.mark.parametrize("text, message", [
    ("a{x=1", "unterminated { in pipeline 'a{x=1'"),
    ('a{s="x}', "unterminated quote in pipeline 'a{s=\"x}'"),
    ("a}", "unbalanced '}' in pipeline 'a}'"),
])
def test_split_top_level_rejects_unbalanced_text(text, message):
    with pytest.raises(PipelineError) as e:
        split_top_level(text)
    assert str(e.value) == message


def test_pipeline_builds_configured_pass_instances(options_pass):
    passes = parse_pipeline("test-options{count=3 flag=true label=\"a b\"},cse, dce")
    assert [p.name for p in passes] == ["test-options", "cse", "dce"]
    assert passes[0] == Options(count=3, flag=True, label="a b")


@pytest.mark.parametrize("opts, field, value", [
    ("count=7", "count", 7),
    ("count=-3", "count", -3),
    ("count=0x10", "count", 16),
    ("ratio=1e-3", "ratio", 0.001),
    ("ratio=2", "ratio", 2.0),
    ("flag", "flag", True),
    ("flag=true", "flag", True),
    ("flag=1", "flag", True),
    ("flag=on", "flag", True),
    ("flag=No", "flag", False),
    ("flag=off", "flag", False),
    ("label=plain", "label", "plain"),
    ('label="two words"', "label", "two words"),
    ("label='it, {braced}'", "label", "it, {braced}"),
    ("label=a=b", "label", "a=b"),
    ("sizes=[3, 4, 5]", "sizes", [3, 4, 5]),
    ("sizes=6,7", "sizes", [6, 7]),
    ("sizes=[]", "sizes", []),
    ("names=[p,q]", "names", ["p", "q"]),
    ("limit=5", "limit", 5),
    ("limit=none", "limit", None),
])
def test_option_values_are_converted_to_the_field_type(opts, field, value, options_pass):
    p = parse_pass(f"test-options{{{opts}}}")
    assert getattr(p, field) == value
    assert type(getattr(p, field)) is type(value)


@pytest.mark.parametrize("opts, message", [
    ("count=many", "option 'count' of pass 'test-options' expects int, got 'many'"),
    ("ratio=half", "option 'ratio' of pass 'test-options' expects float, got 'half'"),
    ("flag=maybe", "option 'flag' of pass 'test-options' expects bool, got 'maybe'"),
    ("sizes=[1,x]", "option 'sizes' of pass 'test-options' expects int, got 'x'"),
    ("limit=lots", "option 'limit' of pass 'test-options' expects int, got 'lots'"),
    ("cuont=1", ("pass 'test-options' has no option 'cuont'; did you mean 'count'? (options: "
                 "count, ratio, flag, label, sizes, names, limit)")),
    ("zzz=1", ("pass 'test-options' has no option 'zzz' (options: count, ratio, flag, label, "
               "sizes, names, limit)")),
])
def test_bad_option_is_a_pipeline_error_naming_the_fix(opts, message, options_pass):
    with pytest.raises(PipelineError) as e:
        parse_pass(f"test-options{{{opts}}}")
    assert str(e.value) == message


@pytest.mark.parametrize("text, message", [
    ("canonicalise", "unknown pass 'canonicalise'; did you mean 'canonicalize'?"),
    ("xyzzy", "unknown pass 'xyzzy'"),
    ("cse{}x", "malformed pass 'cse{}x': options go in braces at the end"),
    ("dce{x=1}", "pass 'dce' has no option 'x' (options: none)"),
])
def test_bad_pass_is_a_pipeline_error(text, message):
    with pytest.raises(PipelineError) as e:
        parse_pass(text)
    assert str(e.value) == message


def test_describe_pass_shows_only_non_default_options(options_pass):
    assert describe_pass(Options()) == "test-options"
    assert describe_pass(Options(count=2, flag=True, sizes=[4])) == (
        "test-options{count=2 flag=true sizes=4}")


@pytest.mark.parametrize("p", [
    Options(count=2), Options(flag=True, ratio=0.25), Options(label="two words"),
    Options(label="a,b{c}"), Options(label='say "hi"'), Options(sizes=[], names=["u", "v"]),
    Options(limit=3), Options(count=-1, label="q", sizes=[9, 8, 7]),
])
def test_describe_pass_parses_back_to_an_equal_pass(p, options_pass):
    assert parse_pass(describe_pass(p)) == p


def test_pass_options_lists_name_type_default_and_help(options_pass):
    rows = pass_options(Options)
    assert rows[0] == ("count", "int", 1, "an int")
    assert rows[4] == ("sizes", "list[int]", [1, 2], "a list of ints")
    assert [r[0] for r in rows] == ["count", "ratio", "flag", "label", "sizes", "names", "limit"]


def test_list_option_default_is_not_shared_between_instances():
    a, b = Options(), Options()
    a.sizes.append(3)
    assert b.sizes == [1, 2]


def test_register_pass_needs_a_name():
    class Nameless(Pass):
        pass

    with pytest.raises(TypeError):
        register_pass(Nameless)


# ---- third-party passes --------------------------------------------------------------------

@dataclasses.dataclass
class ThirdParty(Pass):
    """Tag every function with an attribute (a pass from another package)."""

    name: ClassVar[str] = "vendor-tag"
    statistics: ClassVar[dict[str, str]] = {"tagged": "functions tagged"}
    value: str = option("v", "the tag")

    def run(self, module: Module, ctx: PassContext) -> None:
        for f in module.functions.values():
            f.attrs["vendor.tag"] = self.value
            ctx.stat("tagged")


@dataclasses.dataclass
class FakeCse(Pass):
    """A third-party pass that tries to take a built-in name."""

    name: ClassVar[str] = "cse"

    def run(self, module: Module, ctx: PassContext) -> None:
        raise AssertionError("must not replace the built-in cse")


class _EntryPoint:
    """What importlib.metadata.entry_points yields: a name, a `module:attr` value, load()."""

    def __init__(self, name, value, obj):
        self.name, self.value, self.obj = name, value, obj

    def load(self):
        if isinstance(self.obj, BaseException):
            raise self.obj
        return self.obj


def _install_entry_points(monkeypatch, *eps):
    """Make load_passes see `eps` as the installed plugins, on a fresh copy of the registry."""
    import importlib.metadata

    load_passes()
    groups = []

    def entry_points(*, group):
        groups.append(group)
        return list(eps)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(pm, "PASSES", dict(pm.PASSES))
    monkeypatch.setattr(pm, "_loaded", False)
    monkeypatch.setattr(pm, "_plugins", None)
    return groups


@pytest.fixture
def entry_point_passes(monkeypatch):
    return _install_entry_points(
        monkeypatch, _EntryPoint("vendor-tag", "vendor.passes:ThirdParty", ThirdParty))


def test_entry_point_passes_are_registered_once(entry_point_passes):
    registry = load_passes()
    assert entry_point_passes == ["mplower.passes"]
    assert registry["vendor-tag"] is ThirdParty
    assert load_passes() is registry and entry_point_passes == ["mplower.passes"]  # once


def test_plugin_that_takes_a_builtin_pass_name_is_an_error_naming_both(monkeypatch, cli,
                                                                       tmp_path):
    # Pinned the other way before: the plugin's pass was dropped without a word.
    _install_entry_points(monkeypatch, _EntryPoint("fake-cse", "fake_pkg:FakeCse", FakeCse))
    message = ("plugin 'fake-cse' (fake_pkg:FakeCse) registers pass 'cse', which is a built-in "
               "pass; rename the plugin's pass or uninstall its package")
    with pytest.raises(pm.PluginError) as e:
        load_passes()
    assert str(e.value) == message
    assert pm.PASSES["cse"].__module__ == "mplower.passes.cse"  # the built-in stays
    src = tmp_path / "in.ir"
    src.write_text(SMALL)
    r = cli("opt", src, "--pass=cse")
    assert (r.rc, r.out, r.err) == (1, "", f"mplower: error: {message}\n")
    assert cli("passes").err == f"mplower: error: {message}\n"


def test_plugin_that_registers_itself_under_a_builtin_name_is_the_same_error(monkeypatch):
    def import_module_that_registers_cse():
        register_pass(FakeCse)

    class _Registering(_EntryPoint):
        def load(self):
            import_module_that_registers_cse()
            return FakeCse

    _install_entry_points(monkeypatch, _Registering("fake", "fake_pkg", None))
    with pytest.raises(pm.PluginError, match=r"^plugin 'fake' \(fake_pkg\) registers pass "
                                             r"'cse', which is a built-in pass;"):
        load_passes()


def test_two_plugins_with_one_pass_name_are_an_error_naming_the_first(monkeypatch):
    @dataclasses.dataclass
    class OtherTag(Pass):
        name: ClassVar[str] = "vendor-tag"

    _install_entry_points(monkeypatch, _EntryPoint("a", "vendor.passes:ThirdParty", ThirdParty),
                          _EntryPoint("b", "other.passes:OtherTag", OtherTag))
    with pytest.raises(pm.PluginError) as e:
        load_passes()
    assert str(e.value) == (
        "plugin 'b' (other.passes:OtherTag) registers pass 'vendor-tag', which is already "
        f"registered by {__name__}.ThirdParty; rename the plugin's pass or uninstall its package")


def test_broken_plugin_is_one_warning_line_and_the_rest_still_load(monkeypatch, cli, tmp_path):
    # Before: a raw `UserWarning` with the file and line of warnings.warn, on every command.
    _install_entry_points(
        monkeypatch,
        _EntryPoint("broken", "broken_pkg.passes:Pass",
                    ImportError("No module named 'broken_pkg'\nsecond line")),
        _EntryPoint("not-a-pass", "builtins:len", len),
        _EntryPoint("vendor-tag", "vendor.passes:ThirdParty", ThirdParty))
    src = tmp_path / "in.ir"
    src.write_text(SMALL)
    r = cli("opt", src, "--pass=vendor-tag", "--pass=cse")
    assert r.rc == 0
    assert r.err == ("mplower: warning: plugin 'broken' (broken_pkg.passes:Pass) failed to load: "
                     "ImportError: No module named 'broken_pkg' ...\n"
                     "mplower: warning: plugin 'not-a-pass' (builtins:len) failed to load: "
                     "TypeError: it names a builtin_function_or_method, not a Pass subclass\n")
    assert 'vendor.tag = "v"' in r.out
    again = cli("opt", src, "--pass=cse")  # loaded once per process: no second warning
    assert again.rc == 0 and again.err == ""


def test_broken_plugin_is_a_plugin_warning_for_library_users(monkeypatch):
    _install_entry_points(monkeypatch, _EntryPoint("broken", "x:y", RuntimeError("boom")))
    with pytest.warns(pm.PluginWarning, match=r"^plugin 'broken' \(x:y\) failed to load: "
                                              r"RuntimeError: boom$"):
        registry = load_passes()
    assert "cse" in registry


def test_entry_point_pass_runs_from_the_cli(entry_point_passes, cli, tmp_path):
    src = tmp_path / "in.ir"
    src.write_text(SMALL)
    r = cli("opt", src, "--pass=vendor-tag{value=hello}", "--statistics")
    assert r.rc == 0, r.err
    assert 'attributes {vendor.tag = "hello"}' in r.out
    assert "(S)      1 tagged - functions tagged" in r.err
    listing = cli("passes").out
    assert "vendor-tag  -  Tag every function with an attribute" in listing


# ---- running -------------------------------------------------------------------------------

@dataclasses.dataclass
class Failing(Pass):
    """Fail on the first exp, as a pass that meets something it cannot handle."""

    name: ClassVar[str] = "test-fail-on-exp"

    def run(self, module: Module, ctx: PassContext) -> None:
        for f in module.functions.values():
            for n in f.walk("mp.exp"):
                f.erase(next(iter(f.walk("mp.relu"))))  # a change that must not reach disk
                raise DiagnosticError.at(f.data(n)["loc"], "cannot handle mp.exp here")


def test_failing_pass_leaves_the_output_file_untouched(monkeypatch, cli, tmp_path):
    load_passes()
    monkeypatch.setitem(pm.PASSES, Failing.name, Failing)
    src, out = tmp_path / "in.ir", tmp_path / "out.ir"
    src.write_text(SMALL)
    out.write_bytes(b"KEEP ME")
    r = cli("opt", src, "-p", "cse", "-p", Failing.name, "-o", out)
    assert r.rc == 1
    assert r.err == (f"{src}:2:3: error: cannot handle mp.exp here\n"
                     f"  %a = mp.exp %x : ({T}) -> {T}\n  ^\n")
    assert out.read_bytes() == b"KEEP ME"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.ir", "out.ir"]


def test_pass_manager_times_verifies_and_counts_each_pass():
    m = parse(SMALL)
    manager = PassManager(parse_pipeline("cse,dce"))
    manager.run(m)
    assert [name for name, _ in manager.timings] == ["cse", "(verify)", "dce", "(verify)"]
    assert all(t >= 0 for _, t in manager.timings)
    assert manager.statistics == {"cse": Counter({"ops-eliminated": 1}),
                                  "dce": Counter({"ops-erased": 1})}


def test_declared_statistics_appear_even_when_zero():
    m = parse(SMALL)
    manager = PassManager(parse_pipeline("canonicalize"))
    manager.run(m)
    stats = manager.statistics["canonicalize"]
    assert set(stats) == {"ops-folded", "noop-removed", "transposes-merged", "casts-removed",
                          "ops-erased", "cse-eliminated"}
    assert stats["transposes-merged"] == 0 and stats["cse-eliminated"] == 1


def test_verify_each_uses_the_given_verifier_and_can_be_off():
    calls = []
    m = parse(SMALL)
    PassManager(parse_pipeline("cse,dce")).run(m, verify=lambda mod: calls.append(mod))
    assert calls == [m, m]
    calls.clear()
    PassManager(parse_pipeline("cse"), Instrumentation(verify_each=False)).run(
        m, verify=lambda mod: calls.append(mod))
    assert calls == []


def test_instrumentation_writes_dumps_to_its_stream():
    stream = io.StringIO()
    m = parse(SMALL)
    inst = Instrumentation(print_before={"dce"}, print_after_all=True, stream=stream)
    PassManager(parse_pipeline("cse,dce"), inst).run(m)
    text = stream.getvalue()
    headers = [line for line in text.split("\n") if line.startswith("// -----//")]
    assert headers == ["// -----// IR Dump After cse //----- //",
                       "// -----// IR Dump Before dce //----- //",
                       "// -----// IR Dump After dce //----- //"]
    assert text.endswith(print_module(m))


def test_pass_context_collects_statistics():
    ctx = PassContext()
    ctx.stat("a")
    ctx.stat("a", 4)
    ctx.stat("b", 0)
    assert ctx.stats == Counter({"a": 5, "b": 0})


def test_format_timing_merges_rows_and_totals():
    text = format_timing([("Parser", 0.5), ("(verify)", 0.1), ("cse", 0.2), ("(verify)", 0.2)])
    lines = text.rstrip("\n").split("\n")
    assert "  Total Execution Time: 1.0000 seconds" in lines
    assert lines[-4:] == ["    0.5000 ( 50.0%)  Parser", "    0.3000 ( 30.0%)  (verify)",
                          "    0.2000 ( 20.0%)  cse", "    1.0000 (100.0%)  Total"]


def test_format_statistics_lists_counters_sorted_with_help():
    load_passes()
    text = format_statistics({"dce": Counter({"ops-erased": 12}), "other": Counter({"z": 1,
                                                                                   "a": 2})})
    assert text.split("\n")[3:] == ["'dce'", "  (S)     12 ops-erased - dead operations erased",
                                    "'other'", "  (S)      2 a", "  (S)      1 z", ""]
