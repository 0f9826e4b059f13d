"""`mplower import DIR` of HuggingFace checkpoint folders (mplower.hf).

Each test writes a tiny random-init checkpoint itself (config.json and safetensors written here
with numpy, byte by byte as the format's README describes), imports it through the CLI, runs
@prefill and @decode on mplower's executor, and compares with an independent float64 NumPy
transcription of the architecture's forward, written from the math of transformers'
modeling_llama.py / modeling_qwen2.py / modeling_gpt2.py (not from mplower's code).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mplower.backend.executor import Program
from mplower.ir.parser import parse_file

B, S = 2, 5

# ---------------------------------------------------------------------------------------------
# Writing checkpoints


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors layout: u64 header length, JSON header, data (tensors in order)."""
    tags = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
            np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int64): "I64"}
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": tags[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def llama_tensors(cfg: dict, rng: np.random.Generator, dtype=np.float32) -> dict[str, np.ndarray]:
    h, i_, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", h // nh)
    qkv_bias, o_bias, mlp_bias = biases(cfg)

    def r(*shape, scale=0.3):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    t = {"model.embed_tokens.weight": r(v, h, scale=1.0), "model.norm.weight": 1 + r(h)}
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        t[p + "input_layernorm.weight"] = 1 + r(h)
        t[p + "post_attention_layernorm.weight"] = 1 + r(h)
        for name, n in (("q", nh), ("k", nkv), ("v", nkv)):
            t[p + f"self_attn.{name}_proj.weight"] = r(n * d, h)
            if qkv_bias:
                t[p + f"self_attn.{name}_proj.bias"] = r(n * d)
        t[p + "self_attn.o_proj.weight"] = r(h, nh * d)
        if o_bias:
            t[p + "self_attn.o_proj.bias"] = r(h)
        for name, shape in (("gate", (i_, h)), ("up", (i_, h)), ("down", (h, i_))):
            t[p + f"mlp.{name}_proj.weight"] = r(*shape)
            if mlp_bias:
                t[p + f"mlp.{name}_proj.bias"] = r(shape[0])
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = r(v, h)
    return t


def biases(cfg: dict) -> tuple[bool, bool, bool]:
    """(q/k/v, o_proj, MLP) biases: Qwen2Attention has q/k/v biases always; LlamaAttention
    all four with attention_bias; LlamaMLP's with mlp_bias."""
    qwen = cfg["architectures"] == ["Qwen2ForCausalLM"]
    attention = cfg.get("attention_bias", False)
    return qwen or attention, attention and not qwen, cfg.get("mlp_bias", False)


def gpt2_tensors(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    e, v, n = cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"]

    def r(*shape, scale=0.3):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"wte.weight": r(v, e, scale=1.0), "wpe.weight": r(n, e),
         "ln_f.weight": 1 + r(e), "ln_f.bias": r(e)}
    for L in range(cfg["n_layer"]):
        p = f"h.{L}."
        for ln in ("ln_1", "ln_2"):
            t[p + ln + ".weight"], t[p + ln + ".bias"] = 1 + r(e), r(e)
        t[p + "attn.c_attn.weight"], t[p + "attn.c_attn.bias"] = r(e, 3 * e), r(3 * e)
        t[p + "attn.c_proj.weight"], t[p + "attn.c_proj.bias"] = r(e, e), r(e)
        t[p + "mlp.c_fc.weight"], t[p + "mlp.c_fc.bias"] = r(e, 4 * e), r(4 * e)
        t[p + "mlp.c_proj.weight"], t[p + "mlp.c_proj.bias"] = r(4 * e, e), r(e)
    return t


def write_checkpoint(folder: Path, cfg: dict, tensors: dict[str, np.ndarray],
                     shards: int = 1) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    if shards == 1:
        write_safetensors(folder / "model.safetensors", tensors)
        return
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        write_safetensors(folder / file, {n: tensors[n] for n in part})
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


# ---------------------------------------------------------------------------------------------
# Independent float64 references


def f64(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v).astype(np.float64) for k, v in tensors.items()}


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def rope_inv_freq(cfg: dict, d: int) -> np.ndarray:
    inv = 1.0 / cfg.get("rope_theta", 10000.0) ** (np.arange(0, d, 2) / d)
    sc = cfg.get("rope_scaling")
    if sc is None:
        return inv
    if sc.get("rope_type", sc.get("type")) == "linear":  # "type" is the older key
        return inv / sc["factor"]
    # transformers' _compute_llama3_parameters, transcribed
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(f)
        elif wavelen > old / lo:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def llama_reference(cfg: dict, w: dict, ids: np.ndarray) -> np.ndarray:
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", h // nh)
    eps = cfg["rms_norm_eps"]
    b, t = ids.shape
    qkv_bias, o_bias, mlp_bias = biases(cfg)

    def linear(x, name, bias):
        return x @ w[name + ".weight"].T + (w[name + ".bias"] if bias else 0)

    def rms(x, g):
        return g * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))

    def rotate_half(x):
        return np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)

    freqs = np.arange(t)[:, None] * rope_inv_freq(cfg, d)[None, :]
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb), np.sin(emb)
    x = w["model.embed_tokens.weight"][ids]
    causal = np.triu(np.full((t, t), -np.inf), 1)
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        y = rms(x, w[p + "input_layernorm.weight"])

        def proj(name, n, y=y, p=p):
            z = linear(y, p + f"self_attn.{name}_proj", qkv_bias)
            return z.reshape(b, t, n, d).transpose(0, 2, 1, 3)

        q, k, v = proj("q", nh), proj("k", nkv), proj("v", nkv)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        a = softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + causal) @ v
        x = x + linear(a.transpose(0, 2, 1, 3).reshape(b, t, nh * d), p + "self_attn.o_proj",
                       o_bias)
        y = rms(x, w[p + "post_attention_layernorm.weight"])
        g = linear(y, p + "mlp.gate_proj", mlp_bias)
        u = linear(y, p + "mlp.up_proj", mlp_bias)
        x = x + linear(g / (1 + np.exp(-g)) * u, p + "mlp.down_proj", mlp_bias)
    x = rms(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"]
    return x @ head.T


def gpt2_reference(cfg: dict, w: dict, ids: np.ndarray) -> np.ndarray:
    e, nh = cfg["n_embd"], cfg["n_head"]
    d, eps = e // nh, cfg["layer_norm_epsilon"]
    b, t = ids.shape

    def ln(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w[name + ".weight"] + w[name + ".bias"]

    def gelu_new(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    def split(z):
        return z.reshape(b, t, nh, d).transpose(0, 2, 1, 3)

    x = w["wte.weight"][ids] + w["wpe.weight"][np.arange(t)]
    causal = np.triu(np.full((t, t), -np.inf), 1)
    for L in range(cfg["n_layer"]):
        p = f"h.{L}."
        qkv = ln(x, p + "ln_1") @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (split(z) for z in np.split(qkv, 3, axis=-1))
        a = softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + causal) @ v
        a = a.transpose(0, 2, 1, 3).reshape(b, t, e)
        x = x + a @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        m = gelu_new(ln(x, p + "ln_2") @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        x = x + m @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ w["wte.weight"].T


# ---------------------------------------------------------------------------------------------
# Models under test

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
         "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 50,
         "max_position_embeddings": 64, "hidden_act": "silu", "tie_word_embeddings": False}
LLAMA_TIED = {**LLAMA, "tie_word_embeddings": True, "head_dim": 16, "num_key_value_heads": 1,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8}}
MISTRAL = {**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
           "sliding_window": 32,
           "rope_scaling": {"type": "linear", "factor": 2.0}}
LLAMA_BIAS = {**LLAMA, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}
QWEN2 = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
         "num_key_value_heads": 1,
         "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 32, "n_head": 4,
        "n_layer": 2, "n_positions": 16, "vocab_size": 50, "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new"}

CASES = {  # name -> (config, tensors maker, storage dtype, shards, reference)
    "llama": (LLAMA, llama_tensors, np.float32, 1, llama_reference),
    "llama_tied_llama3_bf16": (LLAMA_TIED, llama_tensors, ml_dtypes.bfloat16, 1,
                               llama_reference),
    "mistral_f16": (MISTRAL, llama_tensors, np.float16, 1, llama_reference),
    "qwen2_sharded": (QWEN2, llama_tensors, np.float32, 3, llama_reference),
    "llama_bias": (LLAMA_BIAS, llama_tensors, np.float32, 1, llama_reference),
    "gpt2": (GPT2, lambda cfg, rng, dtype: gpt2_tensors(cfg, rng), np.float32, 1,
             gpt2_reference),
    # GPT2LMHeadModel's own state dict names its tensors under `transformer.`
    "gpt2_prefixed": (GPT2, lambda cfg, rng, dtype: {
        "transformer." + k: v for k, v in gpt2_tensors(cfg, rng).items()}, np.float32, 1,
        lambda cfg, w, ids: gpt2_reference(cfg, {k.removeprefix("transformer."): v
                                                 for k, v in w.items()}, ids)),
}


def make(tmp_path: Path, name: str) -> tuple[Path, dict, dict]:
    cfg, maker, dtype, shards, _ = CASES[name]
    tensors = maker(cfg, np.random.default_rng(0), dtype)
    folder = tmp_path / name
    write_checkpoint(folder, cfg, tensors, shards)
    return folder, cfg, tensors


def imported(cli, folder: Path, out: Path, *flags) -> object:
    r = cli("import", folder, "-o", out, *map(str, flags))
    assert r.rc == 0, r.err
    return parse_file(out)


def run(module, func: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    return Program(module, func).run(inputs, reference=False).outputs


@pytest.mark.parametrize("name", sorted(CASES))
def test_checkpoint_prefill_logits_match_an_independent_reference(cli, tmp_path, name):
    folder, cfg, tensors = make(tmp_path, name)
    module = imported(cli, folder, tmp_path / "m.ir", "--batch", B, "--seq", S)
    ids = np.random.default_rng(1).integers(0, cfg["vocab_size"], (B, S)).astype(np.int64)
    logits = run(module, "prefill", [ids])[0]
    want = CASES[name][4](cfg, f64(tensors), ids)
    assert logits.shape == want.shape == (B, S, cfg["vocab_size"])
    assert np.linalg.norm(logits - want) / np.linalg.norm(want) < 1e-5
    assert np.max(np.abs(logits - want)) <= 1e-4 * np.max(np.abs(want))


@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_with_the_prefill_cache_reproduces_the_longer_prefill(cli, tmp_path, name):
    folder, cfg, _ = make(tmp_path, name)
    short = imported(cli, folder, tmp_path / "s.ir", "--batch", B, "--seq", S)
    longer = imported(cli, folder, tmp_path / "l.ir", "--batch", B, "--seq", S + 1)
    ids = np.random.default_rng(2).integers(0, cfg["vocab_size"], (B, S + 1)).astype(np.int64)
    first = run(short, "prefill", [ids[:, :S]])
    step = run(short, "decode", [ids[:, S:]] + first[1:])
    whole = run(longer, "prefill", [ids])
    assert step[0].shape == (B, 1, cfg["vocab_size"])
    np.testing.assert_allclose(step[0][:, 0], whole[0][:, S], rtol=1e-5, atol=1e-5)
    # The decode step's present cache is the longer prompt's.
    for mine, theirs in zip(step[1:], whole[1:], strict=True):
        assert mine.shape == theirs.shape
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def test_precision_passes_lower_both_functions_like_any_model(cli, tmp_path):
    folder, cfg, _ = make(tmp_path, "qwen2_sharded")
    imported(cli, folder, tmp_path / "m.ir", "--batch", B, "--seq", S)
    r = cli("opt", tmp_path / "m.ir", "--pass-pipeline",
            "assign-precision{policy=bf16},insert-casts", "-o", tmp_path / "bf16.ir")
    assert r.rc == 0, r.err
    lowered, f32 = parse_file(tmp_path / "bf16.ir"), parse_file(tmp_path / "m.ir")
    ids = np.random.default_rng(5).integers(0, cfg["vocab_size"], (B, S + 1)).astype(np.int64)
    for module in (lowered, f32):
        assert any(f.op(n) == "mp.cast" for f in module.functions.values() for n in f.ops()) \
            == (module is lowered)
    cache = run(f32, "prefill", [ids[:, :S]])[1:]
    want = run(f32, "decode", [ids[:, S:]] + cache)[0]
    got = run(lowered, "decode", [ids[:, S:]] + cache)[0]
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 1e-4 < err < 5e-2  # bf16 matmuls: a visible, bounded drift


def test_module_has_prefill_and_decode_with_the_cache_as_arguments(cli, tmp_path):
    folder, _, _ = make(tmp_path, "llama")
    module = imported(cli, folder, tmp_path / "m.ir", "--batch", 3, "--seq", 4, "--context", 9)
    pre, dec = module.functions["prefill"], module.functions["decode"]
    assert [pre.types(a)[0].shape for a in pre.args] == [(3, 4)]
    cache = (3, 2, 9, 8)  # batch, kv heads, context, head_dim
    assert [dec.types(a)[0].shape for a in dec.args] == [(3, 1)] + [cache] * 4
    assert [t.shape for t in dec.result_types] == [(3, 1, 50)] + [(3, 2, 10, 8)] * 4
    assert [t.shape for t in pre.result_types] == [(3, 4, 50)] + [(3, 2, 4, 8)] * 4
    text = (tmp_path / "m.ir").read_text()
    assert "%past_key_values.1.value" in text
    # One npz entry per checkpoint tensor (linear weights transposed), plus tables.
    with np.load(tmp_path / "m.npz") as z:
        assert z["model.layers.0.self_attn.k_proj.weight"].shape == (32, 16)
        assert "lm_head.weight" in z.files


def test_reader_agrees_with_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    from mplower.hf.safetensors import SafetensorsFile, as_float32

    rng = np.random.default_rng(3)
    arrays = {"a": rng.standard_normal((3, 4)).astype(np.float32),
              "b": rng.standard_normal(7).astype(np.float16),
              "c": np.arange(6, dtype=np.int64).reshape(2, 3),
              "empty": np.zeros((0, 4), np.float32)}
    path = tmp_path / "x.safetensors"
    st.save_file(arrays, str(path))
    f = SafetensorsFile(path)
    assert sorted(f.tensors) == sorted(arrays)
    for name, a in arrays.items():
        np.testing.assert_array_equal(f.array(f.tensors[name]), a)
    # bf16, written by this test's own writer, read back by the package and by mplower
    bf = rng.standard_normal((2, 5)).astype(ml_dtypes.bfloat16)
    write_safetensors(tmp_path / "y.safetensors", {"w": bf})
    g = SafetensorsFile(tmp_path / "y.safetensors")
    mine = as_float32(g.array(g.tensors["w"]), "BF16")
    np.testing.assert_array_equal(mine, bf.astype(np.float32))
    theirs = st.load_file(str(tmp_path / "y.safetensors"))["w"]
    np.testing.assert_array_equal(theirs.view(np.uint16), bf.view(np.uint16))


# ---------------------------------------------------------------------------------------------
# Refusals: located, exit 1, no traceback


def refused(cli, folder: Path, out: Path, *needles: str) -> None:
    r = cli("import", folder, "-o", out, "--seq", 4)
    assert r.rc == 1, (r.rc, r.err)
    assert "Traceback" not in r.err and "internal error" not in r.err
    for n in needles:
        assert n in r.err, r.err
    assert not out.exists() and not out.with_suffix(".npz").exists()


def test_bad_header_length_is_refused_naming_the_file(cli, tmp_path):
    folder, _, _ = make(tmp_path, "llama")
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = (10**12).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    refused(cli, folder, tmp_path / "m.ir", "model.safetensors", "header length")


def test_header_that_is_not_json_is_refused(cli, tmp_path):
    folder, _, _ = make(tmp_path, "gpt2")
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8] = ord("[") + 1
    path.write_bytes(bytes(data))
    refused(cli, folder, tmp_path / "m.ir", "model.safetensors", "not JSON")


def test_truncated_data_is_refused_naming_the_tensor(cli, tmp_path):
    folder, _, _ = make(tmp_path, "llama")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    refused(cli, folder, tmp_path / "m.ir", "model.safetensors", "truncated", "lm_head.weight")


def test_shape_and_offsets_that_disagree_are_refused(cli, tmp_path):
    folder, _, _ = make(tmp_path, "llama")
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["model.norm.weight"]["shape"] = [33]
    head = json.dumps(header).encode().ljust(n)
    assert len(head) == n
    path.write_bytes(raw[:8] + head + raw[8 + n:])
    refused(cli, folder, tmp_path / "m.ir", "model.norm.weight", "needs")


def raw_file(header: dict, data_bytes: int) -> bytes:
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + bytes(data_bytes)


@pytest.mark.parametrize("content, needle", [
    (b"\x01\x00", "fewer than the 8-byte header length"),
    (raw_file({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, 2),
     "tensor 'w' has dtype 'F8_E4M3'"),
    (raw_file({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, 4),
     "tensor 'w' has shape [-1]"),
    (raw_file({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, 8),
     "tensor 'w' has data_offsets [8, 0]"),
    (raw_file({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "v": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8),
     "tensors 'w' and 'v' overlap"),
    (raw_file([1, 2], 0), "not a JSON object"),
])
def test_malformed_safetensors_is_refused_naming_what_is_wrong(cli, tmp_path, content, needle):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, GPT2, {})
    (folder / "model.safetensors").write_bytes(content)
    refused(cli, folder, tmp_path / "m.ir", "model.safetensors", needle)


def test_a_tensor_in_two_files_and_a_missing_tensor_are_refused(cli, tmp_path):
    folder, _, tensors = make(tmp_path, "gpt2")
    write_safetensors(folder / "extra.safetensors", {"wte.weight": tensors["wte.weight"]})
    refused(cli, folder, tmp_path / "m.ir", "tensor 'wte.weight' is also in")
    (folder / "extra.safetensors").unlink()
    del tensors["h.1.mlp.c_fc.bias"]
    write_safetensors(folder / "model.safetensors", tensors)
    refused(cli, folder, tmp_path / "m.ir", "tensor 'h.1.mlp.c_fc.bias' is missing")


def test_a_folder_without_config_is_refused(cli, tmp_path):
    folder, _, _ = make(tmp_path, "gpt2")
    (folder / "config.json").unlink()
    refused(cli, folder, tmp_path / "m.ir", "file 'config.json' is missing")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_link_to_a_file_outside_the_folder_is_refused(cli, tmp_path, name):
    folder, _, _ = make(tmp_path, "gpt2")
    outside = tmp_path / ("stolen-" + name)
    (folder / name).rename(outside)
    (folder / name).symlink_to(outside)
    refused(cli, folder, tmp_path / "m.ir", f"'{name}' is outside the checkpoint folder")


def test_shard_outside_the_folder_is_refused(cli, tmp_path):
    folder, _, _ = make(tmp_path, "qwen2_sharded")
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    outside = tmp_path / "stolen.safetensors"
    (folder / data["weight_map"][first]).rename(outside)
    for k, v in data["weight_map"].items():
        if v == data["weight_map"][first] or k == first:
            data["weight_map"][k] = "../stolen.safetensors"
    index.write_text(json.dumps(data))
    refused(cli, folder, tmp_path / "m.ir", "model.safetensors.index.json",
            "outside the checkpoint folder")


def test_tensor_shape_that_contradicts_config_is_refused(cli, tmp_path):
    cfg = {**LLAMA, "intermediate_size": 64}
    folder = tmp_path / "c"
    write_checkpoint(folder, cfg, llama_tensors(LLAMA, np.random.default_rng(0)))
    refused(cli, folder, tmp_path / "m.ir", "mlp.gate_proj.weight", "config.json implies")


@pytest.mark.parametrize("change, needle", [
    ({"architectures": ["FalconForCausalLM"]}, "architecture 'FalconForCausalLM'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"hidden_size": "32"}, "'hidden_size' is '32'"),
])
def test_config_out_of_scope_is_refused_naming_it(cli, tmp_path, change, needle):
    folder, _, _ = make(tmp_path, "llama")
    (folder / "config.json").write_text(json.dumps({**LLAMA, **change}))
    refused(cli, folder, tmp_path / "m.ir", "config.json", needle)


def test_more_positions_than_the_model_has_are_refused(cli, tmp_path):
    folder, _, _ = make(tmp_path, "gpt2")
    r = cli("import", folder, "-o", tmp_path / "m.ir", "--seq", 8, "--context", 16)
    assert r.rc == 1 and "17 positions" in r.err and "Traceback" not in r.err


def test_onnx_flags_on_a_folder_and_folder_flags_on_a_file_are_usage_errors(cli, tmp_path):
    folder, _, _ = make(tmp_path, "gpt2")
    r = cli("import", folder, "-o", tmp_path / "m.ir", "--input-shape", "x=1x2")
    assert r.rc == 2 and "--input-shape is for ONNX models" in r.err
    onnx_file = tmp_path / "m.onnx"
    onnx_file.write_bytes(b"")
    r = cli("import", onnx_file, "-o", tmp_path / "m.ir", "--seq", 4)
    assert r.rc == 2 and "--seq is for checkpoint folders" in r.err


def test_import_does_not_write_over_a_file_of_the_checkpoint(cli, tmp_path):
    folder, _, _ = make(tmp_path, "gpt2")
    before = (folder / "config.json").read_bytes()
    r = cli("import", folder, "-o", folder / "config.json", "--seq", 4)
    assert r.rc == 2 and "is the input" in r.err
    assert (folder / "config.json").read_bytes() == before


# ---------------------------------------------------------------------------------------------
# Against torch: checkpoints that transformers itself writes (save_pretrained), and its logits.
# Runs where this python has torch and transformers, or MPLOWER_TORCH_PYTHON names a python
# that has them (they need not share mplower's environment: only files pass between them).


def torch_python() -> str | None:
    if os.environ.get("MPLOWER_TORCH_PYTHON"):
        return os.environ["MPLOWER_TORCH_PYTHON"]
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        return sys.executable
    return None


SAVE_WITH_TRANSFORMERS = """
import json, sys
import numpy as np, torch, transformers
spec, out, ids = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.manual_seed(0)
config = getattr(transformers, spec["config"])(**spec["kwargs"])
model = getattr(transformers, spec["model"])(config).eval()
with torch.no_grad():  # weights far from the 0.02-std init, so attention is not uniform
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.3)
if spec.get("bf16"):
    model = model.to(torch.bfloat16)
model.save_pretrained(out)
# Read back as a user would, in f32: to(bfloat16) also rounded the rotary inv_freq buffer,
# which from_pretrained computes afresh.
model = type(model).from_pretrained(out, dtype=torch.float32,
                                    attn_implementation="eager").eval()
with torch.no_grad():
    np.save(out + "/torch_logits.npy", model(torch.from_numpy(np.load(ids))).logits.numpy())
"""

_SMALL = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50,
          "max_position_embeddings": 64, "attn_implementation": "eager"}
TRANSFORMERS_MODELS = {
    "llama_llama3_rope": {"config": "LlamaConfig", "model": "LlamaForCausalLM", "kwargs": {
        **_SMALL, "rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}},
    "llama_tied_bias": {"config": "LlamaConfig", "model": "LlamaForCausalLM", "kwargs": {
        **_SMALL, "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True,
        "head_dim": 16}},
    "mistral_linear_rope": {"config": "MistralConfig", "model": "MistralForCausalLM", "kwargs": {
        **_SMALL, "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 1e4}},
    "qwen2_bf16": {"config": "Qwen2Config", "model": "Qwen2ForCausalLM", "bf16": True,
                   "kwargs": {**_SMALL, "num_key_value_heads": 1}},
    "gpt2": {"config": "GPT2Config", "model": "GPT2LMHeadModel", "kwargs": {
        "n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 16, "vocab_size": 50,
        "attn_implementation": "eager"}},
}


@pytest.mark.skipif(torch_python() is None, reason="needs torch and transformers (or "
                                                   "MPLOWER_TORCH_PYTHON)")
@pytest.mark.parametrize("name", sorted(TRANSFORMERS_MODELS))
def test_checkpoint_saved_by_transformers_matches_torch(cli, tmp_path, name):
    ids = np.random.default_rng(4).integers(0, 50, (B, S)).astype(np.int64)
    np.save(tmp_path / "ids.npy", ids)
    folder = tmp_path / name
    subprocess.run([torch_python(), "-c", SAVE_WITH_TRANSFORMERS,
                    json.dumps(TRANSFORMERS_MODELS[name]), str(folder), str(tmp_path / "ids.npy")],
                   check=True, timeout=600, capture_output=True)
    want = np.load(folder / "torch_logits.npy")
    module = imported(cli, folder, tmp_path / "m.ir", "--batch", B, "--seq", S)
    logits = run(module, "prefill", [ids])[0]
    assert logits.shape == want.shape
    assert np.max(np.abs(logits - want)) <= 1e-4 * np.max(np.abs(want))
