"""Writes tiny_llama.ir and tiny_llama.npz here: a one-layer Llama (GQA, RoPE, RMSNorm, SwiGLU)
with random weights, imported from a checkpoint folder this script writes with numpy alone, for
`--seq 4` prompts and decode steps after 4 cached positions. The KV-cache passes' examples
(docs/passes.md) run on it.

    python ir_examples/llm/make_tiny_llama.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 32,
          "max_position_embeddings": 64, "tie_word_embeddings": True}


def main() -> None:
    rng = np.random.default_rng(0)
    h, i, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    kv = CONFIG["num_key_value_heads"] * h // CONFIG["num_attention_heads"]
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
              p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
              p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
              p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
              p + "mlp.down_proj.weight": (h, i)}
    header, data = {}, b""
    for name, shape in shapes.items():  # safetensors: u64 length, JSON header, data
        raw = (rng.standard_normal(shape) * 0.3).astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-llama"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(CONFIG))
        (folder / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head
                                                   + data)
        subprocess.run([sys.executable, "-m", "mplower", "import", str(folder), "-o",
                        str(HERE / "tiny_llama.ir"), "--batch", "1", "--seq", "4"], check=True)


if __name__ == "__main__":
    main()
