"""Perplexity of a checkpoint on text, by the prefill path and by the decode path.

The prefill path runs `@prefill` once over the whole text (teacher forcing) and scores the
logits of positions P-1 .. T-2 against the tokens P .. T-1. The decode path is how a server
generates: `@prefill` over the first P tokens (the prompt) gives the logits of position P-1 and
the cache, then one `@decode` step per remaining token (the true token in, as teacher forcing
does) extends the cache and gives the next position's logits. Both score the same T - P tokens
with the same metric (mplower.lowering.metrics.token_nll, in nats; bits per token and
perplexity follow), so they agree to float rounding when the decode step is right, and a
quantized KV cache (quantize-kv) is measured where it matters: on the cache a server keeps.

The imported functions have static shapes, so each decode step of a context C is the
`@decode` of an import for that C (its rotary tables are those of position C); every module
reads one weights file written once for all of them, and the same pass pipeline lowers each.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mplower.backend.executor import Program, reference_runner
from mplower.dialect.plan import WEIGHTS
from mplower.hf import import_checkpoint
from mplower.hf.build import LazyWeights
from mplower.io.npz import save_npz
from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.ir.graph import Module
from mplower.lowering.metrics import token_nll
from mplower.pass_manager import PassContext, PassManager, parse_pipeline
from mplower.passes.insert_casts import materialize

PATHS = ("prefill", "decode")


@dataclass(frozen=True)
class PathScore:
    """The metric of one path over `tokens` scored tokens."""

    path: str
    tokens: int
    nll: float  # mean negative log-likelihood, nats

    @property
    def bits_per_token(self) -> float:
        return self.nll / math.log(2)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    def to_json(self) -> dict[str, float | int]:
        return {"tokens": self.tokens, "nll": self.nll, "bits_per_token": self.bits_per_token,
                "perplexity": self.perplexity}


def byte_tokens(text: str) -> np.ndarray:
    """The text's UTF-8 bytes as token ids [1, T] (a byte-level vocabulary of 256)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)[None, :]


class _Lowered:
    """The checkpoint's modules, imported for the shapes asked, lowered by one pipeline, their
    weights in one file (the union of the imports' weights: checkpoint tensors and the rotary
    tables and masks of each shape)."""

    def __init__(self, folder: Path, batch: int, shapes: Sequence[tuple[int, int]],
                 pipeline: str, workdir: Path):
        self.weights_path = workdir / "model.npz"
        weights = LazyWeights()
        imported = []
        for seq, context in shapes:
            got = import_checkpoint(folder, batch, seq, context)
            for key in got.weights:
                if key not in weights:
                    weights.add(key, lambda w=got.weights, k=key: w[k])
            imported.append(got.module)
        with open(self.weights_path, "wb") as fh:
            save_npz(fh, weights)
        self.modules: list[Module] = []
        for module in imported:
            module.attrs[WEIGHTS] = self.weights_path.name
            module.path = str(workdir / "model.ir")
            if pipeline:
                ctx = PassContext(runner=reference_runner, output_path=module.path)
                PassManager(parse_pipeline(pipeline)).run(module, ctx)
            materialize(module)
            self.modules.append(module)

    def check_vocabulary(self, ids: np.ndarray, where: Location) -> None:
        vocab = self.modules[0].functions["prefill"].result_types[0].shape[-1]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise DiagnosticError.at(where, (
                f"token ids span {ids.min()}..{ids.max()}, but the model's vocabulary has "
                f"{vocab} entries (config.json vocab_size); byte-level text needs at least 256"))

    def run(self, k: int, func: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        program = Program(self.modules[k], func, str(self.weights_path))
        return program.run(inputs, reference=False).outputs


def next_token_logits(folder: str | Path, ids: np.ndarray, prompt: int, path: str,
                      pipeline: str = "") -> np.ndarray:
    """Logits [B, T - prompt, V] of the tokens ids[:, prompt:] by `path` (prefill or decode),
    every module lowered by the pass `pipeline` first."""
    b, t = ids.shape
    where = Location(str(folder), 0, 0)
    if not 1 <= prompt < t:
        raise DiagnosticError.at(where, (
            f"the prompt ({prompt} tokens) must be at least 1 and shorter than the text "
            f"({t} tokens)"))
    with tempfile.TemporaryDirectory(prefix="mplower-ppl-") as tmp:
        if path == "prefill":
            lowered = _Lowered(Path(folder), b, [(t, t - 1)], pipeline, Path(tmp))
            lowered.check_vocabulary(ids, where)
            return lowered.run(0, "prefill", [ids])[0][:, prompt - 1:t - 1]
        # A module per decode step: context c = prompt .. t - 2 (the last token is only scored).
        lowered = _Lowered(Path(folder), b, [(prompt, c) for c in range(prompt, t - 1)]
                           or [(prompt, prompt)], pipeline, Path(tmp))
        lowered.check_vocabulary(ids, where)
        first = lowered.run(0, "prefill", [ids[:, :prompt]])
        logits, cache = [first[0][:, -1:]], first[1:]
        for k, c in enumerate(range(prompt, t - 1)):
            step = lowered.run(k, "decode", [ids[:, c:c + 1], *cache])
            logits.append(step[0])
            cache = step[1:]
        return np.concatenate(logits, axis=1)


def score(folder: str | Path, ids: np.ndarray, prompt: int, paths: Sequence[str] = PATHS,
          pipeline: str = "") -> dict[str, PathScore]:
    """The metric of each path over the tokens after the prompt."""
    ids = np.asarray(ids, dtype=np.int64)
    targets = ids[:, prompt:]
    out = {}
    for path in paths:
        logits = next_token_logits(folder, ids, prompt, path, pipeline)
        out[path] = PathScore(path, int(targets.size), token_nll(logits, targets))
    return out
