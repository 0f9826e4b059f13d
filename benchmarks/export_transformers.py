"""Real Hugging Face transformers through torch.onnx and mplower (issue 16's acceptance run).

Where torch and transformers are installed (they are not mplower dependencies; CI runs the
exporter-pattern models of tests/test_onnx_transformers.py instead), this script builds
BertModel and GPT2Model from small random-init configs (hidden width 64), exports each with
the TorchScript exporter (opset 17) and, when onnxscript is installed, the dynamo exporter,
and for every export:

1. checks that onnxruntime reproduces torch (max abs);
2. `mplower import --input-shape` (every index input static);
3. runs the import in fp32 and compares with onnxruntime (max abs; the bar is 1e-5);
4. counts ops whose operands are all constants (the bar is 0: shape arithmetic is folded);
5. lowers with the bf16 and int8 sheets, runs with a report (verdict, output rel-L2), exports
   the lowered module and runs that in onnxruntime (max abs against mplower's run).

It prints one JSON line per export and a markdown table for docs/benchmarks.md.

    python benchmarks/export_transformers.py [--out DIR] [--seq 16] [--batch 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
PIPELINES = {
    "bf16": "assign-precision{policy=bf16},insert-casts",
    "int8": "assign-precision{policy=int8},calibrate{data=CALIB},quantize,insert-casts",
}


def models(hidden: int):
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model

    bert = BertModel(BertConfig(vocab_size=512, hidden_size=hidden, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=4 * hidden,
                                max_position_embeddings=128, use_cache=False,
                                attn_implementation="eager"))
    gpt2 = GPT2Model(GPT2Config(vocab_size=512, n_embd=hidden, n_layer=2, n_head=4,
                                n_positions=128, use_cache=False,
                                attn_implementation="eager"))
    return {"bert": bert.eval(), "gpt2": gpt2.eval()}


def inputs(name: str, batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 512, (batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    mask[-1, seq - seq // 4:] = 0  # padding at the end of the last sequence
    out = {"input_ids": ids, "attention_mask": mask}
    if name == "bert":
        out["token_type_ids"] = (np.arange(seq) >= seq // 2).astype(np.int64)[None].repeat(batch, 0)
    return out


def export(model, name: str, feeds: dict[str, np.ndarray], path: Path, dynamo: bool) -> None:
    import torch

    names = list(feeds)

    class Positional(torch.nn.Module):
        """The model with its index inputs as positional arguments, in `feeds` order: what
        both exporters trace, without transformers' keyword-only extras (use_cache, ...)."""

        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, *xs):
            return self.inner(**dict(zip(names, xs))).last_hidden_state

    options = {"input_names": names, "output_names": ["last_hidden_state"], "dynamo": dynamo}
    if dynamo:
        options["external_data"] = False
    else:
        options.update(opset_version=17,
                       dynamic_axes={n: {0: "batch", 1: "sequence"} for n in names})
    torch.onnx.export(Positional().eval(), tuple(torch.from_numpy(v) for v in feeds.values()),
                      str(path), **options)


def ort_run(data: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in wanted})


def mplower(*args: object) -> None:
    from mplower.cli.main import main

    rc = main([str(a) for a in args])
    if rc != 0:
        raise RuntimeError(f"mplower {' '.join(map(str, args))} exited {rc}")


def check(name: str, exporter: str, torch_out: np.ndarray, path: Path,
          feeds: dict[str, np.ndarray], work: Path) -> dict:
    import onnx

    from mplower.backend.executor import Program
    from mplower.ir.parser import parse_file

    row: dict = {"model": name, "exporter": exporter}
    data = path.read_bytes()
    reference = ort_run(data, feeds)[0]
    row["ort_vs_torch_max_abs"] = float(np.max(np.abs(reference - torch_out)))
    graph = onnx.load(str(path)).graph
    used = [i.name for i in graph.input if i.name in feeds]
    shapes = [f"--input-shape={n}={'x'.join(map(str, feeds[n].shape))}" for n in used]
    t0 = time.perf_counter()
    mplower("import", path, "-o", work / "m.ir", *shapes)
    row["import_s"] = round(time.perf_counter() - t0, 2)
    module = parse_file(work / "m.ir")
    f = module.function()
    row["all_constant_ops"] = sum(
        1 for n in f.ops() if f.op(n) not in ("mp.constant", "return") and f.operands(n)
        and all(f.op(u) == "mp.constant" for u, _ in f.operands(n)))
    row["ops"] = sum(1 for n in f.ops() if f.op(n) not in ("mp.constant", "return"))
    args = [feeds[n] for n in used]
    ours = Program(module).run(args, reference=False).outputs[0]
    row["fp32_vs_ort_max_abs"] = float(np.max(np.abs(ours - reference)))
    np.savez(work / "in.npz", **{n: feeds[n] for n in used})
    for sheet, pipeline in PIPELINES.items():
        low = work / f"{sheet}.ir"
        mplower("opt", work / "m.ir", f"--pass-pipeline={pipeline.replace('CALIB', str(work / 'in.npz'))}",
                "-o", low)
        mplower("run", low, "--inputs", work / "in.npz", "--report", work / f"{sheet}.json",
                "--save-outputs", work / f"{sheet}.npz", "--format", "json")
        summary = json.loads((work / f"{sheet}.json").read_text())["summary"]
        lowered = np.load(work / f"{sheet}.npz")["output_0"]
        mplower("export", low, "--format", "onnx", "-o", work / f"{sheet}.onnx")
        exported = ort_run((work / f"{sheet}.onnx").read_bytes(), feeds)[0]
        row[sheet] = {"verdict": summary["verdict"], "output_rel_l2": summary["output_rel_l2"],
                      "overflow": summary["overflow"], "nan": summary["nan"],
                      "export_vs_mplower_max_abs": float(np.max(np.abs(exported - lowered)))}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="folder for the exported models (default: temp)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("torch and transformers are not installed; nothing to export", file=sys.stderr)
        return 0
    import importlib.util

    exporters = ["torchscript"] + (["dynamo"] if importlib.util.find_spec("onnxscript") else [])
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        for name, model in models(args.hidden).items():
            feeds = inputs(name, args.batch, args.seq)
            with torch.no_grad():
                torch_out = model(**{k: torch.from_numpy(v) for k, v in feeds.items()})
            torch_out = torch_out.last_hidden_state.numpy()
            for exporter in exporters:
                work = out / f"{name}-{exporter}"
                work.mkdir(parents=True, exist_ok=True)
                path = work / f"{name}.onnx"
                try:
                    export(model, name, feeds, path, exporter == "dynamo")
                    row = check(name, exporter, torch_out, path, feeds, work)
                except Exception as e:  # noqa: BLE001  (report every export, whatever fails)
                    row = {"model": name, "exporter": exporter,
                           "error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\n| model | exporter | ops | all-constant ops | ORT vs torch | mplower fp32 vs ORT "
          "| bf16 rel-L2 | int8 rel-L2 | export vs mplower (bf16 / int8) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['exporter']} | error: {r['error'][:80]} |||||||")
            continue
        print(f"| {r['model']} | {r['exporter']} | {r['ops']} | {r['all_constant_ops']} | "
              f"{r['ort_vs_torch_max_abs']:.2g} | {r['fp32_vs_ort_max_abs']:.2g} | "
              f"{r['bf16']['output_rel_l2']:.3g} | {r['int8']['output_rel_l2']:.3g} | "
              f"{r['bf16']['export_vs_mplower_max_abs']:.2g} / "
              f"{r['int8']['export_vs_mplower_max_abs']:.2g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
