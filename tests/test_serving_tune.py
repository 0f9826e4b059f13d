"""`mplower tune --phase decode --batch ...`: one search and one release per serving point."""

from __future__ import annotations

import json

import numpy as np
from test_hf_import import LLAMA, llama_tensors, write_checkpoint

from mplower.cli.tune import serving_packet, serving_table


def test_tune_decode_writes_one_plan_per_batch_and_a_packet_over_them(cli, tmp_path):
    cfg = LLAMA | {"max_position_embeddings": 4096}
    write_checkpoint(tmp_path / "ckpt", cfg, llama_tensors(cfg, np.random.default_rng(0),
                                                           np.float32))
    model = tmp_path / "m.ir"
    assert cli("import", tmp_path / "ckpt", "-o", model, "--seq", 4, "--context", 16).rc == 0
    rng = np.random.default_rng(0)
    data = {"input_ids": rng.integers(0, cfg["vocab_size"], (2, 1, 1))}
    for i in range(cfg["num_hidden_layers"]):
        for kv in ("key", "value"):
            data[f"past_key_values.{i}.{kv}"] = rng.standard_normal(
                (2, 1, cfg["num_key_value_heads"], 16, 8)).astype(np.float32)
    np.savez(tmp_path / "d.npz", **data)
    out = tmp_path / "rel"
    r = cli("tune", model, "--target", "h100", "--data", tmp_path / "d.npz", "--phase",
            "decode", "--batch", "1,64", "--context", 2048, "--budget", 3, "--formats",
            "bf16", "--guardrail", "max_rel_l2=0.5", "-o", out)
    assert r.rc == 0, r.err
    for b in (1, 64):
        assert {p.name for p in (out / f"b{b}").iterdir()} >= {
            "lowered.ir", "policy.toml", "tune.json", "pareto.png"}
        point = json.loads((out / f"b{b}" / "tune.json").read_text())
        assert point["provenance"]["serving"] == {"phase": "decode", "batch": b,
                                                  "context": 2048}
    packet = json.loads((out / "tune.json").read_text())
    assert [p["batch"] for p in packet["points"]] == [1, 64]
    assert [p["chosen"]["plan"] for p in packet["points"]] == ["b1/lowered.ir", "b64/lowered.ir"]
    # Priced at the point: 64 sequences a step make far more tokens/s than one.
    tps = [p["uniform_tokens_per_s"]["bf16"] for p in packet["points"]]
    assert tps[1] > 10 * tps[0]
    assert "decode at batch 64 (release b64/)" in r.out and "best sheet" in r.out
    r = cli("tune", model, "--target", "h100", "--data", tmp_path / "d.npz", "--batch", "2",
            "-o", tmp_path / "x")
    assert r.rc == 2 and "need --phase" in r.err


def _point(batch: int, tokens: dict[str, float]) -> tuple:
    uniform = [{"plan": {"sheet": s}, "label": s, "verdict": "pass",
                "modeled": {"tokens_per_s": t}} for s, t in tokens.items()]
    chosen = {"label": "mixed", "best_uniform": max(tokens, key=tokens.get),
              "modeled": {"tokens_per_s": max(tokens.values())}}
    return ("decode", batch, 2048), {"uniform": uniform, "chosen": chosen}


def test_serving_packet_names_the_batches_where_the_best_sheet_flips():
    # Batch 1 reads weights (the narrower weights win), batch 64 computes (the faster
    # arithmetic wins): the figures of the Llama3-8B table in docs/benchmarks.md, in shape.
    packet = serving_packet("decode", [_point(1, {"w8a16": 200.0, "fp8": 166.0}),
                                       _point(8, {"w8a16": 1500.0, "fp8": 1400.0}),
                                       _point(64, {"w8a16": 4000.0, "fp8": 4255.0})])
    assert [p["best_uniform"] for p in packet["points"]] == ["w8a16", "w8a16", "fp8"]
    assert packet["flips"] == [{"from_batch": 8, "to_batch": 64, "from": "w8a16", "to": "fp8"}]
    assert "best sheet flips from w8a16 at batch 8 to fp8 at batch 64" in serving_table(packet)
