"""Modeled decode of Llama3-8B on an H100 against TensorRT Model Optimizer's published table.

    python benchmarks/decode_model.py [--markdown] [--context 2048]

The model is imported from its config.json alone (`mplower import --shapes-only`: the published
Llama3-8B shape, no weights), lowered to three serving plans and priced one decode step at a
time (mplower.lowering.serving) on the h100 target:

- bf16: contractions in bf16, the KV cache stored in bf16 (the baseline; the table's is FP16,
  the same speed on an H100);
- fp8: the projections and MLP in f8E4M3FN (ModelOpt's FP8: weights and activations of the
  Linear layers), attention's products and the KV cache bf16;
- w4a16: `quantize{scheme=w4a16 group=128}`, ModelOpt's INT4-AWQ layout (4-bit weights, one
  scale per 128 inputs, compute in 16 bits).

As ModelOpt's default configurations do, lm_head stays in 16 bits in every plan. The weights of
a shapes-only import read as zeros, and quantizing 8 billion of them in float64 (what the
quantize pass does) does not fit this machine, so each plan is built for 1 and for 2 layers and
priced at 32 = 1 + 31 x (2 - 1) layers: every layer is the same kernels at the same shapes, so
the model's time is affine in the layer count (checked here against the 32-layer bf16 plan).

Published figures: github.com/NVIDIA/TensorRT-Model-Optimizer, benchmark.md (nvidia-modelopt
0.15.0, TensorRT-LLM 0.11, H100, Llama3-8B, "full batch inference", speedup over FP16); its
sequence lengths are not stated, so the context priced is an assumption (--context).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from mplower.cli.main import main as mplower
from mplower.hf.blocks import weight_matmuls
from mplower.ir.parser import parse_file
from mplower.lowering import serving
from mplower.lowering.target import load_target
from mplower.pass_manager import PassContext, PassManager, parse_pipeline

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "vocab_size": 128256, "max_position_embeddings": 8192,
             "tie_word_embeddings": False}
# Speedup over FP16 (and FP8's and INT4-AWQ's tokens/s) at batch 1, 32, 64.
PUBLISHED = {1: {"fp8": (1.26, 175.42), "w4a16": (1.53, 213.45)},
             32: {"fp8": (1.49, 3399.84), "w4a16": (1.11, 2546.12)},
             64: {"fp8": (1.34, 3311.03), "w4a16": (1.39, 3438.08)}}
MODELED_ONLY = (128, 256)  # beyond the table: where the model's best format changes
SHEET = """[policy]
name = "serve-{name}"
compute = "bf16"
allow = ["@contraction"]
follow = ["@data-movement", "@value-preserving", "@activation", "mp.add", "mp.mul",
          "mp.sigmoid"]
deny = ["mp.softmax", "mp.rms_norm"]
keep_io_types = false
[[override]]  # the KV cache is stored in bf16
op = "mp.concat"
compute = "bf16"
"""
LINEAR = '[[override]]\nname = "{name}"\ncompute = "f8E4M3FN"\n'
HEAD = '[[override]]  # lm_head: not quantized\nname = "{head}"\ncompute = "{fmt}"\n'


def decode_module(folder: Path, layers: int, context: int, config: dict = LLAMA3_8B,
                  name: str = "llama3-8b", seq: int = 16) -> Path:
    """The shapes-only import of `config` with `layers` layers: @prefill of `seq` tokens and
    @decode at `context`."""
    ckpt = folder / f"{name}-{layers}"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers}))
    out = folder / f"{name}-l{layers}.ir"
    rc = mplower(["import", str(ckpt), "-o", str(out), "--shapes-only", "--seq", str(seq),
                  "--context", str(context)])
    assert rc == 0
    return out


def plan(path: Path, fmt: str, folder: Path, phase: str = "decode"):
    module = parse_file(path)
    del module.functions["prefill" if phase == "decode" else "decode"]  # the same weights
    decode = module.functions[phase]
    head = [decode.op_name(n) for n in decode.ops() if decode.op(n) == "mp.matmul"][-1]
    sheet = folder / f"{fmt}.toml"
    keep = folder / f"{fmt}-head.toml"
    base = SHEET.format(name=fmt)
    if fmt == "fp8":  # the Linear layers (a matmul by a weight); attention's stay bf16
        linears = [decode.op_name(n) for n, _ in weight_matmuls(decode)
                   if decode.op_name(n) != head]
        sheet.write_text(base + "".join(LINEAR.format(name=name) for name in linears))
        pipeline = f"assign-precision{{policy={sheet}}},insert-casts"
    elif fmt == "w4a16":  # quantize what is planned below f32: all but the head, then re-plan
        keep.write_text(base + HEAD.format(head=head, fmt="f32"))
        sheet.write_text(base)
        pipeline = (f"assign-precision{{policy={keep}}},quantize{{scheme=w4a16 group=128}},"
                    f"assign-precision{{policy={sheet}}},insert-casts")
    else:
        sheet.write_text(base)
        pipeline = f"assign-precision{{policy={sheet}}},insert-casts"
    PassManager(parse_pipeline(pipeline)).run(module, PassContext())
    return module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--check-layers", action="store_true",
                    help="also price the 32-layer bf16 plan and compare the extrapolation")
    args = ap.parse_args(argv)
    target = load_target("h100")
    batches = [*sorted(PUBLISHED), *MODELED_ONLY]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = {n: decode_module(folder, n, args.context) for n in (1, 2)}
        itl: dict[tuple[str, int], float] = {}
        weights: dict[str, int] = {}
        for fmt in ("bf16", "fp8", "w4a16"):
            steps = {n: {b: serving.price(plan(paths[n], fmt, folder), "decode", target, b,
                                          args.context) for b in batches} for n in (1, 2)}
            for b in batches:
                one, two = steps[1][b].time_s, steps[2][b].time_s
                itl[fmt, b] = one + 31 * (two - one)
            w1, w2 = (sum(g.weight_bytes for g in steps[n][1].cost.groups) for n in (1, 2))
            weights[fmt] = w1 + 31 * (w2 - w1)
        if args.check_layers:
            full = plan(decode_module(folder, 32, args.context), "bf16", folder)
            exact = serving.price(full, "decode", target, 1, args.context).time_s
            print(f"32-layer bf16 at batch 1: {exact * 1e3:.4f} ms priced, "
                  f"{itl['bf16', 1] * 1e3:.4f} ms extrapolated", file=sys.stderr)
    rows = []
    for b in MODELED_ONLY:
        base = itl["bf16", b]
        rows += [[str(b), fmt, f"{itl[fmt, b] * 1e3:.2f}", f"{b / itl[fmt, b]:.0f}", "-", "-",
                  f"{base / itl[fmt, b]:.2f}", "-", "-"] for fmt in ("bf16", "fp8", "w4a16")]
    for b in sorted(PUBLISHED):
        fp16_tps = sum(PUBLISHED[b][f][1] / PUBLISHED[b][f][0] for f in ("fp8", "w4a16")) / 2
        base = b / itl["bf16", b]
        rows.append([str(b), "bf16", f"{itl['bf16', b] * 1e3:.2f}", f"{base:.0f}",
                     f"{fp16_tps:.0f}", f"{(base / fp16_tps - 1) * 100:+.0f}%", "1.00", "1.00",
                     "-"])
        for fmt in ("fp8", "w4a16"):
            speedup = itl["bf16", b] / itl[fmt, b]
            want, tps = PUBLISHED[b][fmt]
            rows.append([str(b), fmt, f"{itl[fmt, b] * 1e3:.2f}", f"{b / itl[fmt, b]:.0f}",
                         f"{tps:.0f}", f"{(b / itl[fmt, b] / tps - 1) * 100:+.0f}%",
                         f"{speedup:.2f}", f"{want:.2f}", f"{(speedup / want - 1) * 100:+.0f}%"])
    rows = rows[3 * len(MODELED_ONLY):] + rows[:3 * len(MODELED_ONLY)]
    head = ["batch", "plan", "ITL ms", "tokens/s", "published tokens/s", "error",
            "speedup", "published speedup", "error"]
    sep = " | " if args.markdown else "  "
    lines = [head, ["---"] * len(head)] if args.markdown else [head]
    for r in lines + rows:
        print(("| " if args.markdown else "") + sep.join(r) + (" |" if args.markdown else ""))
    best = {b: max(("fp8", "w4a16"), key=lambda f: itl["bf16", b] / itl[f, b]) for b in batches}
    print(f"\ncontext {args.context}; weights read per step: "
          + ", ".join(f"{f} {w / 1e9:.2f} GB" for f, w in weights.items())
          + "; best format by batch: " + ", ".join(f"{b}: {f}" for b, f in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
