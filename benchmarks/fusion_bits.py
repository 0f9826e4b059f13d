"""The output bytes of the runtime benchmark's models (benchmarks/runtime.py), for checking that
a change to fusion changes no bit: run it once per checkout and compare the files.

    PYTHONPATH=/path/to/other/checkout python benchmarks/fusion_bits.py --dump other.npz
    python benchmarks/fusion_bits.py --dump mine.npz [--unfused]
    python benchmarks/fusion_bits.py --compare other.npz mine.npz

Each model at batch 1 is lowered with each sheet as runtime.py lowers it (`fuse` last, or not
with `--unfused`), and `Program.run_lowered` (what `mplower bench` times) and `Program.run`
(what `mplower run` reports on) are run on one seeded input; the mplower package is whichever
PYTHONPATH finds, the model builders those beside this script. `--time N` also records the
median of N run_lowered calls, which `--compare` shows as ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runtime


def dump(path: Path, models: list[str], sheets: list[str], fused: bool, reps: int,
         ran: bool = True) -> None:
    from mplower.backend.executor import Program, reference_runner
    from mplower.ir.parser import parse_file
    from mplower.pass_manager import PassContext, PassManager, parse_pipeline

    out = {}
    for name in models:
        onnx_path = runtime.onnx_model(name, 1)
        model = runtime.onnx.load(str(onnx_path))
        x = runtime.samples(model, 1, seed=1)[0]
        calib = onnx_path.with_name(f"{onnx_path.stem}_bits_calib.npz")
        if not calib.exists():
            arg = runtime.import_model(model, str(onnx_path)).inputs[0]
            np.savez(calib, **{runtime._arg_key(arg): np.stack(runtime.samples(model, 4, 2))})
        ir = runtime.mplower_ir(onnx_path)
        for sheet in sheets:
            steps = {"fp32": "", "int8": f"assign-precision{{policy=int8}},calibrate{{data={calib}}},"
                     "quantize"}.get(sheet, f"assign-precision{{policy={sheet}}},insert-casts")
            steps = ",".join(s for s in (steps, "fuse" if fused else "") if s)
            module = parse_file(ir)
            if steps:
                PassManager(parse_pipeline(steps)).run(module,
                                                       PassContext(runner=reference_runner))
            program = Program(module)
            prepared = program.prepare_inputs([x])
            lowered = program.run_lowered(prepared)
            outputs = program.run([x], reference=False).outputs if ran else lowered
            if reps:
                times = []
                for _ in range(reps):
                    start = time.perf_counter()
                    program.run_lowered(prepared)
                    times.append(time.perf_counter() - start)
                out[f"{name}/{sheet}/seconds"] = np.array(statistics.median(times))
            for k, (a, b) in enumerate(zip(lowered, outputs, strict=True)):
                out[f"{name}/{sheet}/lowered/{k}"] = a
                if ran:
                    out[f"{name}/{sheet}/run/{k}"] = b
            print(name, sheet, flush=True)
    np.savez(path, **out)


def compare(a: Path, b: Path) -> int:
    with np.load(a) as x, np.load(b) as y:
        keys = sorted(k for k in set(x.files) | set(y.files) if not k.endswith("/seconds"))
        bad = [k for k in keys if k not in x.files or k not in y.files
               or x[k].tobytes() != y[k].tobytes() or x[k].dtype != y[k].dtype]
        for k in keys:
            print(f"{k:40s} {'DIFFERENT' if k in bad else 'same bits'}")
        print(f"{len(keys) - len(bad)} of {len(keys)} outputs bit-identical")
        for k in sorted(set(x.files) & set(y.files)):
            if k.endswith("/seconds"):
                print(f"{k:40s} {float(x[k]) * 1e3:9.1f} ms {float(y[k]) * 1e3:9.1f} ms "
                      f"{float(y[k] / x[k]):6.2f}x")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dump", type=Path)
    p.add_argument("--compare", type=Path, nargs=2)
    p.add_argument("--unfused", action="store_true", help="lower without the fuse pass")
    p.add_argument("--no-run", action="store_true", help="run_lowered only, not `run`")
    p.add_argument("--time", type=int, default=0, metavar="N",
                   help="also the median of N timed run_lowered calls per configuration")
    p.add_argument("--models", default=",".join(runtime.MODELS))
    p.add_argument("--sheets", default="fp32," + ",".join(runtime.SHEETS))
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare)
    dump(args.dump, args.models.split(","), args.sheets.split(","), not args.unfused, args.time,
         not args.no_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
