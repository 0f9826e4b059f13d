"""A compressed-tensors checkpoint from `mplower export` loaded by transformers, beside mplower.

Run with a Python that has torch, transformers and compressed-tensors (never mplower's own
dependencies):

    python benchmarks/transformers_load.py OUT_DIR IDS.npz OURS.npz

OUT_DIR is the exported folder, IDS.npz holds `input_ids` [B, S], OURS.npz the `output_0`
(logits) of `mplower run LOWERED.ir --func prefill --inputs IDS.npz --save-outputs OURS.npz`.
transformers reads `quantization_config`, builds the model through compressed-tensors (the path
vLLM's loader shares), decompresses every layer and runs the prompt in f32; the script prints
how far its logits are from mplower's (docs/export-checkpoint.md quotes the figure).
"""

from __future__ import annotations

import sys
import time

import numpy as np


def main(folder: str, ids_path: str, ours_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    loaded = time.perf_counter() - start
    ids = torch.tensor(np.load(ids_path)["input_ids"])
    with torch.no_grad():
        theirs = model(ids).logits.numpy()
    ours = np.load(ours_path)["output_0"]
    diff = float(np.abs(theirs - ours).max())
    print(f"{type(model).__name__} loaded in {loaded:.1f} s; logits max |transformers - "
          f"mplower| = {diff:.3g} (max |logit| {float(np.abs(ours).max()):.3g})")


if __name__ == "__main__":
    main(*sys.argv[1:4])
