"""A checkpoint run block by block (mplower.hf.blocks) gives the bits of the whole-model path:
the same calibrated ranges, the same quantized weights, the same logits; and weights are read
from the mapped checkpoint only when their block runs."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mplower.backend.executor import Program
from mplower.hf import import_checkpoint
from mplower.hf.blocks import Blocks, run_blocks, weight_matmuls
from mplower.ir.diagnostics import DiagnosticError
from mplower.lowering.calibration import RANGE
from mplower.pass_manager import PassContext, parse_pipeline
from mplower.passes.calibrate import Calibrate
from mplower.passes.insert_casts import materialize
from mplower.passes.quantize import DATA_METHODS, Quantize

CFG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 96,
       "max_position_embeddings": 64, "tie_word_embeddings": False}
B, S = 3, 8


def write_checkpoint(folder: Path, dtype=np.float16) -> dict[str, np.ndarray]:
    """docs/hf.md's walk-through: the safetensors layout written with numpy alone."""
    h, i_, v, nkv, d = 32, 64, 96, 2, 8
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    for L in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{L}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h),
                   p + "self_attn.k_proj.weight": (nkv * d, h),
                   p + "self_attn.v_proj.weight": (nkv * d, h),
                   p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (i_, h),
                   p + "mlp.up_proj.weight": (i_, h), p + "mlp.down_proj.weight": (h, i_)}
    tag = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32",
           np.dtype(ml_dtypes.bfloat16): "BF16"}[np.dtype(dtype)]
    rng = np.random.default_rng(0)
    tensors, header, data = {}, {}, b""
    for name, shape in shapes.items():
        a = (rng.standard_normal(shape) * (0.3 if len(shape) == 2 else 0.1) + (len(shape) == 1))
        tensors[name] = a.astype(dtype)
        raw = tensors[name].tobytes()
        header[name] = {"dtype": tag, "shape": list(shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CFG))
    (folder / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + data)
    return tensors


@pytest.fixture
def ckpt(tmp_path):
    folder = tmp_path / "tiny"
    write_checkpoint(folder)
    ids = np.random.default_rng(1).integers(0, CFG["vocab_size"], (B, S)).astype(np.int64)
    return folder, ids


def whole(folder: Path, ids: np.ndarray, pipeline: str, tmp_path: Path):
    """The whole-model path: import, the pipeline on @prefill, run it beside the reference."""
    imp = import_checkpoint(folder, B, S, S)
    module, weights = imp.module, dict(imp.weights)
    del module.functions["decode"]  # the blocks are the prefill's
    np.savez(tmp_path / "calib.npz", input_ids=ids)
    ctx = PassContext(weights_path=weights, runner=_runner())
    for p in parse_pipeline(pipeline) if pipeline else []:
        if isinstance(p, Calibrate):
            p.data, p.func = str(tmp_path / "calib.npz"), "prefill"
        if isinstance(p, Quantize) and p.method in DATA_METHODS:  # the only function left
            p.data = str(tmp_path / "calib.npz")
        p.run(module, ctx)
    materialize(module)
    return module, Program(module, "prefill", weights).run([ids])


def _runner():
    from mplower.backend.executor import reference_runner
    return reference_runner


def streamed(folder: Path, ids: np.ndarray, pipeline: str, seen: list | None = None):
    blocks = Blocks(folder, B, S)
    keep = (lambda block, run: seen.append(block.module)) if seen is not None else None
    return run_blocks(blocks, ids, parse_pipeline(pipeline) if pipeline else [], on_block=keep)


@pytest.mark.parametrize("pipeline", ["", "quantize{scheme=w4a16 group=16}",
                                      "quantize{scheme=w8a16 group=0}",
                                      "quantize{scheme=w4a16 group=16 method=gptq}",
                                      "quantize{scheme=w4a16 group=16 method=awq}"])
def test_block_by_block_logits_are_the_whole_models_bits(ckpt, tmp_path, pipeline):
    folder, ids = ckpt
    _, res = whole(folder, ids, pipeline, tmp_path)
    got = streamed(folder, ids, pipeline)
    assert np.array_equal(got.logits, res.outputs[0])
    if "method=" not in pipeline:  # gptq / awq store codes: the whole model's reference
        # dequantizes them, the blocks' carries the unquantized model (docs/big-models.md)
        assert np.array_equal(got.reference, res.reference[0])
    if pipeline:  # quantizing changed something, and the blocks saw it
        assert not np.array_equal(got.logits, got.reference)
        rows = got.run_result().ops
        assert sum(r.step.op == "mp.dequantize" for r in rows) == 2 * 7 + 1


def _ranges(f, ops) -> list:
    return [(f.op(n), f.attrs_of(n).get(RANGE)) for n in ops
            if f.op(n) not in ("mp.constant", "return") and RANGE in f.attrs_of(n)]


def test_block_by_block_calibration_records_the_whole_models_ranges(ckpt, tmp_path):
    folder, ids = ckpt
    module, _ = whole(folder, ids, "calibrate", tmp_path)
    seen: list = []
    streamed(folder, ids, "calibrate", seen)
    f = module.function("prefill")
    want = _ranges(f, f.ops())
    got = [r for m in seen for r in _ranges(m.function("main"), m.function("main").ops())]
    assert len(got) == len(want) > 20
    assert got == want


def test_w8a8_from_block_calibration_gives_the_whole_models_logits(ckpt, tmp_path):
    folder, ids = ckpt
    pipeline = "calibrate,quantize{scheme=w8a8}"
    _, res = whole(folder, ids, pipeline, tmp_path)
    got = streamed(folder, ids, pipeline)
    assert np.array_equal(got.logits, res.outputs[0])


def test_quantizer_sees_each_weight_with_its_matmuls_reference_inputs(ckpt, tmp_path):
    folder, ids = ckpt
    module, res = whole(folder, ids, "", tmp_path)
    f = module.function("prefill")
    # The reference value of each weight matmul's activation, from the whole model's run.
    program = Program(module, "prefill", dict(import_checkpoint(folder, B, S, S).weights))
    refs = program.run_reference([ids])
    want = {key: refs[program.slots[f.operands(n)[0]]].reshape(-1, f.type_of(
        f.operands(n)[0]).shape[-1]) for n, key in weight_matmuls(f)}
    seen = {}

    def rtn(key, w, x):  # round-to-nearest, per output column, 4 bits
        seen[key] = (w.copy(), x.copy())
        scale = np.abs(w).max(axis=0) / 7
        return np.clip(np.rint(w / scale), -8, 7) * scale

    out = run_blocks(Blocks(folder, B, S), ids, quantizer=rtn)
    assert sorted(seen) == sorted(want) and len(seen) == 2 * 7 + 1
    for key, (w, x) in seen.items():
        assert np.array_equal(x, want[key]), key
    weights = dict(import_checkpoint(folder, B, S, S).weights)
    assert np.array_equal(seen["lm_head.weight"][0], weights["lm_head.weight"])
    # The plan computed with the returned weights: the whole model given them agrees.
    replaced = {k: (rtn(k, *seen[k]) if k in seen else v) for k, v in weights.items()}
    again = Program(module, "prefill", replaced).run([ids], reference=False)
    assert np.array_equal(out.logits, again.outputs[0])
    assert np.array_equal(out.reference, res.reference[0])


def test_a_block_reads_only_its_own_weights_and_they_stay_mapped(ckpt):
    folder, ids = ckpt
    blocks = Blocks(folder, B, S)
    read = []
    out = run_blocks(blocks, ids, on_block=lambda block, run: read.append(run.weights))
    assert read[0] == ["model.embed_tokens.weight"]
    assert all(k.startswith("model.layers.0.") for k in read[1] if k.startswith("model."))
    assert read[-1] == ["model.norm.weight", "lm_head.weight"]
    assert out.logits.shape == (B, S, CFG["vocab_size"])


def test_f32_checkpoint_tensors_reach_their_block_as_maps_of_the_file(tmp_path):
    write_checkpoint(tmp_path / "f32", np.float32)
    embed = Blocks(tmp_path / "f32", B, S).block(0)
    table = embed.weights["model.embed_tokens.weight"]
    assert is_mapped(table) and not table.flags.writeable


def test_gpt2_and_a_wrong_batch_are_refused(ckpt, tmp_path):
    folder, ids = ckpt
    with pytest.raises(DiagnosticError, match=r"input_ids have shape \[2, 8\]"):
        run_blocks(Blocks(folder, B, S), ids[:2])
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DiagnosticError, match="GPT-2 is imported whole"):
        Blocks(folder, B, S)


def test_quantize_ckpt_reports_every_blocks_ops_and_the_logits_drift(ckpt, tmp_path, cli):
    folder, ids = ckpt
    np.savez(tmp_path / "calib.npz", input_ids=ids)
    report = tmp_path / "r.json"
    r = cli("quantize-ckpt", folder, "--data", tmp_path / "calib.npz",
            "--pass-pipeline=quantize{scheme=w4a16 group=16}", "--report", report)
    assert r.rc == 0, r.err
    rep = json.loads(report.read_text())
    _, res = whole(folder, ids, "quantize{scheme=w4a16 group=16}", tmp_path)
    want = [o for o in res.ops if o.step.op != "mp.constant"]
    rows = [o for o in rep["ops"] if o["op"] != "mp.constant"]
    assert [o["op"] for o in rows] == [o.step.op for o in want]
    assert [o["rel_l2"] for o in rows] == pytest.approx([o.rel_l2 for o in want], abs=0)
    assert rows[-1]["name"].startswith("head/")
    assert rep["summary"]["output_rel_l2"] > 0.01
    r = cli("quantize-ckpt", folder, "--data", tmp_path / "calib.npz", "-p", "calibrate",
            "--no-eval")
    assert r.rc == 0 and r.out == "4 blocks, 0 weights quantized\n"


def test_quantize_ckpt_refuses_bad_data_with_a_located_message(ckpt, tmp_path, cli):
    folder, ids = ckpt
    np.savez(tmp_path / "bad.npz", input_ids=ids + 1000)
    r = cli("quantize-ckpt", folder, "--data", tmp_path / "bad.npz")
    assert r.rc == 1 and "bad.npz" in r.err and "outside the vocabulary [0, 96)" in r.err
    np.savez(tmp_path / "x.npz", x=ids)
    r = cli("quantize-ckpt", folder, "--data", tmp_path / "x.npz")
    assert r.rc == 1 and "needs 'input_ids'" in r.err and "Traceback" not in r.err
    r = cli("quantize-ckpt", folder, "--data", tmp_path / "x.npz", "-p", "quantise")
    assert r.rc == 2 and "did you mean 'quantize'" in r.err


def is_mapped(a) -> bool:
    """Whether the array's memory is a map of a file (through any chain of views)."""
    import mmap

    while a is not None:
        if isinstance(a, np.memmap | mmap.mmap):
            return True
        a = a.obj if isinstance(a, memoryview) else getattr(a, "base", None)
    return False


def test_uncompressed_npz_weights_stay_mapped_until_an_op_reads_them(tmp_path):
    from mplower.io.npz import write_npz
    from mplower.ir.diagnostics import Location
    from mplower.ir.parser import parse

    w = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
    write_npz(tmp_path / "m.npz", {"w": w, "b": np.ones(128, np.float32)},
              Location("m.npz", 0, 0))
    (tmp_path / "m.ir").write_text(
        'module attributes {mp.weights = "m.npz"} {\n'
        "  func.func @main(%x: tensor<4x256xf32>) -> tensor<4x128xf32> {\n"
        '    %w = mp.constant {name = "w"} : () -> tensor<256x128xf32>\n'
        "    %y = mp.matmul %x, %w : (tensor<4x256xf32>, tensor<256x128xf32>) -> "
        "tensor<4x128xf32>\n    return %y : tensor<4x128xf32>\n  }\n}\n")
    module = parse((tmp_path / "m.ir").read_text(), str(tmp_path / "m.ir"))
    program = Program(module)
    const = program.steps[0].constant
    # The compiled constant is the file's pages, not a copy: nothing is read before the run.
    assert is_mapped(const)
    assert not const.flags.writeable and np.array_equal(const, w)
    x = np.ones((4, 256), np.float32)
    assert np.array_equal(program.run([x]).outputs[0],
                          Program(module, weights={"w": w}).run([x]).outputs[0])


def test_the_result_keeps_figures_but_no_blocks_weights(ckpt):
    import gc
    import weakref

    folder, ids = ckpt
    refs = []

    def watch(block, run):
        refs.extend(weakref.ref(block.weights[k]) for k in run.weights)

    out = run_blocks(Blocks(folder, B, S), ids, parse_pipeline("quantize{scheme=w4a16 "
                                                               "group=16}"), on_block=watch)
    gc.collect()
    assert len(refs) == 1 + 2 * (9 + 3) + 2  # a layer also reads rotary cos, sin and mask
    assert [r for r in refs if r() is not None] == []  # every weight freed with its block
    assert all(r.rel_l2 is not None for r in out.run_result().ops if r.step.op == "mp.matmul")


def test_released_checkpoint_pages_read_back_the_same_data(tmp_path):
    tensors = write_checkpoint(tmp_path / "f32", np.float32)
    blocks = Blocks(tmp_path / "f32", B, S)
    key = "model.layers.1.mlp.down_proj.weight"
    before = np.array(blocks.ckpt.float32(key))
    blocks.ckpt.release()  # the pages go; the map and its views stay valid
    assert np.array_equal(blocks.ckpt.float32(key), before)
    assert np.array_equal(before, tensors[key])


def test_the_result_keeps_no_quantized_codes_of_a_dropped_block(ckpt):
    # A GPTQ weight is an integer constant in its block's module; the steps the result keeps
    # held it in their attributes, ~90 MB a block on TinyLlama's shape, until the run ended.
    from mplower.ir.types import DenseAttr

    folder, ids = ckpt
    out = run_blocks(Blocks(folder, B, S), ids, parse_pipeline(
        "quantize{scheme=w4a16 group=16 method=gptq}"))
    steps = [r.step for r in out.run_result().ops]
    assert any(s.op == "mp.constant" for s in steps)
    assert [s.name for s in steps if any(isinstance(v, (DenseAttr, np.ndarray))
                                         for v in s.attrs.values())] == []
    assert all(r.rel_l2 is not None for r in out.run_result().ops if r.step.op == "mp.matmul")
