"""Precision assignment end to end: assign-precision, legalize, insert-casts, canonicalize, report."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mplower.cli.main import main
from mplower.ir.graph import Module
from mplower.ir.opdef import attr_type
from mplower.ir.parser import parse, parse_file
from mplower.ir.printer import print_module
from mplower.numerics.formats import represents
from mplower.pass_manager import PassManager, parse_pipeline

EXAMPLES = Path(__file__).resolve().parent.parent / "ir_examples"
PIPELINE = "assign-precision{policy=%s},legalize{target=%s},insert-casts,canonicalize"


def lower(module: Module, policy: str = "bf16", target: str = "generic") -> Module:
    PassManager(parse_pipeline(PIPELINE % (policy, target))).run(module)
    return module


def ops_of(module: Module, name: str) -> list[dict]:
    f = module.function()
    return [f.data(n) | {"node": n} for n in f.ops() if f.op(n) == name]


def cast_problems(module: Module) -> list[str]:
    """Casts that are redundant: same type, duplicated, or an exact round trip."""
    problems = []
    for f in module.functions.values():
        seen = set()
        for n in f.walk("mp.cast"):
            (src,) = f.operands(n)
            src_t, out_t = f.type_of(src), f.types(n)[0]
            if src_t == out_t:
                problems.append(f"cast to the same type: %{f.data(n)['name']}")
            if (src, out_t) in seen:
                problems.append(f"second cast of one value to {out_t}")
            seen.add((src, out_t))
            if f.op(src[0]) == "mp.cast":
                (origin,) = f.operands(src[0])
                if f.type_of(origin) == out_t and represents(src_t.elem, out_t.elem):
                    problems.append(f"exact round trip through {src_t}")
    return problems


def test_transformer_bf16_plan_matches_the_acceptance_criteria():
    m = lower(parse_file(EXAMPLES / "transformer.ir"))
    matmuls = ops_of(m, "mp.matmul")
    assert len(matmuls) == 8
    for d in matmuls:
        assert attr_type(d["attrs"]["mp.precision"]) == "bf16"
        assert attr_type(d["attrs"]["mp.accum"]) == "f32"
        assert d["types"][0].elem == "bf16"
    for op in ("mp.softmax", "mp.layer_norm"):
        for d in ops_of(m, op):
            assert attr_type(d["attrs"]["mp.precision"]) == "f32"
            assert d["attrs"]["mp.reason"] == "deny-list"
            assert d["types"][0].elem == "f32"
    text = print_module(m)
    assert print_module(parse(text)) == text
    assert cast_problems(m) == []
    f = m.function()
    # Exactly one cast per lowered value boundary: every cast's source is used in another
    # format by some op, and no value is cast twice to one type (cast_problems above).
    for n in f.walk("mp.cast"):
        assert f.uses((n, 0)), "a cast nobody uses"
    assert [t.elem for t in f.result_types] == ["f32"]
    assert f.type_of((f.args[0], 0)).elem == "f32"


def test_fp8_on_a100_leaves_no_fp8_type_and_every_fallback_has_a_reason():
    m = lower(parse_file(EXAMPLES / "transformer.ir"), "fp8", "a100")
    text = print_module(m)
    assert "xf8E4M3FN" not in text and "xf8E5M2" not in text
    fell_back = [d for d in ops_of(m, "mp.matmul") if "mp.fallback" in d["attrs"]]
    assert len(fell_back) == 6  # 8 matmuls, the first and last kept f32
    for d in fell_back:
        assert d["attrs"]["mp.fallback"] == "no-fp8-kernel"
        assert "fallback no-fp8-kernel: f8E4M3FN/f32 -> bf16/f32" in d["attrs"]["mp.reason"]
        assert attr_type(d["attrs"]["mp.precision"]) == "bf16"


def test_fp8_on_h100_keeps_the_fp8_matmuls():
    m = lower(parse_file(EXAMPLES / "transformer.ir"), "fp8", "h100")
    f = m.function()
    fp8 = [d for d in ops_of(m, "mp.matmul")
           if {t.elem for t in f.operand_types(d["node"])} == {"f8E4M3FN"}]
    assert len(fp8) == 6
    assert all("mp.fallback" not in d["attrs"] for d in fp8)
    assert all(d["types"][0].elem == "f32" for d in fp8)  # fp8 GEMMs write their accumulator


def test_fp32_sheet_pipeline_prints_exactly_the_input():
    for path in sorted(EXAMPLES.glob("*.ir")):
        before = print_module(parse_file(path))
        assert print_module(lower(parse_file(path), "fp32")) == before


def test_report_json_has_the_documented_keys(tmp_path, capsys):
    lowered = tmp_path / "t.ir"
    assert main(["opt", str(EXAMPLES / "transformer.ir"), "-p",
                 PIPELINE % ("bf16", "h100"), "-o", str(lowered)]) == 0
    assert main(["report", str(lowered), "--target", "h100", "--format", "json"]) == 0
    sheet = json.loads(capsys.readouterr().out)
    assert {"name", "op", "compute", "accum", "kernel", "reason", "flops",
            "modeled_time_s"} <= set(sheet["ops"][0])
    first = sheet["ops"][0]
    assert first["name"] == "%x_bf16" and first["op"] == "mp.cast"
    q = next(r for r in sheet["ops"] if r["name"] == "%q_proj")
    assert (q["compute"], q["accum"], q["kernel"], q["reason"]) == ("bf16", "f32", "dense",
                                                                    "allow-list")
    assert q["flops"] == 2 * 16 * 64 * 64
    s = sheet["summary"]
    assert abs(s["modeled_time_s"] - sum(r["modeled_time_s"] for r in sheet["ops"])) < 1e-12
    assert s["modeled_speedup_vs_fp32"] > 0


def test_report_formats(tmp_path, capsys):
    for fmt, marker in (("table", "modeled time"), ("markdown", "| name | op |"),
                        ("csv", "name,op,compute,accum,kernel,reason,flops,modeled_time_s")):
        assert main(["report", str(EXAMPLES / "mlp.ir"), "--format", fmt]) == 0
        out = capsys.readouterr().out
        assert marker in out
        assert "%0" in out and "mp.matmul" in out


def test_bad_policy_is_a_located_diagnostic(tmp_path, capsys):
    sheet = tmp_path / "bad.toml"
    sheet.write_text('[policy]\nname = "x"\ncompute = "bf61"\naccum = "f32"\n')
    out = tmp_path / "out.ir"
    out.write_text("KEEP ME")
    rc = main(["opt", str(EXAMPLES / "mlp.ir"), f"--pass=assign-precision{{policy={sheet}}}",
               "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"{sheet}:3:" in err and "bf61" in err and "bf16" in err
    assert out.read_text() == "KEEP ME"


# ---- properties on generated modules ------------------------------------------------------

UNARY = ("mp.relu", "mp.gelu", "mp.sigmoid", "mp.tanh", "mp.exp", "mp.neg")
ACT = "tensor<8x16xf32>"


@st.composite
def modules(draw) -> str:
    """Random DAGs of matmuls, elementwise ops, softmax and layer_norm on 8x16 activations."""
    lines = ["  %w = mp.constant {name = \"w\"} : () -> tensor<16x16xf32>",
             "  %b = mp.constant {value = dense<0.5> : tensor<16xf32>} : () -> tensor<16xf32>"]
    values = ["%x"]
    for i in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(("matmul", "bias", "add", "unary", "softmax", "norm")))
        a = draw(st.sampled_from(values))
        r = f"%v{i}"
        if kind == "matmul":
            w = draw(st.sampled_from(("%w", "%y")))
            lines.append(f"  {r} = mp.matmul {a}, {w} : ({ACT}, tensor<16x16xf32>) -> {ACT}")
        elif kind == "bias":
            lines.append(f"  {r} = mp.add {a}, %b : ({ACT}, tensor<16xf32>) -> {ACT}")
        elif kind == "add":
            c = draw(st.sampled_from(values))
            lines.append(f"  {r} = mp.add {a}, {c} : ({ACT}, {ACT}) -> {ACT}")
        elif kind == "unary":
            op = draw(st.sampled_from(UNARY))
            lines.append(f"  {r} = {op} {a} : ({ACT}) -> {ACT}")
        elif kind == "softmax":
            lines.append(f"  {r} = mp.softmax {a} {{axis = -1}} : ({ACT}) -> {ACT}")
        else:
            lines.append(f"  {r} = mp.layer_norm {a}, %b, %b {{axis = 1, epsilon = 1.0e-05}} : "
                         f"({ACT}, tensor<16xf32>, tensor<16xf32>) -> {ACT}")
        values.append(r)
    outs = draw(st.lists(st.sampled_from(values), min_size=1, max_size=2))
    types = ", ".join([ACT] * len(outs))
    head = (f"func.func @main(%x: {ACT}, %y: tensor<16x16xf32>) -> "
            f"{'(' + types + ')' if len(outs) > 1 else types} {{")
    return "\n".join([head, *lines, f"  return {', '.join(outs)} : {types}", "}"]) + "\n"


POLICIES = ("bf16", "fp16", "fp8", "tf32", "bf16-fp8", "int8", "w8a16")
TARGETS = ("generic", "a100", "h100", "cpu-avx512")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(modules(), st.sampled_from(POLICIES), st.sampled_from(TARGETS))
def test_pipeline_verifies_is_idempotent_and_leaves_no_redundant_cast(text, policy, target):
    once = print_module(lower(parse(text), policy, target))  # verify-each is on
    assert print_module(parse(once)) == once
    twice = print_module(lower(parse(once), policy, target))
    assert twice == once
    assert cast_problems(parse(once)) == []


@settings(max_examples=60, deadline=None)
@given(modules(), st.sampled_from(TARGETS))
def test_fp32_sheet_is_the_identity(text, target):
    # The fp32 sheet adds nothing: the pipeline does what canonicalize alone does, and on a
    # module canonicalize leaves alone it prints exactly the input.
    canonical = parse(text)
    PassManager(parse_pipeline("canonicalize")).run(canonical)
    lowered = print_module(lower(parse(text), "fp32", target))
    assert lowered == print_module(canonical)
    if print_module(canonical) == print_module(parse(text)):
        assert lowered == print_module(parse(text))
