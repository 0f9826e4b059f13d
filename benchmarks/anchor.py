"""fp16 mixed precision: `mplower tune` against onnxconverter-common's auto_convert_mixed_precision.

The anchor (onnxconverter_common.auto_mixed_precision) converts an ONNX model to float16 and
bisects lists of nodes to keep in float32, validating every attempt with a fresh onnxruntime
session, until the outputs meet `np.allclose(fp32_ref, y, rtol, atol)`. On the same ONNX
models, inputs and tolerance this script counts:

* the anchor's validation runs: its calls of `float16.convert_float_to_float16`, one per
  attempt (the final one included), each run once in onnxruntime; apart from them it runs the
  fp32 model once for its reference and, to find missing dtypes, once per 100 intermediate
  values (all its onnxruntime runs: `get_tensor_values_using_ort`);
* mplower's evaluations (`tune.json` `evaluations.count`: every plan lowered and run, the fp32
  baseline plan, the uniform fp16 sheet, the traced run and the growth steps) of
  `mplower import` then `mplower tune --formats f16 --guardrail rtol=R --guardrail atol=A`;
  apart from them it runs the fp32 reference once (not counted by the packet);
* each tool's plan under both runtimes, as the worst allclose ratio |y - y_fp32| /
  (atol + rtol |y_fp32|) (at most 1 passes; mplower.numerics.metrics.allclose_ratio) and the
  anchor's own check: the anchor's fp16 model in onnxruntime against onnxruntime's fp32 outputs
  and, imported by `mplower import`, in mplower's executor against mplower's fp32 outputs of the
  same model; mplower's chosen plan in mplower's executor and, exported by `mplower export`, in
  onnxruntime against onnxruntime's fp32 outputs;
* ops in fp16 and the modeled h100 time of both plans (`mplower report --target h100`).

The models are the bundled examples and production-shape blocks at a small width, exported to
ONNX by `mplower export`: the same graph for both tools. Run from the repository root:
`python benchmarks/anchor.py [--out report.md] [--rtol 0.01 --atol 0.001]`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out" / "anchor"


def mplower(*args: object) -> tuple[int, str]:
    from mplower.cli.main import main

    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    if rc not in (0, 3):
        raise RuntimeError(f"mplower {' '.join(map(str, args))}: {err.getvalue()}")
    return rc, buf.getvalue()


@dataclass
class Case:
    name: str
    ir: Path
    inputs: dict[str, np.ndarray]


def _production(folder: Path, name: str, dims: dict[str, int]) -> Path:
    spec = importlib.util.spec_from_file_location("production", ROOT / "ir_examples/production.py")
    production = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(production)
    for k, v in dims.items():
        setattr(production, k, v)
    return production.ensure(name, folder)


def cases(folder: Path) -> list[Case]:
    out = []
    for name in ("mlp", "cnn", "transformer"):
        ir = ROOT / "ir_examples" / f"{name}.ir"
        out.append(Case(name, ir, dict(np.load(ROOT / "ir_examples" / f"{name}_inputs.npz"))))
    dims = {"BATCH": 2, "SEQ": 32, "HIDDEN": 128, "HEADS": 4, "FFN": 512}
    rng = np.random.default_rng(0)
    for name in ("bert_base_layer", "gpt2_block"):
        ir = _production(folder / name, name, dims)
        x = rng.standard_normal((dims["BATCH"] * dims["SEQ"], dims["HIDDEN"])).astype(np.float32)
        out.append(Case(f"{name} (seq 32, hidden 128)", ir, {"x": x}))
    return out


def run_anchor(model_path: Path, feed: dict[str, np.ndarray], rtol: float, atol: float,
               out_path: Path) -> dict[str, object]:
    import onnx
    from onnxconverter_common import auto_mixed_precision as amp
    from onnxconverter_common import float16

    counts = {"attempts": 0, "ort_runs": 0}
    blocks: list[list[str]] = []
    convert, run_ort = float16.convert_float_to_float16, amp.get_tensor_values_using_ort

    def counting_convert(model, *a, node_block_list=None, **k):
        counts["attempts"] += 1
        blocks.append(list(node_block_list or []))
        return convert(model, *a, node_block_list=node_block_list, **k)

    def counting_run(*a, **k):
        counts["ort_runs"] += 1
        return run_ort(*a, **k)

    model = onnx.load(str(model_path))
    amp.float16.convert_float_to_float16 = counting_convert
    amp.get_tensor_values_using_ort = counting_run
    error = None
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            converted = amp.auto_convert_mixed_precision(model, feed, rtol=rtol, atol=atol,
                                                         keep_io_types=True)
        onnx.save(converted, str(out_path))
    except ValueError as e:  # its final combined plan can fail although every part passed
        error = str(e)
    finally:
        amp.float16.convert_float_to_float16 = convert
        amp.get_tensor_values_using_ort = run_ort
    nodes = [n for n in model.graph.node if n.op_type not in ("Loop", "If", "Scan")]
    blocked = set(blocks[-1]) | set(float16.DEFAULT_OP_BLOCK_LIST)
    fp16 = sum(1 for n in nodes if n.name not in blocked and n.op_type not in blocked)
    return {**counts, "nodes": len(nodes), "fp16_nodes": 0 if error else fp16, "error": error}


def modeled_us(ir: Path) -> float | None:
    try:
        _, out = mplower("report", ir, "--target", "h100", "--format", "json")
    except RuntimeError:
        return None
    return json.loads(out)["summary"]["modeled_time_s"] * 1e6


def outputs_mplower(ir: Path, data: Path, saved: Path) -> list[np.ndarray]:
    mplower("run", ir, "--inputs", data, "--save-outputs", saved)
    ys = np.load(saved)
    return [ys[f"output_{i}"] for i in range(len(ys.files))]


def outputs_ort(model: Path, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def ort_fp16_footprint(model: Path, scratch: Path) -> dict[str, int]:
    """What onnxruntime's CPU provider computes in fp16 of a float16 model: the graph after its
    transformers (ORT_ENABLE_BASIC, saved), where a node without an fp16 kernel runs in f32
    between inserted Casts. `nodes`: non-Cast nodes of the model; `f16_nodes`: those that read
    fp16 after the transformers; `roundings`: f32 -> f16 Casts plus outputs of fp16 nodes other
    than Reshape/Transpose (which move values without rounding)."""
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(scratch)
    ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    g = onnx.shape_inference.infer_shapes(onnx.load(str(scratch))).graph
    elem = {v.name: v.type.tensor_type.elem_type for v in [*g.value_info, *g.input, *g.output]}
    elem.update({i.name: i.data_type for i in g.initializer})
    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    compute = [n for n in g.node if n.op_type != "Cast"]
    f16_nodes = [n for n in compute if any(elem.get(i) == f16 for i in n.input)]
    down = [n for n in g.node if n.op_type == "Cast" and elem.get(n.input[0]) == f32
            and elem.get(n.output[0]) == f16]
    rounding = [n for n in f16_nodes if n.op_type not in ("Reshape", "Transpose")]
    return {"nodes": sum(1 for n in onnx.load(str(model)).graph.node if n.op_type != "Cast"),
            "f16_nodes": len(f16_nodes), "roundings": len(down) + len(rounding),
            "f16_ops": ", ".join(sorted({n.op_type for n in f16_nodes}))}


def judge(ys: list[np.ndarray], refs: list[np.ndarray], rtol: float, atol: float
          ) -> dict[str, object]:
    """The worst allclose ratio against `refs` (mplower's reading: tolerance relative to the
    reference) and the anchor's own check, `np.allclose(ref, y, rtol, atol)` (its tolerance is
    relative to the converted model's output, the second argument)."""
    from mplower.numerics.metrics import allclose_ratio

    return {"ratio": max(allclose_ratio(y, r, rtol, atol) for y, r in zip(ys, refs)),
            "anchor_check": all(np.allclose(r, y, rtol, atol) for y, r in zip(ys, refs))}


def bench(case: Case, folder: Path, rtol: float, atol: float) -> dict[str, object]:
    folder.mkdir(parents=True, exist_ok=True)
    onnx_path = folder / "model.onnx"
    mplower("export", case.ir, "--format", "onnx", "-o", onnx_path)
    ref_ort = outputs_ort(onnx_path, case.inputs)
    anchor = run_anchor(onnx_path, case.inputs, rtol, atol, folder / "anchor_fp16.onnx")
    imported = folder / "imported.ir"
    mplower("import", onnx_path, "-o", imported)
    data = folder / "data.npz"
    np.savez(data, **case.inputs)
    ref_mp = outputs_mplower(imported, data, folder / "ref.npz")
    out = folder / "tune"
    rc, _ = mplower("tune", imported, "--target", "h100", "--data", data, "--formats", "f16",
                    "--guardrail", f"rtol={rtol}", "--guardrail", f"atol={atol}", "-o", out)
    packet = json.loads((out / "tune.json").read_text())
    row = {"model": case.name, "anchor": anchor, "mplower_rc": rc,
           "mplower_evaluations": packet["evaluations"]["count"],
           "fp32_us": packet["baseline"]["modeled"]["time_s"] * 1e6,
           "mplower_ops": sum(1 for line in imported.read_text().splitlines()
                              if " = mp." in line and "mp.constant" not in line)}
    if rc == 0:
        chosen = packet["chosen"]
        row["mplower_lowered_ops"] = chosen["lowered_ops"]
        row["mplower_us"] = chosen["modeled"]["time_s"] * 1e6
        row["mplower_packet_ratio"] = chosen["guardrails"]["max_allclose_ratio"]["value"]
        ys = outputs_mplower(out / "lowered.ir", data, folder / "y.npz")
        row["mplower_in_mplower"] = judge(ys, ref_mp, rtol, atol)
        exported = folder / "mplower_plan.onnx"
        mplower("export", out / "lowered.ir", "--format", "onnx", "-o", exported)
        row["mplower_in_ort"] = judge(outputs_ort(exported, case.inputs), ref_ort, rtol, atol)
    if anchor["error"]:
        return row
    row["anchor_ort_footprint"] = ort_fp16_footprint(folder / "anchor_fp16.onnx",
                                                     folder / "anchor_fp16.ort.onnx")
    row["anchor_in_ort"] = judge(outputs_ort(folder / "anchor_fp16.onnx", case.inputs), ref_ort,
                                 rtol, atol)
    anchor_ir = folder / "anchor.ir"
    try:
        mplower("import", folder / "anchor_fp16.onnx", "-o", anchor_ir)
        row["anchor_us"] = modeled_us(anchor_ir)
        ys = outputs_mplower(anchor_ir, data, folder / "anchor_y.npz")
        row["anchor_in_mplower"] = judge(ys, ref_mp, rtol, atol)
    except RuntimeError as e:
        row["anchor_import"] = str(e).splitlines()[-1][:120]
    return row


def render(rows: list[dict[str, object]], args: argparse.Namespace, command: str) -> str:
    def us(x: object) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    def verdict(j: object) -> str:
        if j is None:
            return "n/a"
        mark = "yes" if j["anchor_check"] else "no"
        return f"{j['ratio']:.3g} ({mark})"

    lines = [
        f"Command: `{command}`  ",
        (f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
         f"{platform.python_version()}, onnxconverter-common "
         f"{__import__('onnxconverter_common').__version__}, onnxruntime "
         f"{__import__('onnxruntime').__version__}  "),
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  ",
        (f"Anchor: `auto_convert_mixed_precision(rtol={args.rtol}, atol={args.atol}, "
         f"keep_io_types=True)`; mplower: `tune --formats f16 --guardrail rtol={args.rtol} "
         f"--guardrail atol={args.atol} --target h100`."),
        "",
        ("| model | anchor: validation runs (all ORT runs) | mplower: evaluations "
         "(+ fp32 reference run) | validation runs / evaluations | candidate runs: anchor / "
         "mplower (fp32 runs left out) |"),
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        a, n = r["anchor"], r["mplower_evaluations"]
        lines.append(f"| {r['model']} | {a['attempts']} ({a['ort_runs']}) | {n} ({n + 1}) | "
                     f"{a['attempts'] / n:.2f} | {a['attempts']} / {n - 1} |")
    lines += [
        "",
        ("| model | anchor: nodes in fp16 | mplower: ops lowered | worst allclose ratio "
         "(anchor's check): anchor's plan in ORT / in mplower | mplower's plan in mplower / "
         "in ORT (exported) | modeled h100 us: fp32 / anchor / mplower |"),
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        a = r["anchor"]
        lowered = (f"{r['mplower_lowered_ops']} / {r['mplower_ops']}"
                   if r["mplower_rc"] == 0 else "none (exit 3)")
        kept = f"none ({a['error']})" if a["error"] else f"{a['fp16_nodes']} / {a['nodes']}"
        lines.append(
            f"| {r['model']} | {kept} | {lowered} | {verdict(r.get('anchor_in_ort'))} / "
            f"{verdict(r.get('anchor_in_mplower'))} | {verdict(r.get('mplower_in_mplower'))} / "
            f"{verdict(r.get('mplower_in_ort'))} | {us(r['fp32_us'])} / "
            f"{us(r.get('anchor_us'))} / {us(r.get('mplower_us'))} |")
    lines += [
        "",
        ("| model | anchor's model: nodes besides Cast | of them run on fp16 by onnxruntime "
         "(CPU) | f16 roundings of activations there |"),
        "|---|---:|---|---:|",
    ]
    for r in rows:
        f = r.get("anchor_ort_footprint")
        if f is not None:
            lines.append(f"| {r['model']} | {f['nodes']} | {f['f16_nodes']} ({f['f16_ops']}) | "
                         f"{f['roundings']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtol", type=float, default=0.01)
    ap.add_argument("--atol", type=float, default=0.001)
    ap.add_argument("--json", type=Path, help="write the raw rows here")
    ap.add_argument("--out", type=Path, help="write the markdown report here too")
    args = ap.parse_args(argv)
    command = "python benchmarks/anchor.py " + " ".join(argv if argv is not None else sys.argv[1:])
    shutil.rmtree(OUT, ignore_errors=True)
    rows = [bench(c, OUT / c.name.split()[0], args.rtol, args.atol)
            for c in cases(OUT / "models")]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    text = render(rows, args, command.strip())
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
