"""HuggingFace checkpoint folders (config.json + *.safetensors) to mplower modules.

`import_checkpoint` reads config.json as data, checks every safetensors header against its file
(mplower.hf.safetensors; nothing is executed, nothing outside the folder is read), and builds a
module of two functions with static shapes and the KV cache as explicit values:

- `@prefill(%input_ids: BxS i64) -> (logits BxSxV, present.{i}.key, present.{i}.value, ...)`,
  the prompt's pass, each layer's keys and values [B, kv_heads, S, head_dim];
- `@decode(%input_ids: Bx1 i64, past_key_values.{i}.key/value with C positions) -> (logits
  Bx1xV, present.{i}.key/value with C + 1 positions)`, one step at position C.

Both read the same named weights (f32, bf16 and f16 widened exactly), produced one at a time
when the caller writes them (`Imported.weights` is lazy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mplower.dialect.plan import SHAPES_ONLY
from mplower.hf import gpt2, llama
from mplower.hf.build import Builder
from mplower.hf.config import Config
from mplower.hf.safetensors import Checkpoint, inside
from mplower.ir.diagnostics import Location
from mplower.ir.graph import Module, Value
from mplower.ir.types import tensor
from mplower.ir.verifier import verify

ARCHITECTURES = llama.ARCHITECTURES + gpt2.ARCHITECTURES


@dataclass
class Imported:
    module: Module
    weights: Mapping[str, np.ndarray]  # npz contents, each array made when read
    architecture: str


def is_checkpoint(path: str | Path) -> bool:
    """A folder: what `mplower import` reads as a checkpoint rather than an ONNX file."""
    return Path(path).is_dir()


def import_checkpoint(folder: str | Path, batch: int, seq: int, context: int,
                      shapes_only: bool = False) -> Imported:
    """The module of the checkpoint in `folder` for `batch` sequences, prompts of `seq` tokens
    and decode steps after `context` cached positions. With `shapes_only`, from config.json
    alone: no safetensors is read, and the module's weights are names without values (what a
    cost model needs of a model too large to copy around; mplower.dialect.plan.SHAPES_ONLY)."""
    folder = Path(folder)
    loc = Location(str(folder), 0, 0)
    cfg = Config(inside(folder, "config.json", "file", folder))
    arch = cfg.architecture()
    if arch not in ARCHITECTURES:
        raise cfg.error(f"architecture '{arch}' is not supported; mplower imports "
                        f"{', '.join(ARCHITECTURES)}")
    ckpt = None if shapes_only else Checkpoint(folder)
    family = gpt2 if arch in gpt2.ARCHITECTURES else llama
    model = (gpt2.read_config(cfg, arch, ckpt) if family is gpt2
             else llama.read_config(cfg, arch))
    longest = max(seq, context + 1)
    if longest > model.max_positions:
        raise cfg.error(f"{longest} positions (--seq {seq}, --context {context}) exceed the "
                        f"model's {model.max_positions} (max_position_embeddings or n_positions)")
    window = cfg.get("sliding_window") if arch == "MistralForCausalLM" else None
    if isinstance(window, int) and longest > window:
        raise cfg.error(f"{longest} positions exceed sliding_window {window}; mplower imports "
                        f"full attention only")
    b = Builder(ckpt, loc)
    module = Module(name=None, path=str(folder), loc=loc)
    heads, head_dim = model.cache_shape
    ids_t = tensor((batch, seq), "i64")
    (ids,) = b.start("prefill", [("input_ids", ids_t)])
    logits, presents = family.forward(b, model, ids, None, 0)
    module.functions["prefill"] = b.finish(_results(logits, presents))
    cache_t = tensor((batch, heads, context, head_dim), "f32")
    args = [("input_ids", tensor((batch, 1), "i64"))]
    for i in range(len(presents)):
        args += [(f"past_key_values.{i}.key", cache_t), (f"past_key_values.{i}.value", cache_t)]
    values = b.start("decode", args)
    past = list(zip(values[1::2], values[2::2], strict=True))
    logits, presents = family.forward(b, model, values[0], past, context)
    module.functions["decode"] = b.finish(_results(logits, presents))
    verify(module)
    if shapes_only:
        module.attrs[SHAPES_ONLY] = True
        return Imported(module, {}, arch)
    return Imported(module, b.weights, arch)


def _results(logits: Value, presents: list[tuple[Value, Value]]) -> list[tuple[str, Value]]:
    out = [("logits", logits)]
    for i, (k, v) in enumerate(presents):
        out += [(f"present.{i}.key", k), (f"present.{i}.value", v)]
    return out
