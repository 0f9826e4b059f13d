"""fp16 mixed precision: `mplower tune` against onnxconverter-common's auto_convert_mixed_precision.

The anchor (onnxconverter_common.auto_mixed_precision) converts an ONNX model to float16 and
bisects lists of nodes to keep in float32, validating every attempt with a fresh onnxruntime
session, until the outputs meet `np.allclose(rtol, atol)`. On the same ONNX models and inputs
this script counts:

* the anchor's validation runs: its calls of `float16.convert_float_to_float16` (one per
  attempt, the final one included) and all its onnxruntime runs (`get_tensor_values_using_ort`,
  the fp32 reference and dtype discovery included), and the nodes it leaves in float16;
* mplower's evaluations (every run of a lowered plan: the fp32 baseline, the uniform fp16
  sheet, the traced run and the growth steps) of `mplower import` then `mplower tune --formats
  f16 --guardrail max_rel_l2=R`, and the ops its plan lowers;
* whether each tool's plan meets the other's criterion: mplower's lowered module run by its
  executor against the anchor's allclose on onnxruntime's fp32 outputs, and the modeled h100
  throughput of both plans (the anchor's fp16 model is brought in with `mplower import` and
  priced by `mplower report --target h100`).

The models are the bundled examples and production-shape blocks at a small width, exported to
ONNX by `mplower export`: the same graph for both tools. Run from the repository root:
`python benchmarks/anchor.py [--out report.md] [--rtol 0.01 --atol 0.001 --rel-l2 0.01]`.
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


def bench(case: Case, folder: Path, rtol: float, atol: float, rel_l2: float) -> dict[str, object]:
    import onnxruntime as ort

    folder.mkdir(parents=True, exist_ok=True)
    onnx_path = folder / "model.onnx"
    mplower("export", case.ir, "--format", "onnx", "-o", onnx_path)
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    ref = sess.run(None, case.inputs)
    anchor = run_anchor(onnx_path, case.inputs, rtol, atol, folder / "anchor_fp16.onnx")
    imported = folder / "imported.ir"
    mplower("import", onnx_path, "-o", imported)
    data = folder / "data.npz"
    np.savez(data, **case.inputs)
    out = folder / "tune"
    rc, _ = mplower("tune", imported, "--target", "h100", "--data", data, "--formats", "f16",
                    "--guardrail", f"max_rel_l2={rel_l2}", "-o", out)
    packet = json.loads((out / "tune.json").read_text())
    row = {"model": case.name, "anchor": anchor, "mplower_rc": rc,
           "mplower_evaluations": packet["evaluations"]["count"]}
    base = packet["baseline"]
    row["mplower_ops"] = sum(1 for line in imported.read_text().splitlines()
                             if " = mp." in line and "mp.constant" not in line)
    if rc == 0:
        chosen = packet["chosen"]
        saved = folder / "y.npz"
        mplower("run", out / "lowered.ir", "--inputs", data, "--save-outputs", saved)
        ys = np.load(saved)
        row["mplower_lowered_ops"] = chosen["lowered_ops"]
        row["mplower_meets_allclose"] = all(
            np.allclose(ys[f"output_{i}"], r, rtol, atol) for i, r in enumerate(ref))
        row["mplower_rel_l2"] = chosen["quality"]["output_rel_l2"]
        row["mplower_us"] = chosen["modeled"]["time_s"] * 1e6
    row["fp32_us"] = base["modeled"]["time_s"] * 1e6
    anchor_ir = folder / "anchor.ir"
    if anchor["error"]:
        row["anchor_us"] = None
        return row
    try:
        mplower("import", folder / "anchor_fp16.onnx", "-o", anchor_ir)
        row["anchor_us"] = modeled_us(anchor_ir)
        # The anchor's plan under mplower's criterion: rel-L2 in mplower's executor.
        _, out = mplower("run", anchor_ir, "--inputs", data, "--format", "json")
        row["anchor_rel_l2"] = json.loads(out)["summary"]["output_rel_l2"]
    except RuntimeError as e:
        row["anchor_us"] = None
        row["anchor_import"] = str(e).splitlines()[-1][:120]
    return row


def render(rows: list[dict[str, object]], args: argparse.Namespace, command: str) -> str:
    def us(x: object) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    def rel(x: object) -> str:
        return "n/a" if x is None else f"{x:.2g}"

    lines = [
        f"Command: `{command}`  ",
        (f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
         f"{platform.python_version()}, onnxconverter-common "
         f"{__import__('onnxconverter_common').__version__}, onnxruntime "
         f"{__import__('onnxruntime').__version__}  "),
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  ",
        (f"Anchor: `auto_convert_mixed_precision(rtol={args.rtol}, atol={args.atol}, "
         f"keep_io_types=True)`; mplower: `tune --formats f16 --guardrail "
         f"max_rel_l2={args.rel_l2} --target h100`."),
        "",
        ("| model | anchor validation runs (attempts / all ORT runs) | mplower evaluations | "
         "ratio | anchor: nodes in fp16 | mplower: ops lowered | mplower plan meets the "
         "anchor's allclose | output rel-L2 in mplower's executor: anchor / mplower | "
         "modeled h100 us: fp32 / anchor / mplower |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a = r["anchor"]
        ratio = a["attempts"] / r["mplower_evaluations"]
        lowered = (f"{r['mplower_lowered_ops']} / {r['mplower_ops']}"
                   if r["mplower_rc"] == 0 else "none (exit 3)")
        kept = (f"none ({a['error']})" if a["error"] else f"{a['fp16_nodes']} / {a['nodes']}")
        meets = {True: "yes", False: "no"}.get(r.get("mplower_meets_allclose"), "n/a")
        lines.append(
            f"| {r['model']} | {a['attempts']} / {a['ort_runs']} | {r['mplower_evaluations']} | "
            f"{ratio:.2f} | {kept} | {lowered} | {meets} | "
            f"{rel(r.get('anchor_rel_l2'))} / {rel(r.get('mplower_rel_l2'))} | "
            f"{us(r['fp32_us'])} / {us(r.get('anchor_us'))} / {us(r.get('mplower_us'))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtol", type=float, default=0.01)
    ap.add_argument("--atol", type=float, default=0.001)
    ap.add_argument("--rel-l2", type=float, default=0.01)
    ap.add_argument("--out", type=Path, help="write the markdown report here too")
    args = ap.parse_args(argv)
    command = "python benchmarks/anchor.py " + " ".join(argv if argv is not None else sys.argv[1:])
    shutil.rmtree(OUT, ignore_errors=True)
    rows = [bench(c, OUT / c.name.split()[0], args.rtol, args.atol, args.rel_l2)
            for c in cases(OUT / "models")]
    text = render(rows, args, command.strip())
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
