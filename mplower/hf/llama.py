"""The Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) as mp ops.

The math follows transformers' modeling_llama.py: RMSNorm before attention and MLP, grouped-query
attention (num_key_value_heads), rotary embeddings on queries and keys (rotate_half form, the
cos/sin tables of the positions a function covers computed here in float64 from rope_theta and
rope_scaling and rounded once to f32), SwiGLU MLP (down(silu(gate(x)) * up(x))), a final RMSNorm
and lm_head (the embedding table when tie_word_embeddings). Qwen2 has q/k/v biases; Llama's
`attention_bias` adds them to all four projections and `mlp_bias` to the MLP's. The cache holds
keys after rotation, as HF's DynamicCache does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mplower.hf.build import Builder
from mplower.hf.config import Config
from mplower.ir.graph import Value

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Llama:
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    inv_freq: np.ndarray  # float64 [head_dim / 2]
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_positions: int

    @property
    def cache_shape(self) -> tuple[int, int]:
        """(heads, head_dim) of one layer's keys and values."""
        return self.kv_heads, self.head_dim


def read_config(cfg: Config, arch: str) -> Llama:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise cfg.error(f"config.json: hidden_act {act!r} is not supported (the {arch} MLP "
                        f"mplower imports is SwiGLU with silu)")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise cfg.error("config.json: partial_rotary_factor other than 1 is not supported")
    if cfg.get("use_sliding_window", False):
        raise cfg.error("config.json: use_sliding_window is not supported")
    hidden = cfg.int("hidden_size")
    heads = cfg.int("num_attention_heads")
    kv_heads = cfg.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise cfg.error(f"config.json: num_attention_heads {heads} is not a multiple of "
                        f"num_key_value_heads {kv_heads}")
    head_dim = cfg.int("head_dim", hidden // heads)
    if head_dim % 2:
        raise cfg.error(f"config.json: head_dim {head_dim} is odd; rotary embeddings pair "
                        f"its halves")
    qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = cfg.flag("attention_bias", False)
    return Llama(
        vocab=cfg.int("vocab_size"), hidden=hidden, inter=cfg.int("intermediate_size"),
        layers=cfg.int("num_hidden_layers"), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        eps=cfg.float("rms_norm_eps", 1e-6), inv_freq=inverse_frequencies(cfg, head_dim),
        tied=cfg.flag("tie_word_embeddings", False), qkv_bias=qwen2 or attention_bias,
        o_bias=attention_bias and not qwen2, mlp_bias=cfg.flag("mlp_bias", False),
        max_positions=cfg.int("max_position_embeddings", 2048))


def inverse_frequencies(cfg: Config, dim: int) -> np.ndarray:
    """RoPE's inverse frequencies in float64, after rope_scaling (transformers'
    modeling_rope_utils: _compute_default_rope_parameters, _compute_linear_scaling_rope_parameters,
    _compute_llama3_parameters)."""
    # transformers 5 writes `rope_parameters` (rope_type, rope_theta and the scaling fields in
    # one object); earlier versions `rope_theta` and `rope_scaling` apart.
    key = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    scaling = cfg.get(key, {})
    if not isinstance(scaling, dict):
        raise cfg.error(f"config.json: {key} is {scaling!r}, not an object")

    def number(field: str, default: float | None = None) -> float:
        value = scaling.get(field, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise cfg.error(f"config.json: {key} '{field}' is {value!r}, not a positive number")
        return float(value)

    theta = number("rope_theta", cfg.float("rope_theta", 10000.0))
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise cfg.error(f"config.json: {key} type {kind!r} is not supported (mplower "
                        f"imports {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return inv
    factor = number("factor")
    if kind == "linear":
        return inv / factor
    low, high = number("low_freq_factor", 1.0), number("high_freq_factor", 4.0)
    if high <= low:
        raise cfg.error(f"config.json: {key} high_freq_factor must exceed low_freq_factor")
    old = number("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, smoothed, scaled)


def forward(b: Builder, m: Llama, ids: Value, past: list[tuple[Value, Value]] | None,
            start: int) -> tuple[Value, list[tuple[Value, Value]]]:
    """Logits [B, S, vocab] and each layer's present keys and values [B, kv_heads, start + S,
    head_dim] for tokens `ids` [B, S] at positions start.. after `past` (start of them)."""
    x = embed(b, m, ids)
    tables = position_tables(b, m, start, b.shape(ids)[1])
    presents = []
    for i in range(m.layers):
        x, kv = layer(b, m, x, i, tables, past[i] if past is not None else None)
        presents.append(kv)
    return head(b, m, x), presents


def embed(b: Builder, m: Llama, ids: Value) -> Value:
    """The token embeddings [B, S, hidden] of `ids` [B, S]."""
    emb = b.tensor_of("model.embed_tokens.weight", (m.vocab, m.hidden))
    return b.emit("mp.gather", [emb, ids], {"axis": 0}, hint="embed")


def position_tables(b: Builder, m: Llama, start: int, s: int) -> tuple[Value, Value,
                                                                          Value | None]:
    """The rotary cos and sin and the causal mask of positions start..start+S-1."""
    cos, sin = _rotary(b, m, start, s)
    return cos, sin, b.causal_mask(s, start)


def layer(b: Builder, m: Llama, x: Value, i: int, tables: tuple[Value, Value, Value | None],
          past: tuple[Value, Value] | None) -> tuple[Value, tuple[Value, Value]]:
    """Decoder layer `i` on the residual stream `x` [B, S, hidden]: the new stream and the
    layer's present keys and values (after `past`'s, when given)."""
    cos, sin, mask = tables
    p = f"model.layers.{i}."
    h = _norm(b, m, x, p + "input_layernorm.weight")
    q, k, v = (b.heads(_proj(b, m, h, p, name, n, m.qkv_bias), n, m.head_dim)
               for name, n in (("q", m.heads), ("k", m.kv_heads), ("v", m.kv_heads)))
    q, k = _rotate(b, q, cos, sin), _rotate(b, k, cos, sin)
    if past is not None:
        k = b.emit("mp.concat", [past[0], k], {"axis": 2}, hint=f"present.{i}.key")
        v = b.emit("mp.concat", [past[1], v], {"axis": 2}, hint=f"present.{i}.value")
    o = b.attention(q, k, v, 1.0 / math.sqrt(m.head_dim), mask)
    o = b.linear(o, p + "self_attn.o_proj.weight", m.heads * m.head_dim, m.hidden,
                 p + "self_attn.o_proj.bias" if m.o_bias else None)
    x = b.emit("mp.add", [x, o])
    h = _norm(b, m, x, p + "post_attention_layernorm.weight")
    gate = _mlp_linear(b, m, h, p + "mlp.gate_proj", m.hidden, m.inter)
    silu = b.emit("mp.mul", [gate, b.emit("mp.sigmoid", [gate])])
    up = _mlp_linear(b, m, h, p + "mlp.up_proj", m.hidden, m.inter)
    y = _mlp_linear(b, m, b.emit("mp.mul", [silu, up]), p + "mlp.down_proj", m.inter, m.hidden)
    return b.emit("mp.add", [x, y]), (k, v)


def head(b: Builder, m: Llama, x: Value) -> Value:
    """The final norm and lm_head: logits [B, S, vocab] of the stream `x`."""
    x = _norm(b, m, x, "model.norm.weight")
    # A tied head is the embedding table transposed, stored under the head's own name.
    head = "model.embed_tokens.weight" if m.tied else "lm_head.weight"
    return b.linear(x, head, m.hidden, m.vocab, key="lm_head.weight")


def _norm(b: Builder, m: Llama, x: Value, weight: str) -> Value:
    g = b.tensor_of(weight, (m.hidden,))
    return b.emit("mp.rms_norm", [x, g], {"axis": 2, "epsilon": m.eps})


def _mlp_linear(b: Builder, m: Llama, x: Value, name: str, n_in: int, n_out: int) -> Value:
    return b.linear(x, name + ".weight", n_in, n_out, name + ".bias" if m.mlp_bias else None)


def _proj(b: Builder, m: Llama, h: Value, p: str, name: str, heads: int, bias: bool) -> Value:
    w = f"{p}self_attn.{name}_proj."
    return b.linear(h, w + "weight", m.hidden, heads * m.head_dim, w + "bias" if bias else None)


def _rotary(b: Builder, m: Llama, start: int, s: int) -> tuple[Value, Value]:
    """cos and signed sin [S, head_dim] of positions start..start+S-1: x * cos + swap(x) * sin,
    where swap exchanges the halves, is HF's x * cos + rotate_half(x) * sin (rotate_half negates
    the half it moves first, so the sign goes into the first half of sin)."""
    angles = np.arange(start, start + s, dtype=np.float64)[:, None] * m.inv_freq[None, :]
    cos = np.cos(np.concatenate([angles, angles], 1)).astype(np.float32)
    sin = np.sin(np.concatenate([-angles, angles], 1)).astype(np.float32)
    shape = (s, m.head_dim)
    return (b.constant(f"rotary.cos.{start}+{s}", cos, shape),
            b.constant(f"rotary.sin.{start}+{s}", sin, shape))


def _rotate(b: Builder, x: Value, cos: Value, sin: Value) -> Value:
    half = b.shape(x)[-1] // 2
    swapped = b.emit("mp.concat", [b.slice_last(x, half, 2 * half), b.slice_last(x, 0, half)],
                     {"axis": 3})
    return b.emit("mp.add", [b.emit("mp.mul", [x, cos]), b.emit("mp.mul", [swapped, sin])])
