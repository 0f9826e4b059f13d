"""Weight-only matmuls exported as onnxruntime's com.microsoft.MatMulNBits (`mplower export
--weight-only=matmulnbits`, the default): onnxruntime's CPU provider runs the exported model and
its outputs equal mplower's executor on the lowered module to 1e-5 (float sums in another order).
The packed layout is checked independently: B and the zero points are unpacked here with
numpy from the operator's documented layout (onnxruntime docs/ContribOperators.md,
com.microsoft.MatMulNBits) and compared with the codes of the module.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from mplower.backend.executor import Program
from mplower.ir.diagnostics import Location
from mplower.ir.parser import parse, parse_file
from mplower.onnx.exporter import check_and_serialize, export_module
from mplower.pass_manager import PassContext, PassManager, parse_pipeline

ort = pytest.importorskip("onnxruntime")
EXAMPLES = Path(__file__).resolve().parent.parent / "ir_examples"
_rng = np.random.default_rng(0)


def lowered(path: Path, pipeline: str):
    module = parse_file(path)
    PassManager(parse_pipeline(pipeline)).run(module, PassContext())
    return module


def ort_outputs(model: onnx.ModelProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
    data = check_and_serialize(model, Location("m.onnx", 0, 0))
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: x for i, x in zip(session.get_inputs(), inputs)})


def assert_matches(module, inputs: list[np.ndarray], func: str | None = None, **kw):
    ours = Program(module, func).run(inputs, reference=False).outputs
    exported = export_module(module, func, **kw)
    theirs = ort_outputs(exported.model, inputs)
    for a, b in zip(ours, theirs):
        a = np.asarray(a, np.float32)
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))
    return exported


def nbits_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "MatMulNBits"]


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' bytes -> codes, the first in the lowest bits."""
    per = 8 // bits
    vals = [(packed >> (bits * i)) & ((1 << bits) - 1) for i in range(per)]
    return np.stack(vals, axis=-1).reshape(*packed.shape[:-1], -1)


@pytest.mark.parametrize("scheme,bits", [("w4a16", 4), ("w8a16", 8)])
@pytest.mark.parametrize("group", [32, 128])
def test_mlp_weight_only_runs_in_onnxruntime_as_matmulnbits(scheme, bits, group):
    module = lowered(EXAMPLES / "mlp.ir", f"quantize{{scheme={scheme} group={group}}}")
    x = np.load(EXAMPLES / "mlp_inputs.npz")["x"]
    exported = assert_matches(module, [x])
    ops = [n.op_type for n in exported.model.graph.node]
    assert "DequantizeLinear" not in ops and "QuantizeLinear" not in ops
    nodes = nbits_nodes(exported.model)
    assert len(nodes) == 2
    # K = 64: group 32 is two blocks; group 128 does not divide into K, so quantize is per
    # channel: one block of 64.
    assert [attrs(n)["block_size"] for n in nodes] == [32, 32] if group == 32 else [64, 64]
    assert all(attrs(n)["bits"] == bits and attrs(n)["accuracy_level"] == 0 for n in nodes)
    assert {(o.domain, o.version) for o in exported.model.opset_import} >= {("com.microsoft", 1)}


def test_packed_codes_and_scales_are_the_modules_grid():
    """B unpacked here reproduces the module's dequantized weight exactly."""
    module = lowered(EXAMPLES / "mlp.ir", "quantize{scheme=w4a16 group=32}")
    f = module.function()
    dq = [n for n in f.ops() if f.op(n) == "mp.matmul"]
    from mplower.lowering.weight_only import weight_only_matmuls

    want = {wo.matmul: wo.dequantized() for wo in weight_only_matmuls(module, f)}
    model = export_module(module).model
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for n, node in zip(dq, nbits_nodes(model)):
        a = attrs(node)
        k, n_out, block = a["K"], a["N"], a["block_size"]
        codes = unpack(inits[node.input[1]], 4).reshape(n_out, -1)[:, :k].astype(np.int64)
        scales = inits[node.input[2]].reshape(n_out, -1)
        assert len(node.input) == 3  # symmetric: the default zero point 8
        weight = (codes - 8).astype(np.float32) * np.repeat(scales, block, axis=1)[:, :k]
        np.testing.assert_array_equal(weight.T, want[n])


def _blocked(k: int, n: int, block: int, elem: str, asym: bool) -> str:
    """x @ W with W a blocked dequantize of constant codes (as an imported MatMulNBits)."""
    lo, hi = (-8, 8) if elem == "i4" else (0, 256) if elem == "ui8" else (-128, 128)
    codes = _rng.integers(lo, hi, (k, n))
    blocks = -(-k // block)
    scale = (_rng.random((blocks, n)) * 0.1 + 0.01).astype(np.float32)
    zp = _rng.integers(lo, hi, (blocks, n)) if asym else np.zeros((blocks, n), np.int64)

    def dense(a, t):
        return f"dense<{a.tolist()}> : tensor<{'x'.join(map(str, a.shape))}x{t}>"
    return f"""func.func @main(%x: tensor<3x{k}xf32>) -> tensor<3x{n}xf32> {{
  %q = mp.constant {{value = {dense(codes, elem)}}} : () -> tensor<{k}x{n}x{elem}>
  %w = mp.dequantize %q {{scale = {dense(scale, "f32")}, zero_point = {dense(zp, elem)}, axis = 0, block_size = {block}}} : (tensor<{k}x{n}x{elem}>) -> tensor<{k}x{n}xf32>
  %y = mp.matmul %x, %w : (tensor<3x{k}xf32>, tensor<{k}x{n}xf32>) -> tensor<3x{n}xf32>
  return %y : tensor<3x{n}xf32>
}}"""


@pytest.mark.parametrize("elem,k,block", [("i4", 96, 32), ("i4", 80, 16), ("ui8", 64, 32),
                                          ("i8", 128, 128)])
@pytest.mark.parametrize("asym", [False, True])
def test_zero_points_are_packed_as_onnxruntime_reads_them(elem, k, block, asym):
    module = parse(_blocked(k, 24, block, elem, asym), "blocked.ir")
    x = _rng.normal(size=(3, k)).astype(np.float32)
    exported = assert_matches(module, [x])
    (node,) = nbits_nodes(exported.model)
    assert attrs(node)["block_size"] == block
    # No zero points when every one is the operator's default 2^(bits - 1).
    assert (len(node.input) == 4) == (asym or elem == "ui8")


def test_a_block_matmulnbits_cannot_hold_stays_qdq_with_a_note():
    module = parse(_blocked(48, 8, 24, "i4", True), "odd.ir")
    exported = assert_matches(module, [_rng.normal(size=(3, 48)).astype(np.float32)])
    assert not nbits_nodes(exported.model)
    assert any("change every 24 rows" in n and "Q/DQ" in n for n in exported.notes)


def test_bf16_activations_keep_qdq_with_the_reason():
    module = lowered(EXAMPLES / "mlp.ir", "assign-precision{policy=bf16},"
                                          "quantize{scheme=w8a16 group=32},insert-casts")
    exported = export_module(module)
    assert not nbits_nodes(exported.model)
    assert any("activation is bf16" in n for n in exported.notes)


def test_weight_only_qdq_option_writes_dequantize_linear(cli, tmp_path):
    module_path = tmp_path / "q.ir"
    r = cli("opt", EXAMPLES / "mlp.ir", "--pass=quantize{scheme=w4a16 group=32}",
            "-o", module_path)
    assert r.rc == 0, r.err
    for form, op in (("qdq", "DequantizeLinear"), ("matmulnbits", "MatMulNBits")):
        out = tmp_path / f"{form}.onnx"
        r = cli("export", module_path, "-o", out, f"--weight-only={form}")
        assert r.rc == 0, r.err
        ops = {n.op_type for n in onnx.load(out).graph.node}
        assert op in ops and ({"MatMulNBits", "DequantizeLinear"} - {op}).isdisjoint(ops)
    r = cli("export", module_path, "-o", tmp_path / "x.onnx", "--weight-only=int4")
    assert r.rc == 2 and "invalid choice" in r.err


# ---- a tiny HF-shaped Llama ------------------------------------------------------------------

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
         "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "vocab_size": 64, "max_position_embeddings": 32, "hidden_act": "silu",
         "tie_word_embeddings": False}


def write_llama(folder: Path, cfg: dict = LLAMA, seed: int = 0, bf16: bool = False
                ) -> dict[str, np.ndarray]:
    """config.json and a safetensors file written with numpy (u64 header length, JSON header,
    data), random weights in f32 (or bf16); no lm_head with tie_word_embeddings."""
    rng = np.random.default_rng(seed)
    h, i_, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i_, h), p + "mlp.up_proj.weight": (i_, h),
                       p + "mlp.down_proj.weight": (h, i_)})
    tensors = {k: (1 + 0.1 * rng.standard_normal(s) if k.endswith("norm.weight") else
                   0.2 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    if bf16:
        import ml_dtypes

        tensors = {k: a.astype(ml_dtypes.bfloat16) for k, a in tensors.items()}
    header, offset = {}, 0
    for k, a in tensors.items():
        header[k] = {"dtype": "BF16" if bf16 else "F32", "shape": list(a.shape),
                     "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(
        len(head).to_bytes(8, "little") + head + b"".join(a.tobytes() for a in tensors.values()))
    (folder / "config.json").write_text(json.dumps(cfg))
    return tensors


@pytest.mark.parametrize("scheme,group", [("w4a16", 32), ("w4a16", 128), ("w8a16", 128)])
def test_tiny_llama_prefill_matches_in_onnxruntime(cli, tmp_path, scheme, group):
    write_llama(tmp_path / "llama")
    r = cli("import", tmp_path / "llama", "-o", tmp_path / "m.ir", "--seq", "6")
    assert r.rc == 0, r.err
    module = lowered(tmp_path / "m.ir", f"quantize{{scheme={scheme} group={group}}}")
    ids = np.array([[1, 5, 9, 33, 2, 60]], np.int64)
    exported = assert_matches(module, [ids], "prefill")
    nodes = nbits_nodes(exported.model)
    assert len(nodes) == 8  # q, k, v, o, gate, up, down, lm_head
    blocks = sorted({(attrs(n)["K"], attrs(n)["block_size"]) for n in nodes})
    want = [(128, min(group, 128)), (256, group)]
    assert blocks == want
    assert not [n for n in exported.model.graph.node if n.op_type == "DequantizeLinear"]
