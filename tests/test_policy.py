"""Policy sheets: built-ins, decisions with their exact reasons, and located sheet errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from mplower.dialect.mp import ACCUMULATING, COMPUTE_HEAVY
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import Module
from mplower.lowering.policy import (
    ALLOW_LIST,
    DENY_LIST,
    KEEP_FIRST_LAST,
    NOT_LISTED,
    Decision,
    builtin_policies,
    load_policy,
)

# The mp op set of DESIGN.md §3.
DESIGN_OPS = [
    "mp.constant", "mp.matmul", "mp.conv2d", "mp.add", "mp.sub", "mp.mul", "mp.div",
    "mp.maximum", "mp.minimum", "mp.neg", "mp.relu", "mp.sigmoid", "mp.tanh", "mp.exp", "mp.log",
    "mp.sqrt", "mp.rsqrt", "mp.gelu", "mp.softmax", "mp.layer_norm", "mp.rms_norm",
    "mp.reduce_sum", "mp.reduce_mean", "mp.reduce_max", "mp.argmax", "mp.reshape",
    "mp.transpose", "mp.concat", "mp.slice", "mp.flatten", "mp.max_pool2d", "mp.avg_pool2d",
    "mp.global_avg_pool", "mp.cast", "mp.quantize", "mp.dequantize", "mp.fake_quant",
    "mp.sparse_encode", "mp.gather", "mp.gather_elements", "mp.gather_nd", "mp.where",
    "mp.expand", "mp.split", "mp.trilu", "mp.pow", "mp.cumsum",
]


def write_sheet(tmp_path: Path, text: str, name: str = "sheet.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def line_of(path: Path, needle: str) -> int:
    """1-based number of the first line of `path` containing `needle`."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def load_error(path: Path, **kwargs) -> DiagnosticError:
    with pytest.raises(DiagnosticError) as info:
        load_policy(str(path), **kwargs)
    return info.value


BASE = """
[policy]
compute = "bf16"
allow = ["mp.matmul", "mp.conv2d"]
follow = ["mp.add", "mp.relu"]
deny = ["mp.softmax", "mp.reduce_sum"]
"""


# -- built-ins ---------------------------------------------------------------------------------

def test_builtin_policies_are_the_documented_set():
    assert builtin_policies() == sorted(
        ["fp32", "tf32", "bf16", "fp16", "fp8", "int8", "w8a16", "bf16-fp8", "bf16-int8",
         "fp8-block", "mxfp8", "mxfp4", "nvfp4"])


@pytest.mark.parametrize("name", builtin_policies())
def test_builtin_policy_loads_against_the_design_op_set(name):
    policy = load_policy(name, known_ops=DESIGN_OPS)
    assert policy.name == name
    assert policy.source == f"builtin:{name}"
    assert policy.guardrails["max_rel_l2"] > 0
    assert set(policy.allow) | set(policy.follow) | set(policy.deny) <= set(DESIGN_OPS)


@pytest.mark.parametrize("inputs_lowered", [False, True])
@pytest.mark.parametrize("first_or_last", [False, True])
def test_fp32_policy_decides_f32_for_every_design_op(inputs_lowered, first_or_last):
    policy = load_policy("fp32")
    for op in DESIGN_OPS:
        d = policy.decide(op, "%0", inputs_lowered, first_or_last)
        assert d.compute == "f32", op
        assert d.accum == ("f32" if op in ACCUMULATING else None), op


def test_builtin_compute_and_accumulators():
    expected = {
        "fp32": ("f32", "f32"), "tf32": ("tf32", "f32"), "bf16": ("bf16", "f32"),
        "fp16": ("f16", "f32"), "fp8": ("f8E4M3FN", "f32"), "int8": ("i8", "i32"),
        "w8a16": ("bf16", "f32"), "bf16-fp8": ("f8E4M3FN", "f32"), "bf16-int8": ("i8", "i32"),
    }
    for name, compute_accum in expected.items():
        d = load_policy(name).decide("mp.matmul", "%mm", False, False)
        assert (d.compute, d.accum) == compute_accum, name


def test_w8a16_quantizes_weights_only():
    policy = load_policy("w8a16")
    assert policy.weights == "i8"
    assert policy.decide("mp.matmul", "%0", False, False) == Decision("bf16", "f32", ALLOW_LIST)
    assert load_policy("bf16").weights is None


def test_compute_heavy_ops_are_matmul_and_conv():
    assert COMPUTE_HEAVY == {"mp.matmul", "mp.conv2d"}


# -- decisions ---------------------------------------------------------------------------------

def test_bf16_decisions_carry_exact_reasons():
    p = load_policy("bf16")
    assert p.decide("mp.matmul", "%0", False, False) == Decision("bf16", "f32", "allow-list")
    assert p.decide("mp.add", "%1", True, False) == Decision("bf16", None, "follow: inputs bf16")
    assert p.decide("mp.add", "%1", False, False) == Decision("f32", None, "follow: inputs f32")
    assert p.decide("mp.softmax", "%2", True, False) == Decision("f32", None, "deny-list")
    assert p.decide("mp.reduce_sum", "%3", True, False) == Decision("f32", "f32", DENY_LIST)
    assert p.decide("mp.cast", "%4", True, False) == Decision("f32", None, "not-listed")
    assert NOT_LISTED == "not-listed"


def test_override_by_name_glob(tmp_path):
    path = write_sheet(tmp_path, BASE + """
        [[override]]
        name = "%fc*"
        compute = "f32"
        """)
    p = load_policy(str(path))
    assert p.decide("mp.matmul", "%fc1", False, False) == Decision("f32", "f32", "override %fc*")
    assert p.decide("mp.matmul", "%proj", False, False) == Decision("bf16", "f32", "allow-list")


def test_override_by_op_and_name_needs_both_to_match(tmp_path):
    path = write_sheet(tmp_path, BASE + """
        [[override]]
        op = "mp.matmul"
        name = "%attn.*"
        compute = "f16"
        """)
    p = load_policy(str(path))
    assert p.decide("mp.matmul", "%attn.q", False, False) == Decision(
        "f16", "f32", "override mp.matmul %attn.*")
    assert p.decide("mp.add", "%attn.q", True, False).reason == "follow: inputs bf16"


def test_later_override_wins_field_by_field(tmp_path):
    path = write_sheet(tmp_path, BASE + """
        [[override]]
        op = "mp.matmul"
        compute = "f16"
        accum = "f16"
        [[override]]
        op = "mp.matmul"
        compute = "f8E4M3FN"
        """)
    d = load_policy(str(path)).decide("mp.matmul", "%0", False, False)
    assert d == Decision("f8E4M3FN", "f16", "override mp.matmul")


def test_override_beats_deny_list(tmp_path):
    path = write_sheet(tmp_path, BASE + """
        [[override]]
        op = "mp.softmax"
        compute = "bf16"
        """)
    d = load_policy(str(path)).decide("mp.softmax", "%0", True, False)
    assert d == Decision("bf16", None, "override mp.softmax")


def test_keep_first_last_beats_allow_and_op_overrides_but_not_name_overrides(tmp_path):
    path = write_sheet(tmp_path, """
        [policy]
        compute = "bf16"
        allow = ["mp.matmul", "mp.conv2d"]
        keep_first_last = true
        [[override]]
        op = "mp.conv2d"
        compute = "f8E4M3FN"
        [[override]]
        name = "%logits"
        compute = "f16"
        """)
    p = load_policy(str(path))
    assert p.keep_first_last
    assert p.decide("mp.matmul", "%0", False, True) == Decision("f32", "f32", KEEP_FIRST_LAST)
    assert p.decide("mp.conv2d", "%1", False, True) == Decision("f32", "f32", "keep-first-last")
    assert p.decide("mp.conv2d", "%1", False, False).compute == "f8E4M3FN"
    assert p.decide("mp.matmul", "%logits", False, True) == Decision(
        "f16", "f32", "override %logits")


def test_keep_first_last_leaves_ops_that_stay_wide_with_their_own_reason():
    p = load_policy("int8")
    assert p.decide("mp.matmul", "%0", False, True) == Decision("f32", "f32", "keep-first-last")
    assert p.decide("mp.reduce_sum", "%1", True, True) == Decision("f32", "f32", "deny-list")


def test_int8_accumulates_in_i32_and_its_float_ops_in_f32(tmp_path):
    p = load_policy("int8")
    assert p.decide("mp.conv2d", "%0", False, False) == Decision("i8", "i32", "allow-list")
    assert p.decide("mp.reduce_mean", "%1", True, False) == Decision("f32", "f32", "deny-list")
    assert p.decide("mp.relu", "%2", True, False) == Decision("i8", None, "follow: inputs i8")
    path = write_sheet(tmp_path, """
        [policy]
        compute = "i8"
        allow = ["mp.matmul"]
        [[override]]
        name = "%head"
        compute = "bf16"
        """)
    d = load_policy(str(path)).decide("mp.matmul", "%head", False, False)
    assert d == Decision("bf16", "f32", "override %head")


def test_bf16_int8_mixed_sheet_runs_matmuls_in_int8_and_the_rest_in_bf16():
    p = load_policy("bf16-int8")
    assert p.decide("mp.matmul", "%0", False, False) == Decision("i8", "i32", "override mp.matmul")
    assert p.decide("mp.gelu", "%1", True, False) == Decision("bf16", None, "follow: inputs bf16")


def test_accumulator_is_never_narrower_than_compute(tmp_path):
    path = write_sheet(tmp_path, """
        [policy]
        compute = "f16"
        accum = "f16"
        allow = ["mp.matmul"]
        deny = ["mp.reduce_sum"]
        """)
    p = load_policy(str(path))
    assert p.decide("mp.matmul", "%0", False, False) == Decision("f16", "f16", "allow-list")
    assert p.decide("mp.reduce_sum", "%1", True, False) == Decision("f32", "f32", "deny-list")


def test_defaults_of_a_minimal_sheet(tmp_path):
    path = write_sheet(tmp_path, '[policy]\ncompute = "bf16"\n', name="mine.toml")
    p = load_policy(str(path))
    assert (p.name, p.accum, p.keep_io_types, p.keep_first_last) == ("mine", "f32", True, False)
    assert (p.allow, p.follow, p.deny, p.overrides, p.guardrails) == ((), (), (), (), {})
    assert p.source == str(path)


def test_module_relative_path_resolves_against_the_ir_files_folder(tmp_path):
    write_sheet(tmp_path, '[policy]\ncompute = "f16"\n', name="local.toml")
    module = Module()
    module.path = str(tmp_path / "m.ir")
    assert load_policy("local.toml", module=module).compute == "f16"


def test_guardrails_are_read_as_floats(tmp_path):
    path = write_sheet(tmp_path, BASE + """
        [guardrails]
        max_rel_l2 = 0.01
        min_sqnr_db = 30
        max_overflow = 0
        min_top1_agreement = 0.99
        """)
    assert load_policy(str(path)).guardrails == {
        "max_rel_l2": 0.01, "min_sqnr_db": 30.0, "max_overflow": 0.0, "min_top1_agreement": 0.99}


# -- errors ------------------------------------------------------------------------------------

def test_toml_syntax_error_at_end_of_file_points_after_the_last_token(tmp_path):
    path = write_sheet(tmp_path, '[policy]\ncompute = "bf16"\nallow = ["mp.matmul",\n')
    err = load_error(path)
    loc = err.diagnostics[0].loc
    assert (loc.file, loc.line, loc.col) == (str(path), 3, 22)  # just after the last token
    assert err.diagnostics[0].message == "invalid TOML: invalid value at end of file"


def test_toml_syntax_error_with_position_keeps_line_and_column(tmp_path):
    path = write_sheet(tmp_path, '[policy]\ncompute = "bf16"\nallow = [1 2]\n')
    loc = load_error(path).diagnostics[0].loc
    assert (loc.line, loc.col) == (3, 12)


def test_unknown_key_suggests_the_closest(tmp_path):
    path = write_sheet(tmp_path, BASE.replace('compute = "bf16"', 'comptue = "bf16"'))
    err = load_error(path)
    assert err.diagnostics[0].message == (
        "unknown key 'comptue' in [policy]; did you mean 'compute'?")
    assert err.diagnostics[0].loc.line == line_of(path, "comptue")
    assert err.diagnostics[0].loc.col == 1


def test_unknown_top_level_table(tmp_path):
    path = write_sheet(tmp_path, BASE + "\n[guardrail]\nmax_rel_l2 = 0.1\n")
    err = load_error(path)
    assert err.diagnostics[0].message == "unknown key 'guardrail'; did you mean 'guardrails'?"
    assert err.diagnostics[0].loc.line == line_of(path, "[guardrail]")


def test_unknown_key_in_an_override_points_at_that_override(tmp_path):
    path = write_sheet(tmp_path, BASE + """
        [[override]]
        op = "mp.matmul"
        compute = "f16"
        [[override]]
        op = "mp.conv2d"
        acum = "f16"
        """)
    err = load_error(path)
    assert err.diagnostics[0].message == (
        "unknown key 'acum' in [override]; did you mean 'accum'?")
    assert err.diagnostics[0].loc.line == line_of(path, "acum")


def test_unknown_format_suggests_the_closest(tmp_path):
    path = write_sheet(tmp_path, BASE.replace('compute = "bf16"', 'compute = "bf61"'))
    err = load_error(path)
    assert err.diagnostics[0].message == "unknown format 'bf61'; did you mean 'bf16'?"
    loc = err.diagnostics[0].loc
    assert (loc.file, loc.line, loc.col) == (str(path), line_of(path, "bf61"), 11)


def test_real_format_that_cannot_compute_is_named_as_such(tmp_path):
    path = write_sheet(tmp_path, BASE.replace('compute = "bf16"', 'compute = "i32"'))
    msg = load_error(path).diagnostics[0].message
    assert msg.startswith("'i32' is not a compute format (expected one of: f32, tf32, bf16")


def test_unknown_format_in_an_override(tmp_path):
    path = write_sheet(tmp_path, BASE + """
        [[override]]
        name = "%fc*"
        compute = "fp8"
        """)
    err = load_error(path)
    assert err.diagnostics[0].message.startswith("unknown format 'fp8'")
    assert err.diagnostics[0].loc.line == line_of(path, '"fp8"')


def test_op_in_allow_and_deny_is_reported_at_the_second_list(tmp_path):
    path = write_sheet(tmp_path, """
        [policy]
        compute = "bf16"
        allow = ["mp.matmul",
                 "mp.softmax"]
        deny = ["mp.exp",
                "mp.softmax"]
        """)
    err = load_error(path)
    assert err.diagnostics[0].message == "op 'mp.softmax' is in both allow and deny"
    loc = err.diagnostics[0].loc
    assert (loc.line, loc.col) == (6, 9)


def test_unknown_op_is_checked_against_known_ops(tmp_path):
    path = write_sheet(tmp_path, BASE.replace('"mp.relu"', '"mp.rleu"'))
    assert load_policy(str(path)).follow == ("mp.add", "mp.rleu")  # no op set given: accepted
    err = load_error(path, known_ops=DESIGN_OPS)
    assert err.diagnostics[0].message == "unknown op 'mp.rleu'; did you mean 'mp.relu'?"
    assert err.diagnostics[0].loc.line == line_of(path, "mp.rleu")


def test_unknown_op_in_override(tmp_path):
    path = write_sheet(tmp_path, BASE + '\n[[override]]\nop = "mp.matmull"\ncompute = "f32"\n')
    err = load_error(path, known_ops=DESIGN_OPS)
    assert err.diagnostics[0].message == "unknown op 'mp.matmull'; did you mean 'mp.matmul'?"
    assert err.diagnostics[0].loc.line == line_of(path, "mp.matmull")


@pytest.mark.parametrize(("line", "message"), [
    ('keep_first_last = "yes"', "'policy.keep_first_last' must be true or false"),
    ('allow = "mp.matmul"', "'policy.allow' must be a list of strings"),
    ("compute = 16", "'policy.compute' must be a string"),
])
def test_wrong_value_types(tmp_path, line, message):
    key = line.split(" =")[0]
    text = "\n".join(ln for ln in BASE.splitlines() if not ln.startswith(key + " ="))
    path = write_sheet(tmp_path, text + "\n" + line + "\n")
    err = load_error(path)
    assert err.diagnostics[0].message == message
    assert err.diagnostics[0].loc.line == line_of(path, line)


def test_guardrail_must_be_a_number(tmp_path):
    path = write_sheet(tmp_path, BASE + '\n[guardrails]\nmax_rel_l2 = "small"\n')
    err = load_error(path)
    assert err.diagnostics[0].message == "'guardrails.max_rel_l2' must be a number"
    assert err.diagnostics[0].loc.line == line_of(path, "max_rel_l2")


def test_missing_policy_table_and_compute(tmp_path):
    path = write_sheet(tmp_path, "[guardrails]\nmax_rel_l2 = 0.1\n")
    assert load_error(path).diagnostics[0].message == "missing table [policy]"
    path = write_sheet(tmp_path, '[policy]\nname = "x"\n')
    err = load_error(path)
    assert err.diagnostics[0].message == "missing key 'policy.compute'"
    assert err.diagnostics[0].loc.line == 1


def test_override_needs_a_selector_and_a_format(tmp_path):
    path = write_sheet(tmp_path, BASE + '\n[[override]]\ncompute = "f32"\n')
    err = load_error(path)
    assert err.diagnostics[0].message.startswith("an [[override]] needs 'op' or 'name'")
    assert err.diagnostics[0].loc.line == line_of(path, "[[override]]")
    path = write_sheet(tmp_path, BASE + '\n[[override]]\nop = "mp.matmul"\n')
    assert load_error(path).diagnostics[0].message == (
        "an [[override]] needs 'compute' or 'accum'")


def test_accumulator_must_fit_the_compute_format(tmp_path):
    path = write_sheet(tmp_path, '[policy]\ncompute = "bf16"\naccum = "i32"\n')
    err = load_error(path)
    assert err.diagnostics[0].message == "bf16 compute accumulates in f32, not i32"
    assert err.diagnostics[0].loc.line == 3
    path = write_sheet(tmp_path, '[policy]\ncompute = "bf16"\naccum = "f16"\n')
    assert load_error(path).diagnostics[0].message == (
        "accumulator f16 is narrower than compute format bf16")


def test_weights_accept_only_weight_formats(tmp_path):
    path = write_sheet(tmp_path, '[policy]\ncompute = "bf16"\nweights = "f16"\n')
    assert load_error(path).diagnostics[0].message == (
        "'f16' is not a weight format (expected one of: i8)")


def test_unknown_builtin_lists_the_builtins():
    with pytest.raises(DiagnosticError) as info:
        load_policy("bf61")
    msg = info.value.diagnostics[0].message
    assert msg.startswith("unknown built-in policy 'bf61'; did you mean 'bf16'? (built-ins: ")
    for name in builtin_policies():
        assert name in msg


def test_missing_file(tmp_path):
    with pytest.raises(DiagnosticError) as info:
        load_policy(str(tmp_path / "nope.toml"))
    d = info.value.diagnostics[0]
    assert (d.loc.file, d.message) == (str(tmp_path / "nope.toml"), "no such policy file")


def test_diagnostic_renders_with_caret(tmp_path):
    path = write_sheet(tmp_path, BASE.replace('compute = "bf16"', 'compute = "bf61"'))
    err = load_error(path)
    rendered = err.diagnostics[0].render(path.read_text())
    n = line_of(path, "bf61")
    assert rendered.splitlines() == [
        f"{path}:{n}:11: error: unknown format 'bf61'; did you mean 'bf16'?",
        'compute = "bf61"',
        "          ^",
    ]


def test_override_must_be_an_array_of_tables(tmp_path):
    path = write_sheet(tmp_path, BASE + '\n[override]\nop = "mp.matmul"\ncompute = "f32"\n')
    err = load_error(path)
    assert err.diagnostics[0].message == "'override' must be an array of tables: [[override]]"
    assert err.diagnostics[0].loc.line == line_of(path, "[override]")


# -- op groups ---------------------------------------------------------------------------------

# What the built-in lists were before they named groups (the bf16 family, the fp8 family and
# int8): the groups must decide every op of the design set as the names did.
_WIDE_FOLLOW = {"mp.add", "mp.sub", "mp.mul", "mp.div", "mp.maximum", "mp.minimum", "mp.neg",
                "mp.relu", "mp.sigmoid", "mp.tanh", "mp.sqrt", "mp.gelu", "mp.reduce_max",
                "mp.argmax", "mp.reshape", "mp.transpose", "mp.concat", "mp.slice", "mp.flatten",
                "mp.max_pool2d", "mp.avg_pool2d", "mp.gather", "mp.gather_elements",
                "mp.gather_nd", "mp.where", "mp.expand", "mp.split", "mp.trilu"}
_WIDE_DENY = {"mp.exp", "mp.log", "mp.rsqrt", "mp.softmax", "mp.layer_norm", "mp.rms_norm",
              "mp.reduce_sum", "mp.reduce_mean", "mp.global_avg_pool", "mp.pow", "mp.cumsum"}
_FP8_FOLLOW = {"mp.reshape", "mp.transpose", "mp.flatten", "mp.slice", "mp.concat", "mp.relu",
               "mp.max_pool2d", "mp.reduce_max", "mp.argmax", "mp.maximum", "mp.minimum",
               "mp.neg", "mp.gather", "mp.gather_elements", "mp.gather_nd", "mp.where",
               "mp.expand", "mp.split", "mp.trilu"}
_INT8_FOLLOW = _FP8_FOLLOW - {"mp.concat", "mp.maximum", "mp.minimum", "mp.neg"}
_TYPED = {"mp.constant", "mp.cast", "mp.quantize", "mp.dequantize", "mp.fake_quant",
          "mp.sparse_encode"}  # never lowered: assign-precision does not ask the sheet


@pytest.mark.parametrize("name, follow", [
    *[(n, _WIDE_FOLLOW) for n in ("bf16", "fp16", "fp32", "w8a16", "bf16-fp8", "bf16-int8")],
    *[(n, _FP8_FOLLOW) for n in ("fp8", "fp8-block", "mxfp8", "mxfp4", "nvfp4")],
    ("int8", _INT8_FOLLOW)])
def test_builtin_groups_decide_the_design_ops_as_the_named_lists_did(name, follow):
    p = load_policy(name)
    decided = {op: p.listed(op) for op in set(DESIGN_OPS) - _TYPED}
    assert {op for op, w in decided.items() if w == "allow"} == {"mp.matmul", "mp.conv2d"}
    assert {op for op, w in decided.items() if w == "follow"} == follow
    expected_deny = (_WIDE_DENY if follow is _WIDE_FOLLOW
                     else set(DESIGN_OPS) - _TYPED - follow - {"mp.matmul", "mp.conv2d"})
    assert {op for op, w in decided.items() if w == "deny"} == expected_deny


def test_every_builtin_sheet_names_groups_not_the_contractions():
    for name in builtin_policies():
        text = (Path(__file__).parent.parent / "mplower" / "policies" / f"{name}.toml").read_text()
        assert 'allow = ["@contraction"]' in text, name
        assert '"mp.trilu"' not in text and '"mp.gather"' not in text, name


def test_an_op_name_overrides_its_group(tmp_path):
    path = write_sheet(tmp_path, """
        [policy]
        compute = "bf16"
        follow = ["@data-movement"]
        deny = ["mp.concat"]
        """)
    p = load_policy(str(path))
    assert p.decide("mp.concat", "%c", True, False) == Decision("f32", None, DENY_LIST)
    assert p.decide("mp.transpose", "%t", True, False) == Decision("bf16", None,
                                                                   "follow: inputs bf16")
    assert p.decide("mp.add", "%a", True, False) == Decision("f32", None, NOT_LISTED)
    assert (p.follow, p.deny) == ((), ("mp.concat",))


def test_the_cautious_list_wins_an_op_in_two_groups(tmp_path):
    # matmul accumulates and is a contraction: a sheet that denies @accumulates keeps it f32.
    path = write_sheet(tmp_path, """
        [policy]
        compute = "bf16"
        allow = ["@contraction"]
        deny = ["@accumulates"]
        """)
    p = load_policy(str(path))
    assert p.decide("mp.matmul", "%m", False, False) == Decision("f32", "f32", DENY_LIST)
    assert p.decide("mp.reduce_sum", "%r", False, False) == Decision("f32", "f32", DENY_LIST)


def test_unknown_group_is_located_with_the_closest_name(tmp_path):
    path = write_sheet(tmp_path, BASE.replace('"mp.add"', '"@data-movment"'))
    err = load_error(path)
    assert err.diagnostics[0].message == ("unknown op group '@data-movment'; "
                                          "did you mean '@data-movement'?")
    assert err.diagnostics[0].loc.line == line_of(path, "@data-movment")


def test_group_in_two_lists_is_an_error(tmp_path):
    path = write_sheet(tmp_path, """
        [policy]
        compute = "bf16"
        follow = ["@data-movement"]
        deny = ["mp.exp",
                "@data-movement"]
        """)
    err = load_error(path)
    assert err.diagnostics[0].message == "group '@data-movement' is in both follow and deny"
    assert err.diagnostics[0].loc.line == 5  # the second occurrence
