"""quantize-kv: an imported Llama's KV cache stored in fp8/int8, checked against a float64 NumPy
transcription of the model that rounds its keys and values with ml_dtypes (never mplower's
code), and the signature the decode cost model reads."""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from test_hf_import import f64, llama_tensors, rope_inv_freq, softmax, write_checkpoint

from mplower.backend.executor import Program
from mplower.ir.parser import parse_file

ROOT = Path(__file__).resolve().parent.parent

CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
       "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
       "vocab_size": 64, "max_position_embeddings": 64}
B, S = 2, 6
FMAX = {"f8E4M3FN": 448.0, "i8": 127.0}


def quantized(x: np.ndarray, fmt: str, granularity: str, static: float | None
              ) -> tuple[np.ndarray, np.ndarray]:
    """(the stored values as float64 = code * scale, the scales) of keys or values x [B, H, T,
    D]: vLLM's conventions as docs/passes.md states them, rounded by ml_dtypes / numpy."""
    fmax = FMAX[fmt]
    if granularity == "tensor":
        scale = np.float64(np.float32(static))
    else:
        axes = (3,) if granularity == "head" else (1, 3)
        amax = np.abs(x).max(axis=axes, keepdims=True)
        scale = np.maximum(amax / fmax, 1 / (fmax * 512)).astype(np.float32).astype(np.float64)
    y = (x / scale).astype(np.float32)
    if fmt == "f8E4M3FN":
        code = np.clip(y, -fmax, fmax).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    else:
        code = np.clip(np.rint(y), -128, 127).astype(np.float64)
    return code * scale, scale


def reference(w: dict, ids: np.ndarray, start: int, past: list | None, quant) -> tuple:
    """Logits and each layer's stored (dequantized) keys and values for `ids` at positions
    start.. after `past`; `quant(layer, kind, x)` gives what the cache stores of x."""
    h, nh, nkv = CFG["hidden_size"], CFG["num_attention_heads"], CFG["num_key_value_heads"]
    d, eps = h // nh, CFG["rms_norm_eps"]
    b, t = ids.shape

    def rms(x, g):
        return g * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))

    def rotate_half(x):
        return np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)

    freqs = np.arange(start, start + t)[:, None] * rope_inv_freq(CFG, d)[None, :]
    cos, sin = np.cos(np.concatenate([freqs] * 2, -1)), np.sin(np.concatenate([freqs] * 2, -1))
    mask = np.where(np.arange(start + t)[None, :] <= start + np.arange(t)[:, None], 0, -np.inf)
    x = w["model.embed_tokens.weight"][ids]
    presents = []
    for L in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{L}."
        y = rms(x, w[p + "input_layernorm.weight"])

        def proj(name, n, y=y, p=p):
            z = y @ w[p + f"self_attn.{name}_proj.weight"].T
            return z.reshape(b, t, n, d).transpose(0, 2, 1, 3)

        q, k, v = proj("q", nh), proj("k", nkv), proj("v", nkv)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = quant(L, "key", k), quant(L, "value", v)
        if past is not None:
            k, v = np.concatenate([past[L][0], k], 2), np.concatenate([past[L][1], v], 2)
        presents.append((k, v))
        kr, vr = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        a = softmax(q @ kr.transpose(0, 1, 3, 2) / math.sqrt(d) + mask) @ vr
        x = x + a.transpose(0, 2, 1, 3).reshape(b, t, nh * d) @ w[p + "self_attn.o_proj.weight"].T
        y = rms(x, w[p + "post_attention_layernorm.weight"])
        g = y @ w[p + "mlp.gate_proj.weight"].T
        u = y @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    return x @ w["lm_head.weight"].T, presents


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("kv") / "llama"
    tensors = llama_tensors(CFG, np.random.default_rng(0))
    write_checkpoint(folder, CFG, tensors)
    return folder, f64(tensors)


def lowered(cli, tmp_path: Path, folder: Path, *passes: str):
    tmp_path.mkdir(exist_ok=True)
    out = tmp_path / "m.ir"
    r = cli("import", folder, "-o", out, "--batch", B, "--seq", S)
    assert r.rc == 0, r.err
    if passes:
        r = cli("opt", out, *(f"--pass={p}" for p in passes), "-o", tmp_path / "q.ir")
        assert r.rc == 0, r.err
        out = tmp_path / "q.ir"
    return parse_file(out)


def run(module, func: str, inputs: list) -> list[np.ndarray]:
    return Program(module, func).run(inputs, reference=False).outputs


IDS = np.random.default_rng(1).integers(0, CFG["vocab_size"], (B, S + 1)).astype(np.int64)


@pytest.mark.parametrize("fmt,granularity", [("f8E4M3FN", "token"), ("f8E4M3FN", "head"),
                                             ("i8", "token"), ("f8E4M3FN", "tensor"),
                                             ("i8", "tensor")])
def test_quantized_cache_matches_a_numpy_transcription(cli, tmp_path, checkpoint, fmt,
                                                       granularity):
    folder, w = checkpoint
    passes = [f"quantize-kv{{format={fmt} granularity={granularity}}}"]
    if granularity == "tensor":
        np.savez(tmp_path / "calib.npz", input_ids=IDS[:, :S])
        passes.insert(0, f"calibrate{{func=prefill data={tmp_path / 'calib.npz'}}}")
    module = lowered(cli, tmp_path, folder, *passes)
    first = run(module, "prefill", [IDS[:, :S]])
    step = run(module, "decode", [IDS[:, S:]] + first[1:])

    # The static scales are amax / fmax of the calibrated (fp32) presents: the calibration
    # batch is the prompt, so its amax is the prompt's keys' and values'.
    _, plain = reference(w, IDS[:, :S], 0, None, lambda L, kind, x: x)
    static = {(L, kind): np.abs(plain[L][kind == "value"]).max() / FMAX[fmt]
              for L in range(2) for kind in ("key", "value")}

    def quant(L, kind, x):
        return quantized(x, fmt, granularity, static[(L, kind)])[0]

    want_first, cache = reference(w, IDS[:, :S], 0, None, quant)
    want_step, stored_want = reference(w, IDS[:, S:], S, cache, quant)
    for got, want in ((first[0], want_first), (step[0], want_step)):
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    # The stored cache, code times scale, is the transcription's.
    per = 1 if granularity == "tensor" else 2
    for L in range(2):
        for j, kind in enumerate(("key", "value")):
            at = 1 + (2 * L + j) * per
            codes = step[at]
            stored = codes * (step[at + 1] if per == 2 else np.float32(static[(L, kind)]))
            np.testing.assert_allclose(stored, stored_want[L][j], rtol=1e-5, atol=1e-6)
            if fmt == "f8E4M3FN":  # codes are f8 values, exactly
                assert np.array_equal(codes.astype(ml_dtypes.float8_e4m3fn).astype(np.float32),
                                      codes)
            else:
                assert np.array_equal(codes, np.rint(codes)) and np.abs(codes).max() <= 127


def test_fp8_cache_drifts_from_fp32_by_a_little(cli, tmp_path, checkpoint):
    folder, _ = checkpoint
    exact = run(lowered(cli, tmp_path / "plain", folder), "prefill", [IDS[:, :S]])[0]
    drift = {}
    for fmt in ("f8E4M3FN", "i8"):
        module = lowered(cli, tmp_path / fmt, folder, f"quantize-kv{{format={fmt} "
                                                      f"granularity=token}}")
        got = run(module, "prefill", [IDS[:, :S]])[0]
        drift[fmt] = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    # fp8's 3 mantissa bits give a few percent on this random model; int8's 255 steps per
    # token less.
    assert 1e-3 < drift["i8"] < drift["f8E4M3FN"] < 0.15


def test_decode_signature_narrows_the_cache_and_names_the_scales(cli, tmp_path, checkpoint):
    folder, _ = checkpoint
    module = lowered(cli, tmp_path, folder, "quantize-kv{granularity=head}")
    f = module.functions["decode"]
    args = [(f.data(a)["name"], f.types(a)[0]) for a in f.args]
    assert [n for n, _ in args[:5]] == ["input_ids", "past_key_values.0.key",
                                        "past_key_values.0.key_scale",
                                        "past_key_values.0.value",
                                        "past_key_values.0.value_scale"]
    assert str(args[1][1]) == f"tensor<{B}x2x{S}x8xf8E4M3FN>"
    assert str(args[2][1]) == f"tensor<{B}x2x{S}x1xf32>"
    names = f.attrs["mp.output_names"]
    assert names[:3] == ("logits", "present.0.key", "present.0.key_scale")
    assert str(f.result_types[1]) == f"tensor<{B}x2x{S + 1}x8xf8E4M3FN>"
    # The cache's bytes, from the argument element types: a quarter of f32's, plus the scales.
    bf16 = 2 * B * 2 * S * 8
    fp8 = sum(t.size * (1 if t.elem == "f8E4M3FN" else 4) for n, t in args[1:3])
    assert fp8 == bf16 // 2 + 4 * B * 2 * S


def test_tensor_granularity_without_calibration_is_refused(cli, tmp_path, checkpoint):
    folder, _ = checkpoint
    r = cli("import", folder, "-o", tmp_path / "m.ir", "--batch", B, "--seq", S)
    assert r.rc == 0
    r = cli("opt", tmp_path / "m.ir", "--pass=quantize-kv", "-o", tmp_path / "q.ir")
    assert r.rc == 1 and "no calibrated range" in r.err and "calibrate{func=prefill" in r.err
    assert "Traceback" not in r.err and not (tmp_path / "q.ir").exists()


def test_a_module_without_a_cache_and_bad_options_are_refused(cli):
    r = cli("opt", ROOT / "ir_examples" / "mlp.ir", "--pass=quantize-kv{granularity=token}")
    assert r.rc == 1 and "no function has a key/value cache" in r.err
    r = cli("opt", ROOT / "ir_examples" / "mlp.ir", "--pass=quantize-kv{format=f16}")
    assert r.rc == 2 and "format must be one of f8E4M3FN, i8" in r.err


def test_quantizing_twice_is_refused(cli, tmp_path, checkpoint):
    folder, _ = checkpoint
    lowered(cli, tmp_path, folder, "quantize-kv{granularity=token}")
    r = cli("opt", tmp_path / "q.ir", "--pass=quantize-kv{granularity=token}")
    assert r.rc == 1 and "already f8E4M3FN" in r.err


def test_quantized_gpt2_decode_step_reproduces_the_longer_prefill(cli, tmp_path):
    """Attention reads the stored cache in both functions, so prefill + one decode step is the
    prefill one token longer under the quantized cache too (dynamic scales: per position)."""
    from test_hf_import import CASES

    cfg, maker, dtype, shards, _ = CASES["gpt2"]
    folder = tmp_path / "gpt2"
    write_checkpoint(folder, cfg, maker(cfg, np.random.default_rng(0), dtype), shards)
    kv = "--pass=quantize-kv{format=i8 granularity=head}"
    modules = []
    for seq in (S, S + 1):
        out = tmp_path / f"g{seq}.ir"
        assert cli("import", folder, "-o", out, "--batch", B, "--seq", seq).rc == 0
        assert cli("opt", out, kv, "-o", tmp_path / f"q{seq}.ir").rc == 0
        modules.append(parse_file(tmp_path / f"q{seq}.ir"))
    ids = np.random.default_rng(2).integers(0, cfg["vocab_size"], (B, S + 1)).astype(np.int64)
    first = run(modules[0], "prefill", [ids[:, :S]])
    step = run(modules[0], "decode", [ids[:, S:]] + first[1:])
    whole = run(modules[1], "prefill", [ids])
    np.testing.assert_allclose(step[0][:, 0], whole[0][:, S], rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(step[1:], whole[1:], strict=True):  # codes and scales
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def test_run_and_report_show_the_cache_quantize_and_dequantize_ops(cli, tmp_path, checkpoint):
    import json

    folder, _ = checkpoint
    module = lowered(cli, tmp_path, folder, "quantize-kv{granularity=token}")
    first = run(module, "prefill", [IDS[:, :S]])
    names = [module.functions["decode"].data(a)["name"] for a in module.functions["decode"].args]
    np.savez(tmp_path / "step.npz", **dict(zip(names, [IDS[:, S:]] + first[1:], strict=True)))
    r = cli("run", tmp_path / "q.ir", "--func", "decode", "--inputs", tmp_path / "step.npz",
            "--format", "json")
    assert r.rc == 0, r.err
    rows = {o["name"]: o for o in json.loads(r.out)["ops"]}
    assert rows["%present.0.key.q"]["op"] == "mp.quantize"
    # The fp32 reference keeps the new token's keys unrounded: the stored cache drifts a little.
    dq = rows["%present.0.key.dq"]
    assert dq["op"] == "mp.dequantize" and 0 < dq["rel_l2"] < 0.05
    r = cli("report", tmp_path / "q.ir", "--func", "decode")
    assert r.rc == 0 and "%present.0.value.dq" in r.out and "mp.quantize" in r.out
