"""Perplexity by the prefill path and the decode path (mplower.hf.perplexity, `mplower
perplexity`): the two agree, and both equal the NLL of an independent float64 transcription."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_hf_import import f64, llama_reference, llama_tensors, write_checkpoint

from mplower.hf.perplexity import byte_tokens, next_token_logits, score

CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
       "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
       "vocab_size": 256, "max_position_embeddings": 64}
TEXT = "Hello, mplower: a KV cache!"  # 27 bytes
PROMPT = 19


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("ppl") / "bytes-llama"
    tensors = llama_tensors(CFG, np.random.default_rng(3))
    write_checkpoint(folder, CFG, tensors)
    return folder, f64(tensors)


def reference_nll(w: dict, ids: np.ndarray, prompt: int) -> float:
    logits = llama_reference(CFG, w, ids)[:, prompt - 1:-1]
    top = logits.max(-1, keepdims=True)
    logz = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    picked = np.take_along_axis(logits, ids[:, prompt:, None], -1)[..., 0]
    return float(np.mean(logz - picked))


def test_decode_path_and_prefill_path_perplexity_agree(checkpoint):
    folder, w = checkpoint
    ids = byte_tokens(TEXT)
    assert ids.shape == (1, 27) and ids[0, 0] == ord("H")
    got = score(folder, ids, PROMPT)
    prefill, decode = got["prefill"], got["decode"]
    assert prefill.tokens == decode.tokens == 27 - PROMPT
    assert abs(decode.nll - prefill.nll) <= 1e-5 * prefill.nll
    want = reference_nll(w, ids, PROMPT)
    assert abs(prefill.nll - want) <= 1e-5 * want
    assert prefill.bits_per_token == pytest.approx(want / math.log(2), rel=1e-5)
    assert decode.perplexity == pytest.approx(math.exp(want), rel=1e-4)


def test_the_decode_path_reproduces_every_position_of_the_prefill(checkpoint):
    folder, _ = checkpoint
    ids = byte_tokens(TEXT[:23])
    by_prefill = next_token_logits(folder, ids, PROMPT, "prefill")
    by_decode = next_token_logits(folder, ids, PROMPT, "decode")
    assert by_decode.shape == by_prefill.shape == (1, 23 - PROMPT, 256)
    np.testing.assert_allclose(by_decode, by_prefill, rtol=1e-5, atol=1e-5)


def test_a_quantized_cache_changes_perplexity_and_both_paths_see_it(checkpoint):
    folder, _ = checkpoint
    ids = byte_tokens(TEXT)
    exact = score(folder, ids, PROMPT, ("prefill",))["prefill"].nll
    fp8 = score(folder, ids, PROMPT, pipeline="quantize-kv{granularity=token}")
    assert abs(fp8["decode"].nll - fp8["prefill"].nll) <= 1e-5 * fp8["prefill"].nll
    assert fp8["prefill"].nll != exact
    assert abs(fp8["prefill"].nll - exact) < 0.05 * exact


def test_cli_reports_both_paths_and_checks_their_agreement(cli, tmp_path, checkpoint):
    folder, w = checkpoint
    text = tmp_path / "hello.txt"
    text.write_text(TEXT, encoding="utf-8")
    r = cli("perplexity", folder, "--text", text, "--prompt", PROMPT, "--format", "json",
            "--check")
    assert r.rc == 0, r.err
    report = json.loads(r.out)
    want = reference_nll(w, byte_tokens(TEXT), PROMPT)
    for path in ("prefill", "decode"):
        assert report["paths"][path]["nll"] == pytest.approx(want, rel=1e-5)
        assert report["paths"][path]["tokens"] == 27 - PROMPT
    assert report["nll_rel_diff"] < 1e-5
    np.savez(tmp_path / "ids.npz", input_ids=byte_tokens(TEXT)[0])
    r = cli("perplexity", folder, "--tokens", tmp_path / "ids.npz", "--prompt", PROMPT,
            "--path", "prefill")
    assert r.rc == 0 and "prefill" in r.out and "decode" not in r.out


def test_cli_refuses_what_it_cannot_score(cli, tmp_path, checkpoint):
    folder, _ = checkpoint
    text = tmp_path / "t.txt"
    text.write_text("short", encoding="utf-8")
    r = cli("perplexity", folder, "--text", text, "--prompt", 5)
    assert r.rc == 1 and "must be at least 1 and shorter than the text (5 tokens)" in r.err
    small = tmp_path / "small"
    write_checkpoint(small, {**CFG, "vocab_size": 100},
                     llama_tensors({**CFG, "vocab_size": 100}, np.random.default_rng(0)))
    r = cli("perplexity", small, "--text", text, "--prompt", 2)
    assert r.rc == 1 and "vocabulary has 100 entries" in r.err and "Traceback" not in r.err
    r = cli("perplexity", folder, "--text", text, "--path", "decode", "--check")
    assert r.rc == 2 and "--check compares the two paths" in r.err
    r = cli("perplexity", text, "--text", text)
    assert r.rc == 2 and "not a checkpoint folder" in r.err
