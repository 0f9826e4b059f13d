"""Production-shape examples for the cost model: a BERT-base encoder layer, a GPT-2-small decoder
block and ResNet-50, at batch 8.

The bundled examples (make_examples.py) are tiny (seq 16, width 64), where every kernel is
launch-bound; these have the shapes deployments run, and tens of megabytes of weights, so they
are generated on first use into a cache folder (`ir_examples/generated/`, gitignored) instead
of being committed. Weights are seeded (numpy default_rng(0)): dense and conv weights
He-normal (std sqrt(2 / fan_in)), biases 0, layer-norm gains 1; the models are for pricing and
timing, not for accuracy.

- bert_base_layer: post-LN encoder layer, batch 8 x seq 128 tokens, hidden 768, 12 heads,
  FFN 3072, exact GELU (BERT-base, Devlin et al. 2019).
- gpt2_block: pre-LN decoder block, batch 8 x seq 128, hidden 768, 12 heads, MLP 3072, tanh
  GELU, causal mask added to the scores before the softmax as a constant (0 on and below the
  diagonal, -1e4 above, as GPT-2's reference code masks); q, k and v are three matmuls (GPT-2
  fuses them into one 768x2304 c_attn, the same FLOPs). Tokens per second = batch x seq x
  inferences per second.
- resnet50: the onnx wheel's light_resnet50 (whose weights are ConstantOfShape placeholders)
  with seeded weights (batch-norm scale and variance 1, shift and mean 0), imported with
  `--input-shape gpu_0/data_0=8x3x224x224`.

Activations are (tokens, hidden) matrices, so every projection is one 2-D GEMM of M = 1024.

    python ir_examples/production.py [--out DIR] [--no-weights] [NAME ...]
writes NAME.ir (and NAME.npz) for each NAME (default: all), skipping files already there.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

CACHE = Path(__file__).resolve().parent / "generated"
BATCH, SEQ, HIDDEN, HEADS, FFN = 8, 128, 768, 12, 3072
MASKED = -1.0e4  # GPT-2's masked score (TF reference: w * b - 1e4 * (1 - b))


class _Emitter:
    """IR text of one function, built from shapes alone; weights are drawn only when wanted."""

    def __init__(self, rng: np.random.Generator | None):
        self.rng = rng
        self.consts: list[str] = []
        self.body: list[str] = []
        self.weights: dict[str, np.ndarray] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    @staticmethod
    def ty(shape: tuple[int, ...]) -> str:
        return f"tensor<{'x'.join(map(str, shape))}{'x' if shape else ''}f32>"

    def weight(self, name: str, shape: tuple[int, ...], init: Callable[[], np.ndarray]) -> str:
        var = "%" + name.replace(".", "_")
        self.consts.append(f'    {var} = mp.constant {{name = "{name}"}} : () -> {self.ty(shape)}')
        self.shapes[var] = shape
        if self.rng is not None:
            self.weights[name] = init().astype(np.float32)
        return var

    def dense(self, name: str, n_in: int, n_out: int) -> tuple[str, str]:
        w = self.weight(f"{name}.weight", (n_in, n_out),
                        lambda: self.rng.standard_normal((n_in, n_out)) * math.sqrt(2 / n_in))
        b = self.weight(f"{name}.bias", (n_out,), lambda: np.zeros(n_out))
        return w, b

    def op(self, result: str, op: str, operands: list[str], shape: tuple[int, ...],
           attrs: str = "") -> str:
        ins = ", ".join(self.ty(self.shapes[o]) for o in operands)
        self.body.append(f"    %{result} = {op} {', '.join(operands)}{attrs} : ({ins}) -> "
                         f"{self.ty(shape)}")
        self.shapes["%" + result] = shape
        return "%" + result

    def linear(self, result: str, x: str, name: str, n_in: int, n_out: int) -> str:
        w, b = self.dense(name, n_in, n_out)
        rows = self.shapes[x][0]
        proj = self.op(f"{result}_proj", "mp.matmul", [x, w], (rows, n_out))
        return self.op(result, "mp.add", [proj, b], (rows, n_out))

    def layer_norm(self, result: str, x: str, name: str) -> str:
        g = self.weight(f"{name}.weight", (HIDDEN,), lambda: np.ones(HIDDEN))
        b = self.weight(f"{name}.bias", (HIDDEN,), lambda: np.zeros(HIDDEN))
        return self.op(result, "mp.layer_norm", [x, g, b], self.shapes[x],
                       " {axis = 1, epsilon = 1.0e-05}")

    def attention(self, x: str, mask: str | None) -> str:
        tokens, dh = BATCH * SEQ, HIDDEN // HEADS
        heads = {}
        for part, perm in (("q", "[0, 2, 1, 3]"), ("k", "[0, 2, 3, 1]"), ("v", "[0, 2, 1, 3]")):
            y = self.linear(part, x, f"attn.{part}", HIDDEN, HIDDEN)
            split = self.op(f"{part}_split", "mp.reshape", [y], (BATCH, SEQ, HEADS, dh))
            shape = (BATCH, HEADS, dh, SEQ) if part == "k" else (BATCH, HEADS, SEQ, dh)
            heads[part] = self.op(f"{part}_heads", "mp.transpose", [split], shape,
                                  f" {{perm = {perm}}}")
        scale = "%scale"
        self.consts.append(f"    {scale} = mp.constant {{value = dense<{1 / math.sqrt(dh)}> : "
                           "tensor<f32>} : () -> tensor<f32>")
        self.shapes[scale] = ()
        scores_shape = (BATCH, HEADS, SEQ, SEQ)
        scores = self.op("scores", "mp.matmul", [heads["q"], heads["k"]], scores_shape)
        s = self.op("scaled", "mp.mul", [scores, scale], scores_shape)
        if mask is not None:
            s = self.op("masked", "mp.add", [s, mask], scores_shape)
        probs = self.op("probs", "mp.softmax", [s], scores_shape, " {axis = -1}")
        ctx = self.op("ctx_heads", "mp.matmul", [probs, heads["v"]], (BATCH, HEADS, SEQ, dh))
        ctx_t = self.op("ctx_t", "mp.transpose", [ctx], (BATCH, SEQ, HEADS, dh),
                        " {perm = [0, 2, 1, 3]}")
        flat = self.op("ctx", "mp.reshape", [ctx_t], (tokens, HIDDEN))
        return self.linear("attn", flat, "attn.o", HIDDEN, HIDDEN)

    def mlp(self, x: str, approximate: str) -> str:
        h = self.linear("ff1", x, "ffn.fc1", HIDDEN, FFN)
        act = self.op("ff1_act", "mp.gelu", [h], self.shapes[h],
                      f' {{approximate = "{approximate}"}}')
        return self.linear("ff2", act, "ffn.fc2", FFN, HIDDEN)

    def text(self, name: str, comment: str, result: str) -> str:
        tokens = self.ty((BATCH * SEQ, HIDDEN))
        weights = f' attributes {{mp.weights = "{name}.npz"}}' if self.weights else ""
        return "\n".join([
            f"// {comment}", "// Generated by ir_examples/production.py (seeded weights).",
            f"module @{name}{weights} {{",
            f"  func.func @main(%x: {tokens}) -> {tokens} {{",
            *self.consts, *self.body, f"    return {result} : {tokens}", "  }", "}", ""])


def bert_base_layer(rng: np.random.Generator | None) -> tuple[str, dict[str, np.ndarray]]:
    e = _Emitter(rng)
    e.shapes["%x"] = (BATCH * SEQ, HIDDEN)
    attn = e.attention("%x", None)
    res1 = e.op("res1", "mp.add", ["%x", attn], e.shapes[attn])
    h1 = e.layer_norm("h1", res1, "ln1")
    ff = e.mlp(h1, "none")
    res2 = e.op("res2", "mp.add", [h1, ff], e.shapes[ff])
    y = e.layer_norm("y", res2, "ln2")
    return e.text("bert_base_layer", "BERT-base encoder layer (post-LN): batch 8 x seq 128 "
                  "tokens, hidden 768, 12 heads, FFN 3072, exact GELU.", y), e.weights


def gpt2_block(rng: np.random.Generator | None) -> tuple[str, dict[str, np.ndarray]]:
    e = _Emitter(rng)
    e.shapes["%x"] = (BATCH * SEQ, HIDDEN)
    mask = e.weight("attn.causal_mask", (SEQ, SEQ),
                    lambda: np.triu(np.full((SEQ, SEQ), MASKED), k=1))
    h = e.layer_norm("ln1_out", "%x", "ln1")
    attn = e.attention(h, mask)
    res1 = e.op("res1", "mp.add", ["%x", attn], e.shapes[attn])
    h2 = e.layer_norm("ln2_out", res1, "ln2")
    ff = e.mlp(h2, "tanh")
    y = e.op("y", "mp.add", [res1, ff], e.shapes[ff])
    return e.text("gpt2_block", "GPT-2-small decoder block (pre-LN): batch 8 x seq 128 tokens, "
                  "hidden 768, 12 heads, MLP 3072, tanh GELU, causal mask.", y), e.weights


def resnet50(rng: np.random.Generator) -> tuple[str, dict[str, np.ndarray]]:
    """light_resnet50 with its ConstantOfShape placeholders replaced by seeded initializers,
    through mplower's ONNX importer."""
    import onnx
    from onnx import numpy_helper

    from mplower.ir.printer import print_module
    from mplower.onnx.importer import import_model

    path = Path(onnx.__file__).parent / "backend/test/data/light/light_resnet50.onnx"
    model = onnx.load(str(path))
    g = model.graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    keep, made = [], []
    for node in g.node:
        if node.op_type != "ConstantOfShape":
            keep.append(node)
            continue
        shape = tuple(int(d) for d in inits[node.input[0]])
        name = node.output[0]
        if len(shape) > 1:  # conv OIHW or gemm weight: He-normal over its fan-in
            fan_in = int(np.prod(shape[1:]))
            value = rng.standard_normal(shape) * math.sqrt(2 / fan_in)
        elif name.endswith(("_s_0", "_riv_0")):  # batch-norm scale and (inverse) variance
            value = np.ones(shape)
        else:
            value = np.zeros(shape)
        made.append(numpy_helper.from_array(value.astype(np.float32), name))
    del g.node[:]
    g.node.extend(keep)
    used = {i for n in keep for i in n.input}
    kept_inits = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend([*kept_inits, *made])
    # This IR version lists initializers as graph inputs too: keep those still used.
    inputs = [i for i in g.input if i.name not in inits or i.name in used]
    inputs += [onnx.helper.make_tensor_value_info(i.name, onnx.TensorProto.FLOAT, i.dims)
               for i in made]
    del g.input[:]
    g.input.extend(inputs)
    # The model fixes batch 1: set 8 on the input and on the Reshape before the classifier.
    g.input[0].type.tensor_type.shape.dim[0].dim_value = BATCH
    for out in g.output:
        out.type.tensor_type.shape.dim[0].dim_value = BATCH
    del g.value_info[:]
    for node in keep:
        if node.op_type == "Reshape" and node.input[1] in inits:
            dims = inits[node.input[1]].copy()
            dims[0] = BATCH
            for i in g.initializer:
                if i.name == node.input[1]:
                    i.CopyFrom(numpy_helper.from_array(dims, i.name))
    imported = import_model(model, str(path))
    module = imported.module
    module.attrs["mp.weights"] = "resnet50.npz"
    text = ("// light_resnet50 from the onnx wheel with seeded He-normal weights, batch 8.\n"
            "// Generated by ir_examples/production.py.\n" + print_module(module))
    return text, dict(imported.weights)


MAKERS: dict[str, Callable[..., tuple[str, dict[str, np.ndarray]]]] = {
    "bert_base_layer": bert_base_layer, "gpt2_block": gpt2_block, "resnet50": resnet50}
# Models whose IR is written from shapes alone (the cost model needs no weights).
SHAPE_ONLY = ("bert_base_layer", "gpt2_block")


def ir_text(name: str) -> str:
    """The IR of `name` (one of SHAPE_ONLY) without drawing weights: for pricing only."""
    if name not in SHAPE_ONLY:
        raise ValueError(f"{name} needs its weights to be generated; use ensure()")
    return MAKERS[name](None)[0]


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An .npz with fixed zip timestamps, written to a temporary name and renamed, so a
    rerun writes identical bytes and an interrupted one leaves no half file."""
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
        for key, a in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(a), allow_pickle=False)
            z.writestr(zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0)),
                       buf.getvalue())
    os.replace(tmp, path)


def ensure(name: str, out: Path = CACHE) -> Path:
    """The path of NAME.ir in `out`, generating it and its weights first if missing."""
    ir = out / f"{name}.ir"
    if ir.exists():
        return ir
    out.mkdir(parents=True, exist_ok=True)
    text, weights = MAKERS[name](np.random.default_rng(0))
    if weights:
        _save_npz(out / f"{name}.npz", weights)
    tmp = ir.with_name(ir.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, ir)
    return ir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME",
                    help=f"models to generate, of {', '.join(MAKERS)} (default: all)")
    ap.add_argument("--out", type=Path, default=CACHE, help=f"folder (default {CACHE})")
    ap.add_argument("--no-weights", action="store_true",
                    help="write the IR of the transformer models only, without weights")
    args = ap.parse_args(argv)
    for name in args.names:
        if name not in MAKERS:
            ap.error(f"unknown model '{name}' (choose from {', '.join(MAKERS)})")
    for name in args.names or list(MAKERS):
        if args.no_weights:
            if name not in SHAPE_ONLY:
                print(f"{name}: skipped (its IR comes from the importer, with weights)")
                continue
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{name}.ir").write_text(ir_text(name))
            print(args.out / f"{name}.ir")
        else:
            print(ensure(name, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
