"""How far onnxruntime's fp32 and mplower's fp32 are from the exact value, on the real models.

    python benchmarks/fp32_exactness.py --models text-det,text-rec,filetype [--batch N] [--ops]
                                        [--chunk N]

The "exact" value is a float64 evaluation of the same file: every float initializer, constant,
input and Cast made float64 (Resize's scales stay float32, as ONNX requires), run by onnx's own
reference evaluator (onnxruntime has no float64 Conv), with two of its kernels written out
here: GlobalMaxPool (onnx 1.23's reduces the wrong axes of a 3-D input) and BatchNormalization
in its inference form (onnx 1.23's was 3e-2 off both runtimes on text-rec's opset-12 nodes).
The errors are benchmarks/real_models.py's: the largest absolute difference over the largest
magnitude of the float64 value, per output, the largest over the outputs; against
onnxruntime, also the table's rel-L2. With `--ops`, the same for every intermediate value that both onnxruntime (asked for
it as an extra output, graph optimizations off, so that each node exists) and mplower
(imported names are the ONNX names made identifiers) have, in graph order.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import real_data
import real_models


class GlobalMaxPool(OpRun):  # by its name it replaces onnx's kernel
    def _run(self, x):
        return (x.max(axis=tuple(range(2, x.ndim)), keepdims=True),)


class BatchNormalization(OpRun):
    def _run(self, x, scale, bias, mean, var, epsilon=None, momentum=None, training_mode=None):
        eps = epsilon if epsilon is not None else 1e-5
        c = (1, -1) + (1,) * (x.ndim - 2)
        return ((x - mean.reshape(c)) / np.sqrt(var.reshape(c) + eps) * scale.reshape(c)
                + bias.reshape(c),)


def as_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph computing in float64."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    scales = {name for n in g.node if n.op_type == "Resize" for name in n.input[1:3]}
    for t in g.initializer:
        if t.data_type == TensorProto.FLOAT and t.name not in scales:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64),
                                               t.name))
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT \
                    and not set(n.output) & scales:
                a.t.CopyFrom(numpy_helper.from_array(
                    numpy_helper.to_array(a.t).astype(np.float64)))
            if n.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.DOUBLE
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT and vi.name not in scales:
            vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    return m


def with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    infos = {vi.name: vi for vi in m.graph.value_info}
    m.graph.output.extend(infos[n] for n in names if n not in have and n in infos)
    return m


def error(y: np.ndarray, exact: np.ndarray) -> float:
    exact = np.asarray(exact, np.float64)
    top = max(float(np.max(np.abs(exact))), 1e-30) if exact.size else 1.0
    return float(np.max(np.abs(np.asarray(y, np.float64) - exact), initial=0.0)) / top


def mplower_values(path: Path, inputs: dict[str, np.ndarray], work: Path,
                   every: bool) -> dict[str, np.ndarray]:
    """mplower's fp32 values by ONNX name: the outputs, or (`every`) every value."""
    from mplower.backend.executor import Program
    from mplower.ir.parser import parse

    shapes = [f"--input-shape={k}={'x'.join(map(str, v.shape))}" for k, v in inputs.items()]
    subprocess.run([sys.executable, "-m", "mplower", "import", str(path), "-o", "m.ir",
                    *shapes], cwd=work, check=True)
    ir = work / "m.ir"
    module = parse(ir.read_text(), str(ir))
    program = Program(module)
    run = program.run(list(inputs.values()), reference=False, keep=every)
    f = program.function
    values = {f.value_name(v).lstrip("%"): run.values[s] for v, s in program.slots.items()}
    return values | {f"output:{i}": y for i, y in enumerate(run.outputs)}


def measure(name: str, batch: int | None, ops: bool, chunk: int) -> list[str]:
    model_def = next(m for m in real_models.MODELS if m.name == name)
    path = real_data.fetch(name)
    kw = {}
    if name == "text-rec":
        kw["charset"] = real_data.character_list(path)
    if name == "filetype":
        kw["labels_space"] = real_data.magika_labels(path)
    ev = real_data.EVAL_SETS[name](**kw)
    inputs = {k: ev[k][:batch] if batch else ev[k] for k in model_def.inputs}
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    names = [vi.name for vi in model.graph.value_info] if ops else []
    outputs = [o.name for o in model.graph.output]

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if ops:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(with_outputs(model, names).SerializeToString(), so,
                             providers=["CPUExecutionProvider"])
    ort_values = dict(zip((o.name for o in s.get_outputs()), s.run(None, inputs)))

    m64 = with_outputs(as_float64(model), names)
    wanted = [o.name for o in m64.graph.output]
    wide = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in inputs.items()}
    # The reference evaluator holds every intermediate: a few samples at a time (the samples
    # are independent in these models; `--ops` takes the batch in one piece).
    step = len(next(iter(wide.values()))) if ops or name == "vad" else chunk
    ref = ReferenceEvaluator(m64, new_ops=[GlobalMaxPool, BatchNormalization])
    pieces = [ref.run(wanted, {k: v[i:i + step] for k, v in wide.items()})
              for i in range(0, len(next(iter(wide.values()))), step)]
    exact = {o: np.concatenate([p[j] for p in pieces]) if len(pieces) > 1 else pieces[0][j]
             for j, o in enumerate(wanted)}

    with tempfile.TemporaryDirectory(prefix="mplower-exact-") as tmp:
        mine = mplower_values(path, inputs, Path(tmp), ops)
    for i, o in enumerate(outputs):
        mine[re.sub(r"[^A-Za-z0-9_$.\-]", "_", o) or "v"] = mine[f"output:{i}"]

    lines = []
    if ops:
        for n in model.graph.node:
            for o in n.output:
                key = re.sub(r"[^A-Za-z0-9_$.\-]", "_", o) or "v"
                if o in exact and exact[o].dtype == np.float64 and o in ort_values \
                        and key in mine and np.shape(mine[key]) == exact[o].shape:
                    lines.append(f"  {n.op_type:20s} {o[:50]:50s} "
                                 f"ORT {error(ort_values[o], exact[o]):8.1e}  "
                                 f"mplower {error(mine[key], exact[o]):8.1e}")
    key = {o: re.sub(r"[^A-Za-z0-9_$.\-]", "_", o) or "v" for o in outputs}
    e_ort = max(error(ort_values[o], exact[o]) for o in outputs)
    e_mine = max(error(mine[key[o]], exact[o]) for o in outputs)
    e_diff = max(error(mine[key[o]], ort_values[o]) for o in outputs)
    rel_l2 = max(float(np.linalg.norm(mine[key[o]].astype(np.float64) - ort_values[o])
                       / max(float(np.linalg.norm(ort_values[o].astype(np.float64))), 1e-30))
                 for o in outputs)
    batch_text = "x".join(map(str, inputs[model_def.inputs[0]].shape))
    lines.append(f"{name}, {batch_text}: onnxruntime vs float64 {e_ort:.1e}, mplower vs float64 "
                 f"{e_mine:.1e}, mplower vs onnxruntime {e_diff:.1e} (rel-L2 {rel_l2:.1e})")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="text-det,text-rec,filetype")
    ap.add_argument("--batch", type=int, default=None, help="first N samples (default: all)")
    ap.add_argument("--ops", action="store_true", help="every intermediate value too")
    ap.add_argument("--chunk", type=int, default=4, help="samples per float64 evaluation")
    args = ap.parse_args(argv)
    for name in args.models.split(","):
        print("\n".join(measure(name, args.batch, args.ops, args.chunk)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
