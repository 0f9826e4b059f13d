"""Target descriptions: built-ins, legalize's fallback chains, the cost model, sheet errors."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.opdef import OPS
from mplower.ir.types import ENCODINGS
from mplower.lowering.target import (
    COMPUTE_FORMATS,
    CSR,
    DENSE,
    FALLBACK,
    KERNEL_FOR_ENCODING,
    NO_BF16_KERNEL,
    NO_F16_ACCUM,
    NO_F16_KERNEL,
    NO_FP8_KERNEL,
    NO_INT8_KERNEL,
    NO_SPARSE_KERNEL,
    REASON_CODES,
    SPARSE_1_2,
    SPARSE_2_4,
    Legal,
    builtin_targets,
    load_target,
    modeled_inferences_per_s,
)
from mplower.numerics.formats import FORMATS


def write_sheet(tmp_path: Path, text: str, name: str = "target.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def line_of(path: Path, needle: str) -> int:
    """1-based number of the first line of `path` containing `needle`."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def load_error(path: Path, **kwargs) -> DiagnosticError:
    with pytest.raises(DiagnosticError) as info:
        load_target(str(path), **kwargs)
    return info.value


MINIMAL = """
[target]
bandwidth = 1e9

[formats.f32]
dense = 1e9

[formats.bf16]
dense = 2e9

[default]
dense = ["f32", "bf16"]
"""


# -- built-ins ---------------------------------------------------------------------------------

def test_builtin_targets_are_the_documented_set():
    assert builtin_targets() == ["a100", "b200", "cpu-avx512", "generic", "h100", "h200"]


@pytest.mark.parametrize("name", builtin_targets())
def test_builtin_target_loads_against_the_op_set(name):
    target = load_target(name, known_ops=OPS)
    assert target.name == name
    assert target.source == f"builtin:{name}"
    assert target.has_kernel("mp.matmul", "f32")


def test_datasheet_figures():
    a100, h100, h200 = load_target("a100"), load_target("h100"), load_target("h200")
    assert (a100.bandwidth, h100.bandwidth, h200.bandwidth) == (2.039e12, 3.35e12, 4.8e12)
    assert a100.peak("bf16") == 312e12 and a100.peak("bf16", SPARSE_2_4) == 624e12
    assert a100.peak("tf32", SPARSE_1_2) == 312e12
    assert h100.peak("f8E4M3FN", SPARSE_2_4) == 3958e12
    assert h100.peak("f8E4M3FN") == 1979e12
    assert h100.peak("bf16", SPARSE_2_4) == 2 * h100.peak("bf16")
    assert h100.formats == h200.formats  # same compute engine, faster memory
    assert "f8E4M3FN" not in a100.formats


def test_every_ir_encoding_names_a_kernel():
    assert set(ENCODINGS) <= set(KERNEL_FOR_ENCODING)
    assert KERNEL_FOR_ENCODING[None] == DENSE
    assert KERNEL_FOR_ENCODING["2:4"] == SPARSE_2_4


def test_fallback_chains_cover_every_compute_format_and_end_at_f32():
    assert set(FALLBACK) == set(COMPUTE_FORMATS) - {"f32"}
    assert set(COMPUTE_FORMATS) <= set(FORMATS)
    for fmt in FALLBACK:
        seen = [fmt]
        while seen[-1] != "f32":
            seen.append(FALLBACK[seen[-1]][0])
        assert len(seen) <= 3, seen
    assert {code for _, code in FALLBACK.values()} <= set(REASON_CODES)
    assert len(set(REASON_CODES)) == len(REASON_CODES)


# -- kernels and legalize ----------------------------------------------------------------------

def test_kernels_per_op_and_format():
    h100, cpu = load_target("h100"), load_target("cpu-avx512")
    assert h100.kernels("mp.matmul", "bf16") == {DENSE, SPARSE_2_4, CSR}
    assert h100.kernels("mp.matmul", "tf32") == {DENSE, SPARSE_1_2}
    assert h100.kernels("mp.matmul", "f32") == {DENSE, CSR}
    assert h100.kernels("mp.conv2d", "i8") == {DENSE, SPARSE_2_4}
    assert h100.kernels("mp.add", "bf16") == {DENSE}
    assert h100.kernels("mp.add", "i8") == frozenset()
    assert cpu.kernels("mp.matmul", "f32") == {DENSE, CSR}
    assert cpu.kernels("mp.matmul", "f16") == frozenset()
    assert not cpu.has_kernel("mp.matmul", "bf16", SPARSE_2_4)


def test_fp8_matmul_falls_back_to_bf16_on_a100_and_stays_on_h100():
    assert load_target("a100").legalize("mp.matmul", "f8E4M3FN", "f32") == Legal(
        "bf16", "f32", DENSE, (NO_FP8_KERNEL,))
    legal = load_target("h100").legalize("mp.matmul", "f8E4M3FN", "f32")
    assert legal == Legal("f8E4M3FN", "f32", DENSE)
    assert (legal.reason, legal.fallback) == (None, False)
    assert load_target("h200").legalize("mp.matmul", "f8E5M2", "f32").compute == "f8E5M2"


def test_int8_without_int8_kernel_falls_back_to_bf16(tmp_path):
    target = load_target(str(write_sheet(tmp_path, MINIMAL)))
    legal = target.legalize("mp.matmul", "i8", "i32")
    assert legal == Legal("bf16", "f32", DENSE, (NO_INT8_KERNEL,))
    assert legal.reason == "no-int8-kernel"


def test_chain_walks_every_missing_step(tmp_path):
    target = load_target(str(write_sheet(tmp_path, MINIMAL.replace(', "bf16"]', "]"))))
    legal = target.legalize("mp.conv2d", "f8E4M3FN", "f32")
    assert legal == Legal("f32", "f32", DENSE, (NO_FP8_KERNEL, NO_BF16_KERNEL))
    assert legal.reason == "no-fp8-kernel,no-bf16-kernel"


def test_f16_falls_to_f32_with_its_accumulator_on_cpu():
    legal = load_target("cpu-avx512").legalize("mp.matmul", "f16", "f16")
    assert legal == Legal("f32", "f32", DENSE, (NO_F16_KERNEL, NO_F16_ACCUM))


def test_f16_accumulator_kept_where_the_tensor_cores_have_it():
    assert load_target("h100").legalize("mp.matmul", "f16", "f16") == Legal("f16", "f16", DENSE)
    assert load_target("a100").legalize("mp.matmul", "f8E4M3FN", "f16") == Legal(
        "bf16", "f32", DENSE, (NO_FP8_KERNEL, NO_F16_ACCUM))


def test_sparse_f32_on_h100_runs_dense():
    assert load_target("h100").legalize("mp.matmul", "f32", "f32", SPARSE_2_4) == Legal(
        "f32", "f32", DENSE, (NO_SPARSE_KERNEL,))


def test_tf32_sparse_on_h100_is_1_2_not_2_4():
    h100 = load_target("h100")
    assert h100.legalize("mp.matmul", "tf32", "f32", SPARSE_1_2) == Legal("tf32", "f32", SPARSE_1_2)
    assert h100.legalize("mp.matmul", "tf32", "f32", SPARSE_2_4) == Legal(
        "tf32", "f32", DENSE, (NO_SPARSE_KERNEL,))


def test_sparse_kernel_survives_a_format_fallback_that_keeps_it():
    assert load_target("a100").legalize("mp.matmul", "f8E4M3FN", "f32", SPARSE_2_4) == Legal(
        "bf16", "f32", SPARSE_2_4, (NO_FP8_KERNEL,))


def test_no_sparse_kernel_on_cpu_but_csr():
    cpu = load_target("cpu-avx512")
    assert cpu.legalize("mp.matmul", "bf16", "f32", SPARSE_2_4) == Legal(
        "bf16", "f32", DENSE, (NO_SPARSE_KERNEL,))
    assert cpu.legalize("mp.matmul", "f32", "f32", CSR) == Legal("f32", "f32", CSR)


def test_integer_compute_accumulates_in_i32():
    assert load_target("cpu-avx512").legalize("mp.matmul", "i8", "i32") == Legal(
        "i8", "i32", DENSE)
    assert load_target("h100").legalize("mp.matmul", "i8", "f32") == Legal("i8", "i32", DENSE)


def test_elementwise_ops_use_the_default_kernels():
    h100, a100 = load_target("h100"), load_target("a100")
    assert h100.legalize("mp.add", "bf16", None) == Legal("bf16", None, DENSE)
    assert h100.legalize("mp.add", "i8", None) == Legal("bf16", None, DENSE, (NO_INT8_KERNEL,))
    assert h100.legalize("mp.relu", "f8E4M3FN", None) == Legal("f8E4M3FN", None, DENSE)
    assert a100.legalize("mp.relu", "f8E4M3FN", None) == Legal(
        "bf16", None, DENSE, (NO_FP8_KERNEL,))
    assert h100.legalize("mp.gelu", "tf32", None).reasons == ("no-tf32-kernel",)


def test_generic_target_runs_every_op_in_every_format():
    generic = load_target("generic")
    for op in OPS:
        for fmt in COMPUTE_FORMATS:
            accum = "i32" if FORMATS[fmt].is_int else "f32"
            assert generic.legalize(op, fmt, accum) == Legal(fmt, accum, DENSE), (op, fmt)
    assert generic.legalize("mp.matmul", "f16", "f16") == Legal("f16", "f16", DENSE)


def test_legalize_rejects_requests_no_policy_can_make():
    h100 = load_target("h100")
    with pytest.raises(ValueError):
        h100.legalize("mp.matmul", "f64", "f32")
    with pytest.raises(ValueError):
        h100.legalize("mp.matmul", "bf16", "f32", "sparse_4_8")
    with pytest.raises(ValueError):
        h100.legalize("mp.matmul", "bf16", "bf16")


# -- cost model --------------------------------------------------------------------------------

def test_op_time_compute_bound_matmul_on_h100():
    h100 = load_target("h100")
    n = 4096
    flops, nbytes = 2 * n**3, 3 * n * n * 2  # bf16 A, B and C
    # compute 1.374e11 / 989.5e12 = 138.9 us > memory 1.007e8 / 3.35e12 = 30.0 us
    assert h100.op_time(flops, nbytes, "bf16") == pytest.approx(
        137438953472 / 989.5e12 + 5e-6, rel=1e-12)
    sparse = h100.op_time(flops, nbytes, "bf16", SPARSE_2_4)
    assert sparse == pytest.approx(137438953472 / 1979e12 + 5e-6, rel=1e-12)


def test_op_time_memory_bound_add():
    h100, h200 = load_target("h100"), load_target("h200")
    flops, nbytes = 1 << 20, 3 * (1 << 20) * 2  # bf16 a + b -> c, 1 Mi elements
    assert h100.op_time(flops, nbytes, "bf16") == pytest.approx(6291456 / 3.35e12 + 5e-6)
    assert h200.op_time(flops, nbytes, "bf16") == pytest.approx(6291456 / 4.8e12 + 5e-6)


def test_op_time_on_cpu_core():
    cpu = load_target("cpu-avx512")
    # 256^3 matmul in i8: 3.36e7 OP / 384e9 = 87.4 us; 3 x 64 KiB / 4.8e9 = 41.0 us
    assert cpu.op_time(2 * 256**3, 3 * 256 * 256, "i8") == pytest.approx(
        33554432 / 384e9 + 1e-6)


def test_peak_of_a_missing_kernel_is_an_error():
    with pytest.raises(ValueError):
        load_target("a100").peak("f8E4M3FN")
    with pytest.raises(ValueError):
        load_target("h100").peak("tf32", SPARSE_2_4)


def test_modeled_inferences_per_s():
    assert modeled_inferences_per_s([1e-3, 1e-3]) == pytest.approx(500.0)
    assert modeled_inferences_per_s(iter([0.25])) == 4.0
    assert modeled_inferences_per_s([]) == math.inf


# -- errors ------------------------------------------------------------------------------------

def test_target_syntax_error(tmp_path):
    path = write_sheet(tmp_path, MINIMAL.replace("bandwidth = 1e9", "bandwidth = = 1e9"))
    loc = load_error(path).diagnostics[0].loc
    assert (loc.file, loc.line) == (str(path), line_of(path, "bandwidth"))


def test_unknown_target_key_suggests_the_closest(tmp_path):
    path = write_sheet(tmp_path, MINIMAL.replace("bandwidth", "bandwith"))
    err = load_error(path)
    assert err.diagnostics[0].message == (
        "unknown key 'bandwith' in [target]; did you mean 'bandwidth'?")
    assert err.diagnostics[0].loc.line == line_of(path, "bandwith")


def test_unknown_format_table(tmp_path):
    path = write_sheet(tmp_path, MINIMAL.replace("[formats.bf16]", "[formats.bf61]"))
    err = load_error(path)
    assert err.diagnostics[0].message == "unknown format 'bf61'; did you mean 'bf16'?"
    assert err.diagnostics[0].loc.line == line_of(path, "bf61")


def test_unknown_key_in_an_inline_format_table_points_at_its_line(tmp_path):
    path = write_sheet(tmp_path, MINIMAL.replace(
        "[formats.bf16]\ndense = 2e9", "[formats]\nbf16 = { dense = 2e9, spars = 4e9 }"))
    err = load_error(path)
    assert err.diagnostics[0].message == (
        "unknown key 'spars' in [formats.bf16]; did you mean 'sparse'?")
    loc = err.diagnostics[0].loc
    assert (loc.line, loc.col) == (line_of(path, "spars"), 23)


def test_kernel_format_without_peak(tmp_path):
    path = write_sheet(tmp_path, MINIMAL.replace('dense = ["f32", "bf16"]',
                                                 'dense = ["f32", "bf16", "f16"]'))
    err = load_error(path)
    assert err.diagnostics[0].message == "format 'f16' has no [formats.f16] table"
    loc = err.diagnostics[0].loc
    assert (loc.line, loc.col) == (line_of(path, '"f16"'), 25)


def test_every_kernel_group_needs_dense_f32(tmp_path):
    path = write_sheet(tmp_path, MINIMAL + '\n[[kernels]]\nops = ["mp.matmul"]\ndense = ["bf16"]\n')
    err = load_error(path)
    assert err.diagnostics[0].message.startswith("every op needs a dense f32 kernel")
    assert err.diagnostics[0].loc.line == line_of(path, 'dense = ["bf16"]')


def test_sparse_kernel_needs_peak_and_dense_kernel(tmp_path):
    group = '\n[[kernels]]\nops = ["mp.matmul"]\ndense = ["f32"]\nsparse = ["bf16"]\n'
    err = load_error(write_sheet(tmp_path, MINIMAL + group))
    assert err.diagnostics[0].message == "[formats.bf16] has no 'sparse' peak"
    text = MINIMAL.replace("dense = 2e9", "dense = 2e9\nsparse = 4e9") + group
    err = load_error(write_sheet(tmp_path, text))
    assert err.diagnostics[0].message == (
        "a sparse bf16 kernel needs a dense bf16 kernel to fall back to")


def test_bad_sparse_pattern(tmp_path):
    path = write_sheet(tmp_path, MINIMAL.replace(
        "dense = 2e9", 'dense = 2e9\nsparse = 4e9\nsparse_pattern = "2:8"'))
    err = load_error(path)
    assert err.diagnostics[0].message == "unknown sparse pattern '2:8'; did you mean '2:4'?"
    assert err.diagnostics[0].loc.line == line_of(path, "2:8")


def test_op_names_checked_and_unique(tmp_path):
    group = '\n[[kernels]]\nops = ["mp.matmul", "mp.conv2d"]\ndense = ["f32"]\n'
    path = write_sheet(tmp_path, MINIMAL + group.replace("mp.conv2d", "mp.conv"))
    err = load_error(path, known_ops=OPS)
    assert err.diagnostics[0].message == "unknown op 'mp.conv'; did you mean 'mp.conv2d'?"
    path = write_sheet(tmp_path, MINIMAL + group + group.replace('"mp.matmul", ', ""))
    err = load_error(path)
    assert err.diagnostics[0].message == "op 'mp.conv2d' is in two [[kernels]] groups"
    assert err.diagnostics[0].loc.line == path.read_text().splitlines().index(
        'ops = ["mp.conv2d"]') + 1


def test_accumulator_kind_must_match_format(tmp_path):
    path = write_sheet(tmp_path, MINIMAL.replace("dense = 2e9", 'dense = 2e9\naccum = ["i32"]'))
    assert load_error(path).diagnostics[0].message == "bf16 cannot accumulate in i32"


def test_missing_bandwidth_and_default(tmp_path):
    path = write_sheet(tmp_path, MINIMAL.replace("bandwidth = 1e9", 'name = "x"'))
    assert load_error(path).diagnostics[0].message == "missing key 'target.bandwidth'"
    path = write_sheet(tmp_path, MINIMAL.split("[default]")[0])
    assert load_error(path).diagnostics[0].message == "missing table [default]"


def test_negative_figures_are_rejected(tmp_path):
    path = write_sheet(tmp_path, MINIMAL.replace("dense = 2e9", "dense = -2e9"))
    err = load_error(path)
    assert err.diagnostics[0].message == ("'formats.bf16.dense' must be between 1 and "
                                          "1e+21 FLOP/s, not -2000000000.0")
    assert err.diagnostics[0].loc.line == line_of(path, "-2e9")


def test_unknown_builtin_target_lists_the_builtins():
    with pytest.raises(DiagnosticError) as info:
        load_target("h10")
    msg = info.value.diagnostics[0].message
    assert msg.startswith("unknown built-in target 'h10'; did you mean ")
    assert "a100, b200, cpu-avx512, generic, h100, h200" in msg


# -- kernel classes ([rates.CLASS]) ------------------------------------------------------------
RATES = MINIMAL + """
[rates.conv_depthwise]
f32 = 3e9
i8 = 2e8

[rates.lrn]
f32 = 6e8
"""


def test_rates_tables_give_a_measured_rate_per_kernel_class_and_format(tmp_path):
    target = load_target(str(write_sheet(tmp_path, RATES)))
    assert target.rates == {"conv_depthwise": {"f32": 3e9, "i8": 2e8}, "lrn": {"f32": 6e8}}
    assert target.class_rate("conv_depthwise", "i8") == 2e8
    assert target.class_rate("lrn", "bf16") is None  # priced by bf16's peak
    assert target.class_rate("max_pool", "f32") is None and target.class_rate(None, "f32") is None


@pytest.mark.parametrize("name", builtin_targets())
def test_builtin_sheets_have_no_class_rates(name):
    # Datasheets give no per-kernel figures: only a measured sheet has them.
    assert load_target(name).rates == {}


@pytest.mark.parametrize(("old", "new", "needle", "message"), [
    ("[rates.lrn]", "[rates.lrm]", "lrm", "unknown kernel class 'lrm'; did you mean 'lrn'?"),
    ("i8 = 2e8", "ui8 = 2e8", "ui8",
     ("'ui8' is not a compute format (expected one of: f32, tf32, bf16, f16, f8E4M3FN, "
      "f8E5M2, f6E2M3FN, f6E3M2FN, f4E2M1FN, i8)")),
    ("i8 = 2e8", "bf61 = 2e8", "bf61", "unknown format 'bf61'; did you mean 'bf16'?"),
    ("i8 = 2e8", "i8 = -2e8", "-2e8",
     "'rates.conv_depthwise.i8' must be between 1 and 1e+21 FLOP/s, not -200000000.0"),
    ("i8 = 2e8", "i8 = nan", "nan", "'rates.conv_depthwise.i8' must be a finite number, not nan"),
    ("i8 = 2e8", 'i8 = "fast"', "fast", "'rates.conv_depthwise.i8' must be a number"),
    ("[rates.lrn]\nf32 = 6e8", "[rates]\nlrn = 6e8", "lrn = ", "'rates.lrn' must be a table"),
])
def test_bad_rates_entries_are_located_errors(tmp_path, old, new, needle, message):
    path = write_sheet(tmp_path, RATES.replace(old, new))
    diag = load_error(path).diagnostics[0]
    assert (diag.message, diag.loc.file, diag.loc.line) == (message, str(path),
                                                            line_of(path, needle))


def test_kernel_class_of_a_conv_follows_its_groups():
    from mplower.ir.types import TensorType
    from mplower.lowering.target import kernel_class

    x = [TensorType((1, 8, 4, 4), "f32")]
    assert kernel_class("mp.conv2d", {"groups": 1}, x) is None  # a GEMM: the format's peak
    assert kernel_class("mp.conv2d", {"groups": 8}, x) == "conv_depthwise"
    assert kernel_class("mp.conv2d", {"groups": 4}, x) == "conv_grouped"
    assert kernel_class("mp.max_pool2d", {}, x) == "max_pool"
    assert kernel_class("mp.lrn", {}, x) == "lrn"
    assert kernel_class("mp.matmul", {}, x) is None
