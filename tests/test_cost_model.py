"""The fused cost model (mplower.lowering.cost, issue 13): group membership, deploy-time weight
conversions, the fp32 baseline, tile and wave quantization, and the sanity orderings on a
production-shape BERT-base layer (orderings, never timings)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from mplower.backend.executor import reference_runner
from mplower.cli.main import main
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.parser import parse, parse_file
from mplower.lowering.cost import LAUNCH, fused_groups, plan_cost
from mplower.lowering.target import load_target
from mplower.pass_manager import PassContext, PassManager, parse_pipeline

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = "assign-precision{policy=%s},legalize{target=%s},insert-casts,canonicalize"


def _production():
    spec = importlib.util.spec_from_file_location("production", ROOT / "ir_examples/production.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bert_ir(tmp_path_factory) -> Path:
    """The BERT-base layer's IR without weights: the cost model needs only its types."""
    path = tmp_path_factory.mktemp("bert") / "bert_base_layer.ir"
    path.write_text(_production().ir_text("bert_base_layer"))
    return path


def _lowered_cost(path: Path, policy: str, target: str = "h100"):
    module = parse_file(path)
    PassManager(parse_pipeline(PIPELINE % (policy, target))).run(module, PassContext())
    return plan_cost(module.function(), load_target(target))


def test_bert_layer_on_h100_models_fp8_faster_than_bf16_faster_than_fp32(bert_ir):
    fp32 = _lowered_cost(bert_ir, "fp32")
    bf16 = _lowered_cost(bert_ir, "bf16")
    fp8 = _lowered_cost(bert_ir, "bf16-fp8")  # every matmul in f8E4M3FN, the rest bf16
    assert fp8.time_s < bf16.time_s < fp32.time_s
    # The fp32 plan is its own baseline, and every plan's baseline is that same figure.
    assert fp32.time_s == fp32.fp32_time_s == bf16.fp32_time_s == fp8.fp32_time_s


@pytest.mark.parametrize("policy", ["bf16", "fp16", "bf16-fp8", "fp8"])
def test_no_plan_of_the_bert_layer_is_modeled_slower_than_fp32(bert_ir, policy):
    cost = _lowered_cost(bert_ir, policy)
    assert cost.speedup_vs_fp32 > 1


def test_bf16_transformer_example_is_modeled_faster_than_fp32_on_h100():
    # Before issue 13 every inserted cast was its own 5 us kernel: 0.60x of fp32.
    cost = _lowered_cost(ROOT / "ir_examples/transformer.ir", "bf16")
    assert cost.speedup_vs_fp32 > 1


def test_casts_alone_never_make_a_plan_slower_than_fp32():
    module = parse("""
func.func @main(%x: tensor<256x256xf32>) -> tensor<256x256xf32> {
  %w = mp.constant {value = dense<0.5> : tensor<256x256xf32>} : () -> tensor<256x256xf32>
  %xb = mp.cast %x : (tensor<256x256xf32>) -> tensor<256x256xbf16>
  %xf = mp.cast %xb : (tensor<256x256xbf16>) -> tensor<256x256xf32>
  %y = mp.matmul %xf, %w : (tensor<256x256xf32>, tensor<256x256xf32>) -> tensor<256x256xf32>
  %yb = mp.cast %y : (tensor<256x256xf32>) -> tensor<256x256xbf16>
  %yf = mp.cast %yb : (tensor<256x256xbf16>) -> tensor<256x256xf32>
  %z = mp.relu %yf : (tensor<256x256xf32>) -> tensor<256x256xf32>
  return %z : tensor<256x256xf32>
}""")
    for name in ("h100", "a100", "cpu-avx512", "generic"):
        cost = plan_cost(module.function(), load_target(name))
        assert cost.time_s <= cost.fp32_time_s, name
        assert len(cost.groups) == 1, name


FUSED = """
func.func @main(%x: tensor<64x128xf32>) -> tensor<64x32xf32> {
  %w1 = mp.constant {value = dense<0.5> : tensor<128x32xf32>} : () -> tensor<128x32xf32>
  %w2 = mp.constant {value = dense<0.25> : tensor<128x32xf32>} : () -> tensor<128x32xf32>
  %b = mp.constant {value = dense<1.0> : tensor<32xf32>} : () -> tensor<32xf32>
  %xb = mp.cast %x : (tensor<64x128xf32>) -> tensor<64x128xbf16>
  %w1b = mp.cast %w1 : (tensor<128x32xf32>) -> tensor<128x32xbf16>
  %w2b = mp.cast %w2 : (tensor<128x32xf32>) -> tensor<128x32xbf16>
  %y = mp.matmul %xb, %w1b : (tensor<64x128xbf16>, tensor<128x32xbf16>) -> tensor<64x32xf32>
  %z = mp.add %y, %b : (tensor<64x32xf32>, tensor<32xf32>) -> tensor<64x32xf32>
  %r = mp.relu %z : (tensor<64x32xf32>) -> tensor<64x32xf32>
  %rb = mp.cast %r : (tensor<64x32xf32>) -> tensor<64x32xbf16>
  %s = mp.softmax %rb {axis = -1} : (tensor<64x32xbf16>) -> tensor<64x32xbf16>
  %e = mp.exp %s : (tensor<64x32xbf16>) -> tensor<64x32xbf16>
  %u = mp.matmul %xb, %w2b : (tensor<64x128xbf16>, tensor<128x32xbf16>) -> tensor<64x32xf32>
  %eu = mp.cast %e : (tensor<64x32xbf16>) -> tensor<64x32xf32>
  %o = mp.add %eu, %u : (tensor<64x32xf32>, tensor<64x32xf32>) -> tensor<64x32xf32>
  return %o : tensor<64x32xf32>
}"""


def test_fused_groups_of_a_hand_written_function():
    groups = fused_groups(parse(FUSED).function(), load_target("h100"))
    # bias, relu and the narrowing cast are the first matmul's epilogue; softmax takes the
    # exp after it; the second matmul cannot take the add (it would join two anchors), so the
    # add and the widening cast it loads through join the softmax group. %xb, read by two
    # matmuls, is folded into both loads; the weight casts are deploy-time constants.
    assert [(g.anchor, g.members) for g in groups] == [
        ("%y", ("%y", "%z", "%r", "%rb")),
        ("%s", ("%s", "%e", "%o")),
        ("%u", ("%u",)),
    ]
    first = groups[0]
    # Reads x in f32 (the folded cast's operand), w1 in bf16 and the bias; writes %rb in bf16.
    assert (first.bytes_read, first.bytes_written) == (64 * 128 * 4 + 128 * 32 * 2 + 32 * 4,
                                                       64 * 32 * 2)
    assert first.flops == 2 * 64 * 128 * 32 + 64 * 32 + 64 * 32 + 0
    assert {g.bound for g in groups} == {LAUNCH}


def test_weight_quantize_and_dequantize_are_free_per_inference():
    module = parse("""
func.func @main(%x: tensor<1024x1024xi8>) -> tensor<1024x1024xf32> {
  %w = mp.constant {value = dense<0.5> : tensor<1024x1024xf32>} : () -> tensor<1024x1024xf32>
  %wq = mp.quantize %w {scale = 0.01 : f32} : (tensor<1024x1024xf32>) -> tensor<1024x1024xi8>
  %acc = mp.matmul %x, %wq : (tensor<1024x1024xi8>, tensor<1024x1024xi8>) -> tensor<1024x1024xi32>
  %y = mp.dequantize %acc {scale = 0.001 : f32} : (tensor<1024x1024xi32>) -> tensor<1024x1024xf32>
  return %y : tensor<1024x1024xf32>
}""")
    cost = plan_cost(module.function(), load_target("h100"))
    (group,) = cost.groups
    assert group.members == ("%acc",)  # no kernel quantizes the weight or dequantizes %acc
    assert "%wq" not in cost.group_of and "%y" not in cost.group_of
    # The weight is read as the i8 it is deployed as; %acc is written as the i32 it is (the
    # dequantize widens, so it is its consumer's load), its one f32 scale beside it.
    assert group.bytes_read == 1024 * 1024 + (1024 * 1024 + 4)
    assert group.weight_bytes == 1024 * 1024 + 4
    assert group.bytes_written == 1024 * 1024 * 4
    assert group.bound == LAUNCH


@pytest.mark.parametrize(("m", "n", "batch", "expected"), [
    (1024, 768, 1, (8 * 6) / 132),  # 48 tiles on 132 SMs: one wave, 36% busy
    (1024, 3072, 1, (8 * 24) / (2 * 132)),  # 192 tiles: two waves, the second 60/132 full
    (100, 128, 1, 100 / 128 * 1 / 132),  # one tile, 100 of its 128 rows used
    (128, 128, 132, 1.0),  # exactly one full wave
])
def test_gemm_efficiency_is_tile_times_wave_quantization(m, n, batch, expected):
    assert load_target("h100").gemm_efficiency(m, n, batch) == pytest.approx(expected)


def test_gemm_efficiency_is_one_without_tiling_figures():
    assert load_target("cpu-avx512").gemm_efficiency(100, 3) == 1.0


def test_report_shows_fused_groups_and_their_bound(tmp_path, capsys):
    lowered = tmp_path / "t.ir"
    assert main(["opt", str(ROOT / "ir_examples/transformer.ir"), "-p",
                 PIPELINE % ("bf16", "h100"), "-o", str(lowered)]) == 0
    assert main(["report", str(lowered), "--target", "h100", "--format", "json"]) == 0
    sheet = json.loads(capsys.readouterr().out)
    first = sheet["groups"][0]
    assert (first["anchor"], first["members"], first["bound"]) == (
        "%q_proj", ["%q_proj", "%q", "%q_split"], "launch")
    assert sheet["summary"]["kernels"] == len(sheet["groups"]) == 13
    # attention (h100 fuses it): scores, scale, softmax, its cast and the product by V
    attention = next(g for g in sheet["groups"] if g["anchor"] == "%scores")
    assert attention["members"] == ["%scores", "%scaled", "%probs", "%probs_bf16", "%ctx_heads"]
    cast = next(r for r in sheet["ops"] if r["name"] == "%x_bf16")
    assert (cast["group"], cast["modeled_time_s"]) == (None, 0.0)
    assert main(["report", str(lowered), "--target", "h100"]) == 0
    table = capsys.readouterr().out
    assert "fused kernels: 13" in table
    assert re.search(r"^0\s+%q_proj\s+bf16\s+launch\s", table, re.MULTILINE)


def test_int8_plans_baseline_is_the_fp32_plan_priced_the_same_way():
    # Issue 13: the in-plan baseline priced quantize, dequantize and the detached bias add at
    # f32 as kernels of their own, so int8 read faster than a real fp32 plan it was slower than.
    fp32 = _lowered_cost(ROOT / "ir_examples/cnn.ir", "fp32", "cpu-avx512")
    module = parse_file(ROOT / "ir_examples/cnn.ir")
    calib = ROOT / "ir_examples/cnn_inputs.npz"
    PassManager(parse_pipeline(f"assign-precision{{policy=int8}},calibrate{{data={calib}}},"
                               "quantize,legalize{target=cpu-avx512},insert-casts,canonicalize")
                ).run(module, PassContext(runner=reference_runner))
    int8 = plan_cost(module.function(), load_target("cpu-avx512"))
    assert int8.fp32_time_s == pytest.approx(fp32.time_s, rel=1e-12)
    assert int8.time_s < fp32.time_s
    assert [g.compute for g in int8.groups if g.op == "mp.conv2d"] == ["f32", "i8"]


SHEET = """
[target]
bandwidth = 1e9
{extra}

[formats.f32]
dense = 1e9

[default]
dense = ["f32"]
"""


@pytest.mark.parametrize(("extra", "message", "col"), [
    ('fuse = ["cast", "epilog"]', "unknown fusion 'epilog'; did you mean 'epilogue'?", 17),
    ("tile_m = 128\ntile_n = 128", "'tile_m', 'tile_n' and 'sm_count' go together", 1),
    ("tile_m = 127.5\ntile_n = 128\nsm_count = 4", "'target.tile_m' must be an integer", 1),
    ("tile_m = 0\ntile_n = 128\nsm_count = 4",
     "'target.tile_m' must be between 1 and 1e+06, not 0", 1),
])
def test_bad_fusion_and_tiling_keys_are_located_errors(tmp_path, extra, message, col):
    path = tmp_path / "t.toml"
    path.write_text(SHEET.format(extra=extra).lstrip("\n"))
    with pytest.raises(DiagnosticError) as info:
        load_target(str(path))
    diag = info.value.diagnostics[0]
    assert (diag.message, diag.loc.line, diag.loc.col) == (message, 3, col)


def test_builtin_gpu_sheets_declare_fusions_tiles_and_sm_counts():
    for name, sms in (("h100", 132), ("h200", 132), ("a100", 108)):
        t = load_target(name)
        assert (t.tile_m, t.tile_n, t.sm_count) == (128, 128, sms)
        assert t.fuse == {"cast", "qdq", "elementwise", "epilogue", "slice-concat", "attention"}


# -- kernel classes and qdq-propagation --------------------------------------------------------
CLASS_SHEET = """
[target]
bandwidth = 1e12
overhead_s = 1e-6
fuse = [{fuse}]

[formats.f32]
dense = 1e12

[formats.i8]
dense = 4e12

[[kernels]]
ops = ["mp.conv2d"]
dense = ["f32", "i8"]

[default]
dense = ["f32"]
{rates}
"""
DEPTHWISE = """
func.func @main(%x: tensor<1x8x16x16xi8>) -> tensor<1x8x16x16xi32> {
  %w = mp.constant {value = dense<1> : tensor<8x1x3x3xi8>} : () -> tensor<8x1x3x3xi8>
  %y = mp.conv2d %x, %w {padding = [1, 1, 1, 1], groups = 8, mp.precision = i8, mp.accum = i32} : (tensor<1x8x16x16xi8>, tensor<8x1x3x3xi8>) -> tensor<1x8x16x16xi32>
  return %y : tensor<1x8x16x16xi32>
}"""
DW_FLOPS = 2 * 8 * 16 * 16 * 9  # 2 * N * Cout * H * W * (Cin / groups) * KH * KW


def _class_target(tmp_path, rates: str = "", fuse: str = ""):
    path = tmp_path / "t.toml"
    path.write_text(CLASS_SHEET.format(rates=rates, fuse=fuse).lstrip("\n"))
    return load_target(str(path))


def test_a_depthwise_conv_runs_at_its_kernel_class_rate_not_the_gemm_peak(tmp_path):
    f = parse(DEPTHWISE).function()
    (peak,) = fused_groups(f, _class_target(tmp_path))
    slow = _class_target(tmp_path, "[rates.conv_depthwise]\ni8 = 1e6\nf32 = 2e6")
    (group,) = fused_groups(f, slow)
    # Priced at the class rate: compute-bound at 4608 OP / 1e6 OP/s, plus the launch.
    assert (group.flops, group.bound) == (DW_FLOPS, "compute")
    assert group.time_s == pytest.approx(DW_FLOPS / 1e6 + 1e-6, rel=1e-12)
    assert peak.time_s < group.time_s  # the i8 GEMM peak would make it launch-bound
    # The fp32 baseline's depthwise conv runs at the f32 class rate.
    assert plan_cost(f, slow).fp32_time_s == pytest.approx(DW_FLOPS / 2e6 + 1e-6, rel=1e-12)
    assert plan_cost(f, slow).speedup_vs_fp32 == pytest.approx(
        (DW_FLOPS / 2e6 + 1e-6) / (DW_FLOPS / 1e6 + 1e-6), rel=1e-12)


POOL_THEN_QUANTIZE = """
func.func @main(%x: tensor<1x4x9x9xf32>) -> tensor<1x4x4x4xui8> {
  %r = mp.relu %x : (tensor<1x4x9x9xf32>) -> tensor<1x4x9x9xf32>
  %p = mp.max_pool2d %r {kernel = [3, 3], strides = [2, 2], padding = [0, 0, 0, 0]} : (tensor<1x4x9x9xf32>) -> tensor<1x4x4x4xf32>
  %q = mp.quantize %p {scale = 0.5 : f32, zero_point = 0 : i32} : (tensor<1x4x4x4xf32>) -> tensor<1x4x4x4xui8>
  return %q : tensor<1x4x4x4xui8>
}"""
POOL_FLOPS = 4 * 4 * 4 * 9  # one compare per window element


def test_qdq_propagation_moves_the_quantize_above_a_max_pool_which_runs_in_i8(tmp_path):
    from mplower.ir.printer import print_module

    module = parse(POOL_THEN_QUANTIZE)
    before = print_module(module)
    rates = "[rates.max_pool]\ni8 = 1e6"
    plain = {g.op: g for g in fused_groups(module.function(), _class_target(tmp_path, rates))}
    moved = {g.op: g for g in fused_groups(module.function(), _class_target(
        tmp_path, rates, '"qdq-propagation"'))}
    # Without the rule the pool computes in f32 at f32's peak; with it, in i8 at the class rate,
    # reading the quantize's u8 output (324 bytes) and writing u8 (64 bytes).
    assert plain["mp.max_pool2d"].compute == "f32"
    assert plain["mp.quantize"].members == ("%q",)
    pool = moved["mp.max_pool2d"]
    assert (pool.compute, pool.flops, pool.bytes_read, pool.bytes_written) == (
        "i8", POOL_FLOPS, 4 * 9 * 9, 4 * 4 * 4)
    assert pool.time_s == pytest.approx(POOL_FLOPS / 1e6 + 1e-6, rel=1e-12)
    # The quantize now reads the relu's f32 output and keeps its name in the report.
    assert (moved["mp.quantize"].members, moved["mp.quantize"].bytes_read) == (
        ("%q",), 4 * 4 * 9 * 9)
    assert print_module(module) == before  # pricing never changes the function


def test_qdq_propagation_leaves_a_pool_whose_operand_has_another_use(tmp_path):
    module = parse(POOL_THEN_QUANTIZE.replace(
        "-> tensor<1x4x4x4xui8> {", "-> (tensor<1x4x4x4xui8>, tensor<1x4x9x9xf32>) {").replace(
        "return %q : tensor<1x4x4x4xui8>",
        "return %q, %r : tensor<1x4x4x4xui8>, tensor<1x4x9x9xf32>"))
    groups = fused_groups(module.function(), _class_target(
        tmp_path, "[rates.max_pool]\ni8 = 1e6", '"qdq-propagation"'))
    assert [g.compute for g in groups if g.op == "mp.max_pool2d"] == ["f32"]


def test_slice_concat_fusion_makes_a_rotary_halves_swap_one_kernel():
    # q * cos + concat(-q[half:], q[:half]) * sin: XLA-style loop fusion takes the slices and
    # the concat with the elementwise ops around them (the `slice-concat` fusion).
    src = """func.func @main(%q: tensor<4x64xf32>, %c: tensor<4x64xf32>, %s: tensor<4x64xf32>) -> tensor<4x64xf32> {
  %lo = mp.slice %q {starts = [0, 0], ends = [4, 32]} : (tensor<4x64xf32>) -> tensor<4x32xf32>
  %hi = mp.slice %q {starts = [0, 32], ends = [4, 64]} : (tensor<4x64xf32>) -> tensor<4x32xf32>
  %n = mp.neg %hi : (tensor<4x32xf32>) -> tensor<4x32xf32>
  %r = mp.concat %n, %lo {axis = 1} : (tensor<4x32xf32>, tensor<4x32xf32>) -> tensor<4x64xf32>
  %a = mp.mul %q, %c : (tensor<4x64xf32>, tensor<4x64xf32>) -> tensor<4x64xf32>
  %b = mp.mul %r, %s : (tensor<4x64xf32>, tensor<4x64xf32>) -> tensor<4x64xf32>
  %y = mp.add %a, %b : (tensor<4x64xf32>, tensor<4x64xf32>) -> tensor<4x64xf32>
  return %y : tensor<4x64xf32>
}"""
    f = parse(src).functions["main"]
    fused = fused_groups(f, load_target("h200"))
    plain = fused_groups(f, load_target("generic"))
    assert len(fused) == 1 and len(fused[0].members) == 7
    # Without the fusion each slice and the concat anchors a kernel of its own.
    assert len(plain) == 3
    assert sum(g.bytes_read for g in fused) == 3 * 4 * 64 * 4


def test_decode_attention_with_one_query_row_is_priced_by_the_cache_it_reads():
    # Q K^T of a decode step: one query row per (sequence, head) against 2048 cached keys.
    # Padded to 128-row tiles it would be compute-bound at 1/128 of the peak; decode kernels
    # run it at the memory roofline (measured on an H200: benchmarks/gpu_check.py).
    src = """func.func @main(%q: tensor<512x1x128xbf16>, %k: tensor<512x128x2048xbf16>) -> tensor<512x1x2048xbf16> {
  %s = mp.matmul %q, %k {mp.precision = bf16, mp.accum = f32} : (tensor<512x1x128xbf16>, tensor<512x128x2048xbf16>) -> tensor<512x1x2048xbf16>
  return %s : tensor<512x1x2048xbf16>
}"""
    t = load_target("h200")
    (g,) = fused_groups(parse(src).functions["main"], t)
    nbytes = 2 * (512 * 128 + 512 * 128 * 2048 + 512 * 2048)
    assert g.bound == "memory"
    assert g.time_s == pytest.approx(nbytes / t.bandwidth + t.overhead_s)


def test_gemm_fraction_prices_a_compute_bound_matmul_at_the_sustained_share_of_peak(tmp_path):
    src = """func.func @main(%a: tensor<64x64xf32>, %b: tensor<64x64xf32>) -> tensor<64x64xf32> {
  %y = mp.matmul %a, %b : (tensor<64x64xf32>, tensor<64x64xf32>) -> tensor<64x64xf32>
  return %y : tensor<64x64xf32>
}"""
    f = parse(src).function()
    flops = 2 * 64 ** 3
    # A slow peak makes the product compute-bound: priced at peak x fraction, plus the launch.
    path = tmp_path / "t.toml"
    path.write_text(CLASS_SHEET.format(rates="", fuse="").replace(
        "[formats.f32]\ndense = 1e12", "[formats.f32]\ndense = 1e9\ngemm_fraction = 0.25"))
    (g,) = fused_groups(f, load_target(str(path)))
    assert g.bound == "compute"
    assert g.time_s == pytest.approx(flops / (1e9 * 0.25) + 1e-6, rel=1e-12)
    # A share outside (0.01, 1] is a located error in the sheet.
    path.write_text(path.read_text().replace("gemm_fraction = 0.25", "gemm_fraction = 1.5"))
    with pytest.raises(DiagnosticError, match=r"f32\.gemm_fraction. must be between 0\.01"):
        load_target(str(path))


def test_attention_fusion_moves_only_q_k_v_and_the_output():
    # softmax(Q K^T * s) V in bf16 over 8 heads of 256 positions: with `attention` the scores
    # (8 x 256 x 256) never leave the kernel; a product by a weight after a softmax is no
    # attention and stays a kernel of its own.
    src = """func.func @main(%q: tensor<8x256x64xbf16>, %kt: tensor<8x64x256xbf16>, %v: tensor<8x256x64xbf16>) -> tensor<8x256x64xbf16> {
  %s = mp.matmul %q, %kt {mp.precision = bf16, mp.accum = f32} : (tensor<8x256x64xbf16>, tensor<8x64x256xbf16>) -> tensor<8x256x256xbf16>
  %c = mp.constant {value = dense<0.125> : tensor<bf16>} : () -> tensor<bf16>
  %t = mp.mul %s, %c {mp.precision = bf16} : (tensor<8x256x256xbf16>, tensor<bf16>) -> tensor<8x256x256xbf16>
  %p = mp.softmax %t {axis = -1, mp.precision = bf16} : (tensor<8x256x256xbf16>) -> tensor<8x256x256xbf16>
  %o = mp.matmul %p, %v {mp.precision = bf16, mp.accum = f32} : (tensor<8x256x256xbf16>, tensor<8x256x64xbf16>) -> tensor<8x256x64xbf16>
  return %o : tensor<8x256x64xbf16>
}"""
    f = parse(src).function()
    (g,) = fused_groups(f, load_target("h200"))
    assert g.members == ("%s", "%t", "%p", "%o")
    assert g.bytes_read == 3 * 8 * 256 * 64 * 2 + 2 and g.bytes_written == 8 * 256 * 64 * 2
    unfused = fused_groups(f, load_target("generic"))
    assert len(unfused) == 3  # QK^T with its scale, the softmax, the product by V
    weight = src.replace(", %v: tensor<8x256x64xbf16>) ->", ") ->").replace(
        "  %o = mp.matmul %p, %v", "  %v = mp.constant {value = dense<1.0> : tensor<8x256x64xbf16>}"
        " : () -> tensor<8x256x64xbf16>\n  %o = mp.matmul %p, %v")
    groups = fused_groups(parse(weight).function(), load_target("h200"))
    assert [g.members for g in groups] == [("%s", "%t", "%p"), ("%o",)]
