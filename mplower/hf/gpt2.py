"""GPT2LMHeadModel as mp ops.

The math follows transformers' modeling_gpt2.py: token plus learned position embeddings,
pre-LayerNorm blocks (ln_1, attention, ln_2, MLP) with residuals, Conv1D layers whose weights are
stored [in, out] (c_attn projects to q, k and v at once), the activation `activation_function`
(gelu_new: the tanh approximation), ln_f, and lm_head tied to the token embedding. Hub
checkpoints name tensors with or without the `transformer.` prefix; both are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mplower.hf.build import Builder
from mplower.hf.config import Config
from mplower.hf.safetensors import Checkpoint
from mplower.ir.graph import Value

ARCHITECTURES = ("GPT2LMHeadModel",)
# activation_function -> mp.gelu's `approximate`
ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class GPT2:
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    eps: float
    approximate: str
    scale_weights: bool
    scale_by_layer: bool
    tied: bool
    max_positions: int
    prefix: str  # "transformer." or ""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def cache_shape(self) -> tuple[int, int]:
        return self.heads, self.head_dim


def read_config(cfg: Config, arch: str, ckpt: Checkpoint | None) -> GPT2:
    act = cfg.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise cfg.error(f"config.json: activation_function {act!r} is not supported (mplower "
                        f"imports {', '.join(ACTIVATIONS)})")
    hidden, heads = cfg.int("n_embd"), cfg.int("n_head")
    if hidden % heads:
        raise cfg.error(f"config.json: n_embd {hidden} is not a multiple of n_head {heads}")
    return GPT2(
        vocab=cfg.int("vocab_size"), hidden=hidden, inter=cfg.int("n_inner", 4 * hidden),
        layers=cfg.int("n_layer"), heads=heads, eps=cfg.float("layer_norm_epsilon", 1e-5),
        approximate=ACTIVATIONS[act], scale_weights=cfg.flag("scale_attn_weights", True),
        scale_by_layer=cfg.flag("scale_attn_by_inverse_layer_idx", False),
        tied=cfg.flag("tie_word_embeddings", True), max_positions=cfg.int("n_positions"),
        prefix="transformer." if ckpt is not None and "transformer.wte.weight" in ckpt
        else "")


def forward(b: Builder, m: GPT2, ids: Value, past: list[tuple[Value, Value]] | None,
            start: int) -> tuple[Value, list[tuple[Value, Value]]]:
    """As mplower.hf.llama.forward, for GPT-2."""
    s = b.shape(ids)[1]
    p, d = m.prefix, m.head_dim
    wte = b.tensor_of(p + "wte.weight", (m.vocab, m.hidden))
    wpe = m.prefix + "wpe.weight"
    b.checked(wpe, (m.max_positions, m.hidden))
    ckpt = b.ckpt
    # The rows of the positions this function covers, as their own constant.
    pos = b.constant(f"{wpe}[{start}:{start + s}]", None, (s, m.hidden),
                     lambda: ckpt.float32(wpe)[start:start + s].copy())
    x = b.emit("mp.add", [b.emit("mp.gather", [wte, ids], {"axis": 0}, hint="embed"), pos])
    mask = b.causal_mask(s, start)
    presents = []
    for i in range(m.layers):
        h = f"{p}h.{i}."
        y = _layer_norm(b, m, x, h + "ln_1")
        qkv = b.linear(y, h + "attn.c_attn.weight", m.hidden, 3 * m.hidden,
                       h + "attn.c_attn.bias", conv1d=True)
        q, k, v = (b.heads(b.slice_last(qkv, j * m.hidden, (j + 1) * m.hidden), m.heads, d)
                   for j in range(3))
        if past is not None:
            k = b.emit("mp.concat", [past[i][0], k], {"axis": 2}, hint=f"present.{i}.key")
            v = b.emit("mp.concat", [past[i][1], v], {"axis": 2}, hint=f"present.{i}.value")
        presents.append((k, v))
        scale = (1.0 / math.sqrt(d) if m.scale_weights else 1.0) / (
            i + 1 if m.scale_by_layer else 1)
        o = b.attention(q, k, v, scale, mask)
        o = b.linear(o, h + "attn.c_proj.weight", m.hidden, m.hidden, h + "attn.c_proj.bias",
                     conv1d=True)
        x = b.emit("mp.add", [x, o])
        y = _layer_norm(b, m, x, h + "ln_2")
        y = b.linear(y, h + "mlp.c_fc.weight", m.hidden, m.inter, h + "mlp.c_fc.bias",
                     conv1d=True)
        y = b.emit("mp.gelu", [y], {"approximate": m.approximate})
        y = b.linear(y, h + "mlp.c_proj.weight", m.inter, m.hidden, h + "mlp.c_proj.bias",
                     conv1d=True)
        x = b.emit("mp.add", [x, y])
    x = _layer_norm(b, m, x, p + "ln_f")
    # A tied head is the embedding table transposed, stored under the head's own name.
    head = p + "wte.weight" if m.tied else "lm_head.weight"
    return b.linear(x, head, m.hidden, m.vocab, key="lm_head.weight"), presents


def _layer_norm(b: Builder, m: GPT2, x: Value, name: str) -> Value:
    g = b.tensor_of(name + ".weight", (m.hidden,))
    beta = b.tensor_of(name + ".bias", (m.hidden,))
    return b.emit("mp.layer_norm", [x, g, beta], {"axis": 2, "epsilon": m.eps})
