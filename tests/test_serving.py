"""Prefill and decode priced apart (mplower.lowering.serving, `mplower report --phase`), the
shapes-only import of a checkpoint, and the cost model's weight bytes with their scales."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from test_hf_import import LLAMA, llama_tensors, write_checkpoint

from mplower.backend.executor import Program
from mplower.hf.blocks import weight_matmuls
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.parser import parse_file
from mplower.ir.types import tensor
from mplower.ir.verifier import verify
from mplower.lowering import serving
from mplower.lowering.cost import plan_cost
from mplower.lowering.target import load_target
from mplower.pass_manager import PassContext, PassManager, parse_pipeline

H100 = load_target("h100")
# Wide enough that a decode step's GEMMs leave the launch floor on an H100, small enough to
# import (shapes only) and quantize in well under a second.
MID = {"architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "intermediate_size": 4096,
       "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
       "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 4096,
       "max_position_embeddings": 8192, "tie_word_embeddings": False}
# A serving sheet: contractions in bf16, the KV cache (what mp.concat appends to) stored in
# bf16, the signature free to narrow so that the cache arguments are bf16 too.
BF16 = """[policy]
compute = "bf16"
allow = ["@contraction"]
follow = ["@data-movement", "@value-preserving", "@activation", "mp.add", "mp.mul",
          "mp.sigmoid"]
deny = ["mp.softmax", "mp.rms_norm"]
keep_io_types = false
[[override]]
op = "mp.concat"
compute = "bf16"
"""


def fp8_linears(path: Path) -> str:
    """BF16 with the matmuls by a weight (the Linear layers) in f8E4M3FN, as ModelOpt's FP8
    recipe quantizes them; attention's products read the bf16 cache in bf16."""
    f = parse_file(path).functions["decode"]
    names = [f.op_name(n) for n, _ in weight_matmuls(f)]
    assert names
    return BF16 + "".join(f'[[override]]\nname = "{n}"\ncompute = "f8E4M3FN"\n' for n in names)


def shapes_only(cli, tmp_path: Path, cfg: dict, *flags: object) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "m.ir"
    r = cli("import", folder, "-o", out, "--shapes-only", *flags)
    assert r.rc == 0, r.err
    return out


def lowered(path: Path, tmp_path: Path, sheet: str, extra: str = ""):
    (tmp_path / "sheet.toml").write_text(sheet)
    module = parse_file(path)
    pipeline = f"assign-precision{{policy={tmp_path / 'sheet.toml'}}}{extra},insert-casts"
    PassManager(parse_pipeline(pipeline)).run(module, PassContext())
    return module


def test_shapes_only_import_reads_config_json_alone(cli, tmp_path):
    out = shapes_only(cli, tmp_path, MID, "--seq", 16, "--context", 64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "m.ir"]  # no .npz
    module = parse_file(out)
    decode = module.functions["decode"]
    assert serving.written_for(decode, "decode") == (1, 64)
    assert len(serving.cache_args(decode)) == 2 * MID["num_hidden_layers"]
    # Without the flag, the missing weights are still a located error.
    r = cli("import", tmp_path / "ckpt", "-o", tmp_path / "w.ir")
    assert r.rc == 1 and "ckpt: error: no *.safetensors file" in r.err
    assert not (tmp_path / "w.ir").exists()


def test_kv_cache_bytes_per_token_follow_the_cache_element_type(cli, tmp_path):
    path = shapes_only(cli, tmp_path, MID)
    layers, kv_heads, head_dim = 2, 2, 1024 // 8
    f32 = serving.kv_bytes_per_token(parse_file(path).functions["decode"])
    assert f32 == 2 * layers * kv_heads * head_dim * 4
    decode = lowered(path, tmp_path, BF16).functions["decode"]
    assert serving.kv_bytes_per_token(decode) == 2 * layers * kv_heads * head_dim * 2
    # A pass that stores the cache in one byte (as quantize-kv does) halves it again, with a
    # per-position scale beside each cache tensor counted too.
    for a in serving.cache_args(decode):
        t = decode.type_of((a, 0))
        decode.set_result_type(a, 0, t.with_elem("f8E4M3FN"))
    assert serving.kv_bytes_per_token(decode) == 2 * layers * kv_heads * head_dim
    context = serving.written_for(decode, "decode")[1]
    scale = decode.add_arg("past_scale", tensor((1, kv_heads, context, 1), "f32"), decode.loc)
    assert scale in serving.cache_args(decode)
    assert serving.kv_bytes_per_token(decode) == 2 * layers * kv_heads * head_dim + kv_heads * 4


def test_w4a16_weight_is_half_a_byte_an_element_plus_its_group_scales(tmp_path):
    k, n, g = 512, 256, 128
    np.savez(tmp_path / "w.npz", w=np.random.default_rng(0).standard_normal((k, n)))
    (tmp_path / "m.ir").write_text(f"""module attributes {{mp.weights = "w.npz"}} {{
func.func @main(%x: tensor<1x{k}xf32>) -> tensor<1x{n}xf32> {{
  %w = mp.constant {{name = "w"}} : () -> tensor<{k}x{n}xf32>
  %y = mp.matmul %x, %w : (tensor<1x{k}xf32>, tensor<{k}x{n}xf32>) -> tensor<1x{n}xf32>
  return %y : tensor<1x{n}xf32>
}}
}}
""")
    module = parse_file(tmp_path / "m.ir")
    PassManager(parse_pipeline(f"assign-precision{{policy=w8a16}},"
                               f"quantize{{scheme=w4a16 group={g}}},insert-casts")).run(
        module, PassContext())
    (group,) = plan_cost(module.function(), H100).groups
    assert group.weight_bytes == k * n // 2 + (k // g) * n * 4  # i4 values, f32 scales
    # and the f32 argument row (its cast to bf16 is the kernel's load)
    assert group.bytes_read == group.weight_bytes + k * 4


def test_a_weight_only_gemm_runs_at_the_sheets_weight_only_share_when_compute_bound(tmp_path):
    # 4096 rows against a w4a16 weight: compute-bound on an H100, where the runtime's
    # mixed-input GEMM dequantizes in its main loop (`weight_only_fraction`, 0.55 in h100.toml);
    # a bf16 weight of the same product is not a weight-only GEMM and keeps the plain rate.
    m, k, n = 4096, 4096, 4096
    np.savez(tmp_path / "w.npz", w=np.random.default_rng(0).standard_normal((k, n)))
    (tmp_path / "m.ir").write_text(f"""module attributes {{mp.weights = "w.npz"}} {{
func.func @main(%x: tensor<{m}x{k}xf32>) -> tensor<{m}x{n}xf32> {{
  %w = mp.constant {{name = "w"}} : () -> tensor<{k}x{n}xf32>
  %y = mp.matmul %x, %w : (tensor<{m}x{k}xf32>, tensor<{k}x{n}xf32>) -> tensor<{m}x{n}xf32>
  return %y : tensor<{m}x{n}xf32>
}}
}}
""")
    plain = tmp_path / "plain.toml"
    plain.write_text((Path(__file__).parents[1] / "mplower/targets/h100.toml").read_text()
                     .replace("weight_only_fraction = 0.55\n", ""))
    assert H100.weight_only_fraction("bf16") == 0.55
    assert load_target(str(plain)).weight_only_fraction("bf16") == 1.0
    times = {}
    for scheme in ("", ",quantize{scheme=w4a16 group=128}"):
        module = parse_file(tmp_path / "m.ir")
        PassManager(parse_pipeline(f"assign-precision{{policy=w8a16}}{scheme},insert-casts")).run(
            module, PassContext())
        for name, t in (("h100", H100), ("plain", load_target(str(plain)))):
            (g,) = plan_cost(module.function(), t).groups
            assert g.bound == "compute"
            times[scheme, name] = g.time_s - t.overhead_s
    w4 = ",quantize{scheme=w4a16 group=128}"
    assert times[w4, "h100"] == pytest.approx(times[w4, "plain"] / 0.55, rel=1e-12)
    assert times["", "h100"] == times["", "plain"]
    assert times[w4, "plain"] == pytest.approx(times["", "plain"], rel=1e-12)
    # A share outside (0.01, 1] is an error located at its line of the sheet.
    lines = (Path(__file__).parents[1] / "mplower/targets/h100.toml").read_text().splitlines()
    line = lines.index("weight_only_fraction = 0.55") + 1
    bad = tmp_path / "bad.toml"
    bad.write_text("\n".join(lines).replace("weight_only_fraction = 0.55",
                                            "weight_only_fraction = 0", 1))
    with pytest.raises(DiagnosticError) as e:
        load_target(str(bad))
    d = e.value.diagnostics[0]
    assert d.loc.line == line and "weight_only_fraction' must be between 0.01" in d.message


def test_decode_reshaped_to_a_new_batch_and_context_computes_the_same_rows(cli, tmp_path):
    folder = tmp_path / "tiny"
    write_checkpoint(folder, LLAMA, llama_tensors(LLAMA, np.random.default_rng(0), np.float32))
    out = tmp_path / "m.ir"
    assert cli("import", folder, "-o", out, "--seq", 4, "--context", 5).rc == 0
    module = parse_file(out)
    f = module.functions["decode"]
    g = serving.retyped(f, 3, 5)
    assert g.type_of((g.args[1], 0)).shape[0] == 3 and g.result_types[0].shape[0] == 3
    wide = copy.copy(module)
    wide.functions = {"decode": g}
    verify(wide)
    rng = np.random.default_rng(1)
    inputs = [rng.integers(0, LLAMA["vocab_size"], (1, 1)).astype(np.int64)] + [
        rng.standard_normal(f.type_of((a, 0)).shape).astype(np.float32) for a in f.args[1:]]
    one = Program(module, "decode").run(inputs, reference=False).outputs
    three = Program(wide, "decode").run([np.repeat(x, 3, axis=0) for x in inputs],
                                        reference=False).outputs
    for a, b in zip(one, three, strict=True):
        np.testing.assert_array_equal(np.repeat(a, 3, axis=0), b)
    longer = serving.retyped(f, 2, 11)
    assert longer.result_types[1].shape == (2, LLAMA["num_key_value_heads"], 12,
                                            LLAMA["hidden_size"] // LLAMA["num_attention_heads"])


def test_decode_is_memory_bound_at_batch_1_and_attention_grows_with_context(cli, tmp_path):
    wide = MID | {"hidden_size": 2048, "intermediate_size": 8192, "vocab_size": 32000}
    module = lowered(shapes_only(cli, tmp_path, wide), tmp_path, BF16)
    step = serving.price(module, "decode", H100, 1, 1024)
    # The GEMMs with a weight (the scale constant of attention's scores is 4 bytes).
    gemms = [g for g in step.cost.groups if g.op == "mp.matmul" and g.weight_bytes > 4]
    assert len(gemms) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    assert sum(g.weight_bytes for g in gemms) == 2 * (
        2 * 2048 * 2048 * 2 + 2 * 2048 * 512 * 2 + 3 * 2048 * 8192 * 2) + 2048 * 32000 * 2
    # Batch 1 reads weights: no GEMM is compute-bound, and those of 32 MB or more (the MLP's
    # and the head) wait on memory rather than on their launch.
    assert not any(g.bound == "compute" for g in gemms)
    assert all(g.bound == "memory" for g in gemms if g.weight_bytes >= 2**25)
    assert sum(g.weight_bytes >= 2**25 for g in gemms) == 2 * 3 + 1
    big = serving.price(module, "decode", H100, 512, 1024)
    assert any(g.bound == "compute" for g in big.cost.groups if g.weight_bytes)
    longer = serving.price(module, "decode", H100, 1, 8000)
    assert longer.time_s > step.time_s
    # The cache is read where attention reads it and appended in place: a step reads each
    # cached position's keys and values once.
    cache = sum(g.bytes_read - g.weight_bytes for g in longer.cost.groups
                if g.op == "mp.matmul" and g.weight_bytes <= 4)
    per_token = serving.kv_bytes_per_token(module.functions["decode"])
    assert per_token * 8001 <= cache < per_token * 8001 * 1.01


def test_w4a16_wins_at_batch_1_and_fp8_at_a_large_batch(cli, tmp_path):
    path = shapes_only(cli, tmp_path, MID)
    plans = {"bf16": lowered(path, tmp_path, BF16), "fp8": lowered(path, tmp_path, fp8_linears(path)),
             "w4a16": lowered(path, tmp_path, BF16, ",quantize{scheme=w4a16 group=128}")}

    def itl(name: str, batch: int) -> float:
        return serving.price(plans[name], "decode", H100, batch, 1024).time_s

    speedup = {b: {p: itl("bf16", b) / itl(p, b) for p in ("fp8", "w4a16")} for b in (1, 512)}
    # Batch 1 reads weights: four bits beat eight. At 512 the GEMMs are compute-bound: w4a16
    # computes in bf16, fp8 at twice its rate.
    assert speedup[1]["w4a16"] > speedup[1]["fp8"] > 1
    assert speedup[512]["fp8"] > speedup[512]["w4a16"]
    assert speedup[1]["w4a16"] > speedup[512]["w4a16"]


def test_report_phase_json_summary(cli, tmp_path):
    path = shapes_only(cli, tmp_path, MID, "--seq", 32, "--context", 64)
    r = cli("report", path, "--target", "h100", "--phase", "decode", "--batch", 4,
            "--context", 256, "--format", "json")
    assert r.rc == 0, r.err
    s = json.loads(r.out)["summary"]
    assert (s["phase"], s["batch"], s["context"], s["prompt"]) == ("decode", 4, 256, 32)
    assert s["tokens_per_s"] == pytest.approx(4 / s["itl_s"])
    assert s["kv_cache_bytes_per_token"] == 2 * 2 * 2 * 128 * 4
    assert s["kv_cache_bytes"] == s["kv_cache_bytes_per_token"] * 4 * 256
    assert s["ttft_s"] > s["itl_s"] > 0 and s["weight_bytes"] > 0
    groups = json.loads(r.out)["groups"]
    assert {g["bound"] for g in groups} <= {"memory", "compute", "launch"}
    # End to end: TTFT, then decode steps at contexts 32 .. 32 + 5 - 2.
    r = cli("report", path, "--target", "h100", "--phase", "prefill", "--prompt", 32,
            "--generate", 5, "--format", "json")
    s = json.loads(r.out)["summary"]
    module = parse_file(path)
    steps = [serving.price(module, "decode", H100, 1, c).time_s for c in range(32, 36)]
    assert s["e2e_s"] == pytest.approx(s["ttft_s"] + sum(steps))
    assert s["tokens_per_s"] == pytest.approx(5 / s["e2e_s"])
    r = cli("report", path, "--phase", "decode", "--batch", 2)
    assert r.rc == 0 and "decode at batch 2, context 64:" in r.out


def test_report_phase_refusals(cli, tmp_path):
    path = shapes_only(cli, tmp_path, MID, "--seq", 32)
    r = cli("report", path, "--batch", 2)
    assert r.rc == 2 and "--batch sets a serving point: it needs --phase" in r.err
    r = cli("report", path, "--phase", "prefill", "--prompt", 64, "--generate", 4)
    assert r.rc == 1 and "import the checkpoint with --seq 64" in r.err
