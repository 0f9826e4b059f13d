"""Modeled decode of Llama3-8B on an H100 against TensorRT Model Optimizer's published table.

    python benchmarks/decode_model.py [--markdown] [--context 2048]
    python benchmarks/decode_model.py --end-to-end [--markdown]   # h200, 2048 in, 128 out
    python benchmarks/decode_model.py --fit-weight-only           # the sheets' 0.55

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

End to end (`--end-to-end`): ModelOpt's later table states its scenario, so it is priced as
run: @prefill of 2048 tokens at batch B, then 127 decode steps (serving.generation_time), on
`h200`; tokens/s is B x 128 over the total, as trtllm-bench reports output throughput
(benchmark.md at nvidia-modelopt 0.21.1: TensorRT-LLM 0.15, H200, Llama3.1-8B, the same shape
as Llama3-8B; speedup over BF16). The prefill of a w4a16 plan is compute-bound, so this table
prices the runtime's weight-only GEMM, the sheets' `weight_only_fraction`; `--fit-weight-only`
reprices the w4a16 plan over fractions 0.30 .. 1.00 and prints the squared log error of its
three speedups against the table: the sheets' 0.55 is its minimum.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import replace
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
# benchmark.md at nvidia-modelopt 0.21.1 (H200, 2048 input and 128 output tokens): BF16 tokens/s,
# FP8's and INT4-AWQ's speedup over it, at batch 1, 8 and 64.
PUBLISHED_E2E = {1: (173.80, 1.41, 1.33), 8: (803.11, 1.31, 0.75), 64: (1679.74, 1.30, 0.83)}
PROMPT, GENERATE = 2048, 128
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


def plan(path: Path, fmt: str, folder: Path, phase: str | None = "decode"):
    """`fmt`'s plan of the module at `path`: of its @decode or @prefill alone (the other is
    dropped: the same weights), or of both with `phase=None` (an end-to-end figure)."""
    module = parse_file(path)
    if phase is not None:
        del module.functions["prefill" if phase == "decode" else "decode"]
    heads, linears = set(), set()
    for f in module.functions.values():
        head = [f.op_name(n) for n in f.ops() if f.op(n) == "mp.matmul"][-1]
        heads.add(head)
        linears |= {f.op_name(n) for n, _ in weight_matmuls(f) if f.op_name(n) != head}
    sheet = folder / f"{fmt}.toml"
    keep = folder / f"{fmt}-head.toml"
    base = SHEET.format(name=fmt)
    if fmt == "fp8":  # the Linear layers (a matmul by a weight); attention's stay bf16
        sheet.write_text(base + "".join(LINEAR.format(name=name) for name in sorted(linears)))
        pipeline = f"assign-precision{{policy={sheet}}},insert-casts"
    elif fmt == "w4a16":  # quantize what is planned below f32: all but the head, then re-plan
        keep.write_text(base + "".join(HEAD.format(head=h, fmt="f32") for h in sorted(heads)))
        sheet.write_text(base)
        pipeline = (f"assign-precision{{policy={keep}}},quantize{{scheme=w4a16 group=128}},"
                    f"assign-precision{{policy={sheet}}},insert-casts")
    else:
        sheet.write_text(base)
        pipeline = f"assign-precision{{policy={sheet}}},insert-casts"
    PassManager(parse_pipeline(pipeline)).run(module, PassContext())
    return module


def at_32_layers(one: float, two: float) -> float:
    """A figure of the 32-layer model from those of the 1- and 2-layer plans (affine)."""
    return one + 31 * (two - one)


def generation(modules: dict[int, object], target, batch: int) -> float:
    """Total seconds for GENERATE tokens after a PROMPT-token prompt at 32 layers."""
    return at_32_layers(*(serving.generation_time(modules[n], target, batch, PROMPT,
                                                  GENERATE)[1] for n in (1, 2)))


def with_weight_only(target, fraction: float):
    """`target` with `weight_only_fraction` of its 16-bit formats set to `fraction`."""
    formats = {k: replace(v, weight_only_fraction=fraction) if k in ("bf16", "f16") else v
               for k, v in target.formats.items()}
    return replace(target, formats=formats)


def end_to_end(args) -> int:
    target = load_target(args.target or "h200")
    batches = sorted(PUBLISHED_E2E)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = {n: decode_module(folder, n, PROMPT, seq=PROMPT) for n in (1, 2)}
        fmts = ("bf16", "w4a16") if args.fit_weight_only else ("bf16", "fp8", "w4a16")
        modules = {f: {n: plan(paths[n], f, folder, None) for n in (1, 2)} for f in fmts}
    if args.fit_weight_only:  # bf16 has no weight-only GEMM: price it once
        bf16 = {b: generation(modules["bf16"], target, b) for b in batches}
        print("fraction  " + "  ".join(f"speedup@{b}" for b in batches) + "  sq-log-error")
        for fraction in [x / 100 for x in range(30, 101, 5)]:
            t = with_weight_only(target, fraction)
            speedup = {b: bf16[b] / generation(modules["w4a16"], t, b) for b in batches}
            err = sum(math.log(speedup[b] / PUBLISHED_E2E[b][2]) ** 2 for b in batches)
            print(f"{fraction:8.2f}  " + "  ".join(f"{speedup[b]:10.2f}" for b in batches)
                  + f"  {err:12.4f}")
        return 0
    total = {(f, b): generation(modules[f], target, b) for f in fmts for b in batches}
    head = ["batch", "bf16 tokens/s", "fp8 speedup", "w4a16 speedup", "best"]
    rows = []
    for b in batches:
        tps, fp8, w4 = PUBLISHED_E2E[b]
        bf16 = b * GENERATE / total["bf16", b]
        s8, s4 = (total["bf16", b] / total[f, b] for f in ("fp8", "w4a16"))
        rows.append([str(b), f"{bf16:.0f} ({tps:.0f}, {(bf16 / tps - 1) * 100:+.0f}%)",
                     f"{s8:.2f} ({fp8:.2f}, {(s8 / fp8 - 1) * 100:+.0f}%)",
                     f"{s4:.2f} ({w4:.2f}, {(s4 / w4 - 1) * 100:+.0f}%)",
                     f"{'fp8' if s8 > s4 else 'w4a16'} ({'fp8' if fp8 > w4 else 'w4a16'})"])
    print_table(head, rows, args.markdown)
    return 0


def print_table(head: list[str], rows: list[list[str]], markdown: bool) -> None:
    sep = " | " if markdown else "  "
    lines = [head, ["---"] * len(head)] if markdown else [head]
    for r in lines + rows:
        print(("| " if markdown else "") + sep.join(r) + (" |" if markdown else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--target", help="a built-in target or a sheet (default: h100; h200 "
                                     "with --end-to-end and --fit-weight-only)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--check-layers", action="store_true",
                    help="also price the 32-layer bf16 plan and compare the extrapolation")
    ap.add_argument("--end-to-end", action="store_true",
                    help="prefill + decode against ModelOpt's H200 table (2048 in, 128 out)")
    ap.add_argument("--fit-weight-only", action="store_true",
                    help="sweep the h200 sheet's weight_only_fraction against that table")
    args = ap.parse_args(argv)
    if args.end_to_end or args.fit_weight_only:
        return end_to_end(args)
    target = load_target(args.target or "h100")
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
                itl[fmt, b] = at_32_layers(one, two)
            w1, w2 = (sum(g.weight_bytes for g in steps[n][1].cost.groups) for n in (1, 2))
            weights[fmt] = at_32_layers(w1, w2)
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
    print_table(head, rows, args.markdown)
    best = {b: max(("fp8", "w4a16"), key=lambda f: itl["bf16", b] / itl[f, b]) for b in batches}
    print(f"\ncontext {args.context}; weights read per step: "
          + ", ".join(f"{f} {w / 1e9:.2f} GB" for f, w in weights.items())
          + "; best format by batch: " + ", ".join(f"{b}: {f}" for b, f in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
