"""Weight-only 4-bit on real pretrained models: round-to-nearest, GPTQ and AWQ on each model's
own task metric.

    MPLOWER_MODEL_CACHE=/tmp/rmcache python benchmarks/weight_only.py [--models filetype,...]
        [--group 32] [--write]

For each model of benchmarks/real_data.py (its evaluation set built offline, as
benchmarks/real_models.py does) the file is imported as shipped and lowered with
`quantize{scheme=w4a16 method=M group=G sym=false data=calib.npz}` for M in rtn, gptq, awq,
calibrated on a second set drawn with another seed (the evaluation samples are never seen by
calibration). Each plan runs on mplower's executor and is scored with the model's metric
(benchmarks/real_metrics.py), beside the fp32 plan's. The mean relative reconstruction error
||XW - XQ|| / ||XW|| over the model's layers (what `mp.weight_error` records, on the calibration
data) is shown with it. Only the matmuls are quantized (`ops=mp.matmul`, the linear layers,
as LLM weight-only schemes do); convolutions stay f32, so the columns differ by the
algorithm alone. `--write` puts the table into
docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import real_data
import real_metrics

from mplower.backend.executor import Program, reference_runner
from mplower.dialect.plan import WEIGHT_ERROR
from mplower.ir.parser import parse_file
from mplower.pass_manager import PassContext, PassManager, parse_pipeline

DOC = HERE.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- weight_only.py begin -->", "<!-- weight_only.py end -->"
METHODS = ("rtn", "gptq", "awq")
MODELS = {"filetype": ("accuracy", ("bytes",)), "text-rec": ("char_accuracy", ("x",))}


def eval_set(name: str, path: Path, seed_offset: int = 0, n: int = 0
             ) -> dict[str, np.ndarray]:
    fn = real_data.EVAL_SETS[name]
    kw: dict = {"n": n} if n else {}
    if name == "text-rec":
        kw["charset"] = real_data.character_list(path)
    if name == "filetype":
        kw["labels_space"] = real_data.magika_labels(path)
    if seed_offset:
        kw["seed"] = fn.__defaults__[1] + seed_offset
    return fn(**kw)


def evaluate(name: str, group: int, work: Path, n: int = 0) -> dict:
    metric, inputs = MODELS[name]
    path = real_data.fetch(name)
    ev = eval_set(name, path, n=n)
    calib = eval_set(name, path, seed_offset=100)
    np.savez(work / "calib.npz", **{k: calib[k] for k in inputs})
    shapes = [f"--input-shape={k}={'x'.join(map(str, ev[k].shape))}" for k in inputs]
    subprocess.run([sys.executable, "-m", "mplower", "import", str(path), "-o", "m.ir",
                    *shapes], cwd=work, check=True)
    args = [ev[k] for k in inputs]

    def score(module) -> float:
        out = Program(module).run(args, reference=False).outputs
        return getattr(real_metrics, metric)({"y": out[0]}, ev)

    row = {"model": name, "fp32": score(parse_file(work / "m.ir"))}
    for method in METHODS:
        module = parse_file(work / "m.ir")
        t0 = time.perf_counter()
        PassManager(parse_pipeline(
            f"quantize{{scheme=w4a16 method={method} group={group} sym=false ops=mp.matmul "
            f"data={work / 'calib.npz'}}}")).run(module, PassContext(runner=reference_runner))
        row[f"{method}_s"] = time.perf_counter() - t0
        f = module.function(None)
        errs = [f.attrs_of(n)[WEIGHT_ERROR] for n in f.ops() if WEIGHT_ERROR in f.attrs_of(n)]
        row[f"{method}_layers"] = len(errs)
        row[f"{method}_err"] = float(np.mean(errs)) if errs else float("nan")
        row[method] = score(module)
    row["metric"] = metric
    row["group"] = group
    row["n"] = len(ev[inputs[0]])
    return row


def table(rows: list[dict]) -> list[str]:
    out = [("| model | metric (samples) | group | fp32 | RTN | GPTQ | AWQ | mean layer error "
            "RTN / GPTQ / AWQ | GPTQ / AWQ time |"),
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['metric']} ({r['n']}) | {r['group'] or 'channel'} | {r['fp32']:.4f} | "
            f"{r['rtn']:.4f} | {r['gptq']:.4f} | {r['awq']:.4f} | {r['rtn_err']:.4f} / "
            f"{r['gptq_err']:.4f} / {r['awq_err']:.4f} ({r['gptq_layers']} layers) | "
            f"{r['gptq_s']:.1f} s / {r['awq_s']:.1f} s |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--group", default="32", help="group sizes, comma-separated (0: channel)")
    ap.add_argument("--n", type=int, default=0,
                    help="evaluation samples (default: real_models.py's set)")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args(argv)
    rows = []
    for name in a.models.split(","):
        for group in map(int, a.group.split(",")):
            with tempfile.TemporaryDirectory() as tmp:
                rows.append(evaluate(name, group, Path(tmp), a.n))
            print("\n".join(table(rows[-1:])[2:]), flush=True)
    lines = table(rows)
    print(f"`python benchmarks/weight_only.py --models {a.models} --group {a.group}"
          f"{f' --n {a.n}' if a.n else ''}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("\n".join(lines))
    if a.write:  # the table alone: the section's text says the command and the date
        text = DOC.read_text()
        head, rest = text.split(BEGIN)
        _, tail = rest.split(END)
        DOC.write_text(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
