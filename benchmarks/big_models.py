"""Models bigger than memory: a Llama-shaped checkpoint of random fp16 weights, imported,
calibrated, quantized and run block by block (`mplower quantize-ckpt`, mplower.hf.blocks),
with its peak RSS and time measured in a fresh process (docs/benchmarks.md, "Bigger than
memory").

    python benchmarks/big_models.py 1.1b              # TinyLlama-1.1B's shape
    python benchmarks/big_models.py 8b --layers 4     # Llama-3-8B's shape, 4 of 32 layers

The checkpoint is written once into ~/.cache/mplower/bench/<shape>-<layers>L/ (seeded random
init, one tensor in memory at a time, never committed); `--delete` removes it afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {  # config.json fields of the public models whose shapes these are
    "1.1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
             "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
             "rope_theta": 10000.0, "max_position_embeddings": 2048},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "rope_theta": 500000.0, "max_position_embeddings": 8192},
}
CACHE = Path(os.environ.get("MPLOWER_BENCH_CACHE", Path.home() / ".cache/mplower/bench"))


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i_, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h)}
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        shapes |= {p + "input_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "post_attention_layernorm.weight": (h,),
                   p + "mlp.gate_proj.weight": (i_, h), p + "mlp.up_proj.weight": (i_, h),
                   p + "mlp.down_proj.weight": (h, i_)}
    return shapes | {"model.norm.weight": (h,), "lm_head.weight": (v, h)}


def generate(folder: Path, cfg: dict, seed: int = 0) -> float:
    """Write config.json and model.safetensors (F16): norms 1, matrices N(0, 0.02^2) as
    HF's initializer_range; one tensor in memory at a time. Returns the seconds it took."""
    start = time.perf_counter()
    shapes = tensor_shapes(cfg)
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.safetensors.partial"
    rng = np.random.default_rng(seed)
    with open(tmp, "wb") as fh:
        fh.write(len(head).to_bytes(8, "little") + head)
        for shape in shapes.values():
            if len(shape) == 1:
                fh.write(np.ones(shape, np.float16).tobytes())
                continue
            for rows in np.array_split(np.arange(shape[0]), max(1, shape[0] * shape[1] >> 26)):
                block = rng.standard_normal((len(rows), shape[1]), np.float32) * 0.02
                fh.write(block.astype(np.float16).tobytes())
    tmp.rename(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False, **cfg}))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's)")
    ap.add_argument("--samples", type=int, default=4, help="calibration sequences")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--pipeline", default="quantize{scheme=w4a16 group=128}",
                    help="what each block takes (mplower quantize-ckpt --pass-pipeline)")
    ap.add_argument("--no-eval", action="store_true", help="calibrate and quantize only")
    ap.add_argument("--delete", action="store_true", help="remove the checkpoint afterwards")
    args = ap.parse_args()
    cfg = dict(SHAPES[args.shape])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    folder = CACHE / f"{args.shape}-{cfg['num_hidden_layers']}L"
    generated = None
    if not (folder / "model.safetensors").exists():
        generated = generate(folder, cfg)
    params = sum(int(np.prod(s)) for s in tensor_shapes(cfg).values())
    ids = np.random.default_rng(1).integers(0, cfg["vocab_size"], (args.samples, args.seq))
    data = folder / f"calib-{args.samples}x{args.seq}.npz"
    np.savez(data, input_ids=ids.astype(np.int64))
    report = folder / "report.json"
    cmd = [sys.executable, "-m", "mplower", "quantize-ckpt", str(folder), "--data", str(data),
           f"--pass-pipeline={args.pipeline}", "--format", "json", "--timing"]
    cmd += ["--no-eval"] if args.no_eval else ["--report", str(report)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB
    if proc.returncode:
        sys.exit(f"quantize-ckpt failed ({proc.returncode}):\n{proc.stderr}")
    summary = json.loads(report.read_text())["summary"] if not args.no_eval else {}
    # quantize-ckpt --timing: "  SECONDS (SHARE%)  BLOCK" per block
    per_block = {line.split()[-1]: float(line.split()[0]) for line in proc.stderr.splitlines()
                 if line.strip().endswith(("embed", "head")) or "layers." in line}
    layers = [t for name, t in per_block.items() if name.startswith("layers.")]
    print(json.dumps({
        "shape": args.shape, "layers": cfg["num_hidden_layers"],
        "parameters": params, "checkpoint_gb": round((folder / "model.safetensors")
                                                     .stat().st_size / 1e9, 2),
        "generate_s": None if generated is None else round(generated, 1),
        "tokens": args.samples * args.seq, "pipeline": args.pipeline,
        "eval": not args.no_eval, "seconds": round(seconds, 1), "peak_rss_gib": round(peak, 2),
        "embed_s": per_block.get("embed"), "head_s": per_block.get("head"),
        "layer_s_mean": round(sum(layers) / len(layers), 2) if layers else None,
        "output_rel_l2": summary.get("output_rel_l2"),
        "top1_agreement": summary.get("top1_agreement"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }, indent=1))
    if args.delete:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
