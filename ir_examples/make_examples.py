"""Generate the example models in ir_examples/: a digits MLP, a transformer block and a small CNN.

Each model is written by running its forward pass in plain numpy while the IR text is emitted,
so every result type in the file is the shape numpy actually produced and every attribute value
is the one the numpy reference used. For each example NAME the script writes NAME.ir (DESIGN §3
custom form), NAME.npz (weights, keyed by the `mp.constant` names), NAME_inputs.npz (keyed by
argument name) and NAME_expected.npz (`output_0`, in float32). The reference is independent of
mplower and runs in float64 on the float32 weights, so tests can hold the executor's fp32 run
to it. The MLP's expected output is scikit-learn's own `predict_proba`, with the true `labels`.
Everything is seeded and the .npz files carry fixed zip timestamps, so a rerun rewrites
byte-identical files. Run from the repository root: `python ir_examples/make_examples.py`.
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier
from sklearn.preprocessing import StandardScaler

OUT_DIR = Path(__file__).resolve().parent
GENERATOR = "ir_examples/make_examples.py"


# --- numpy reference semantics (ONNX semantics where ONNX has the op) ---------------------------


def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def layer_norm(x, gamma, beta, axis: int, epsilon: float) -> np.ndarray:
    axes = tuple(range(axis, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(var + epsilon) * gamma + beta


_erf = np.vectorize(math.erf)


def gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    assert approximate == "none"
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def transpose(x: np.ndarray, perm: list[int]) -> np.ndarray:
    return np.transpose(x, perm)


def conv2d(x, w, b, strides: list[int], padding: list[int]) -> np.ndarray:
    """NCHW x OIHW, groups 1, dilations 1; padding is [top, left, bottom, right]."""
    top, left, bottom, right = padding
    xp = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    kh, kw = w.shape[2:]
    sh, sw = strides
    oh = (xp.shape[2] - kh) // sh + 1
    ow = (xp.shape[3] - kw) // sw + 1
    out = np.zeros((x.shape[0], w.shape[0], oh, ow))
    # One small matmul per kernel tap keeps this obviously right, which is all a reference needs.
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i : i + sh * (oh - 1) + 1 : sh, j : j + sw * (ow - 1) + 1 : sw]
            out += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j])
    return out + b[None, :, None, None]


def max_pool2d(x, kernel: list[int], strides: list[int], padding: list[int]) -> np.ndarray:
    top, left, bottom, right = padding
    xp = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=-np.inf)
    kh, kw = kernel
    sh, sw = strides
    oh = (xp.shape[2] - kh) // sh + 1
    ow = (xp.shape[3] - kw) // sw + 1
    out = np.full((x.shape[0], x.shape[1], oh, ow), -np.inf)
    for i in range(kh):
        for j in range(kw):
            out = np.maximum(
                out, xp[:, :, i : i + sh * (oh - 1) + 1 : sh, j : j + sw * (ow - 1) + 1 : sw]
            )
    return out


# --- IR emission ----------------------------------------------------------------------------------


def tensor_type(a: np.ndarray) -> str:
    return "tensor<" + "".join(f"{d}x" for d in a.shape) + "f32>"


def float_literal(v: float) -> str:
    """MLIR needs a '.' in a float literal: 1e-05 must be written 1.0e-05."""
    text = repr(float(v))
    if "." not in text:
        text = text.replace("e", ".0e") if "e" in text else text + ".0"
    return text


def attr_value(v) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return float_literal(v)
    if isinstance(v, list):
        return "[" + ", ".join(attr_value(e) for e in v) + "]"
    raise TypeError(f"no IR spelling for attribute value {v!r}")


class Function:
    """One `func.func @main`, written op by op while numpy evaluates it.

    Values are kept in float64 (computed from the float32 weights and inputs), so the reference
    output is more exact than any fp32 run it will be compared with.
    """

    def __init__(self) -> None:
        self.args: dict[str, np.ndarray] = {}
        self.weights: dict[str, np.ndarray] = {}
        self.values: dict[str, np.ndarray] = {}
        self.body: list[str] = []

    def arg(self, name: str, array: np.ndarray) -> str:
        self.args[name] = np.asarray(array, np.float32)
        self.values[name] = self.args[name].astype(np.float64)
        return name

    def weight(self, name: str, key: str, array: np.ndarray) -> str:
        self.weights[key] = np.asarray(array, np.float32)
        self.values[name] = self.weights[key].astype(np.float64)
        self.body.append(
            f'%{name} = mp.constant {{name = "{key}"}} : () -> {tensor_type(self.weights[key])}'
        )
        return name

    def scalar(self, name: str, value: float) -> str:
        """A small constant stays inline in the IR as `dense<>` rather than going to the .npz."""
        self.values[name] = np.array(np.float32(value), np.float64)
        literal = float_literal(float(np.float32(value)))
        self.body.append(
            f"%{name} = mp.constant {{value = dense<{literal}> : tensor<f32>}} : () -> tensor<f32>"
        )
        return name

    def op(self, result: str, op: str, operands: list[str], fn: Callable, **attrs) -> str:
        """Emit `%result = mp.op operands {attrs} : (types) -> type`; `fn(*operands, **attrs)`
        is the op's numpy semantics, so the attributes written are exactly the ones computed."""
        inputs = [self.values[o] for o in operands]
        self.values[result] = np.asarray(fn(*inputs, **attrs), np.float64)
        attr_dict = ""
        if attrs:
            attr_dict = " {" + ", ".join(f"{k} = {attr_value(v)}" for k, v in attrs.items()) + "}"
        in_types = ", ".join(tensor_type(a) for a in inputs)
        out_type = tensor_type(self.values[result])
        uses = ", ".join(f"%{o}" for o in operands)
        self.body.append(f"%{result} = mp.{op} {uses}{attr_dict} : ({in_types}) -> {out_type}")
        return result

    def text(self, name: str, comment: list[str], result: str) -> str:
        params = ", ".join(f"%{n}: {tensor_type(a)}" for n, a in self.args.items())
        out_type = tensor_type(self.values[result])
        lines = [f"// {c}" for c in comment]
        lines.append(f'module @{name} attributes {{mp.weights = "{name}.npz"}} {{')
        lines.append(f"  func.func @main({params}) -> {out_type} {{")
        lines += [f"    {line}" for line in self.body]
        lines.append(f"    return %{result} : {out_type}")
        lines += ["  }", "}"]
        return "\n".join(lines) + "\n"


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez stamps each member with the current time; a fixed stamp keeps reruns identical."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for key, array in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
            zf.writestr(
                zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue()
            )


def write_example(name: str, fn: Function, result: str, comment: list[str], expected=None) -> None:
    (OUT_DIR / f"{name}.ir").write_text(fn.text(name, comment, result))
    save_npz(OUT_DIR / f"{name}.npz", fn.weights)
    save_npz(OUT_DIR / f"{name}_inputs.npz", fn.args)
    if expected is None:
        expected = {}
    expected.setdefault("output_0", fn.values[result].astype(np.float32))
    save_npz(OUT_DIR / f"{name}_expected.npz", expected)
    print(
        f"wrote {name}.ir ({len(fn.body)} ops), {name}.npz, {name}_inputs.npz, {name}_expected.npz"
    )


# --- the examples ---------------------------------------------------------------------------------


def make_mlp(digits) -> None:
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target, test_size=0.25, random_state=0, stratify=digits.target
    )
    scaler = StandardScaler().fit(x_train)
    clf = MLPClassifier(
        hidden_layer_sizes=(64,), activation="relu", solver="adam", max_iter=1000, random_state=0
    ).fit(scaler.transform(x_train), y_train)
    accuracy = clf.score(scaler.transform(x_test), y_test)
    print(f"mlp: scikit-learn MLPClassifier test accuracy {accuracy:.4f} ({len(y_test)} samples)")

    # Fold the scaler into fc1 so the IR takes raw 0..16 pixels:
    # ((x - mean) / scale) @ W + b == x @ (W / scale[:, None]) + (b - (mean / scale) @ W).
    w1, w2 = clf.coefs_
    b1, b2 = clf.intercepts_
    w1_folded = w1 / scaler.scale_[:, None]
    b1_folded = b1 - (scaler.mean_ / scaler.scale_) @ w1

    fn = Function()
    fn.arg("x", x_test[:32])
    fn.weight("w1", "fc1.weight", w1_folded)
    fn.weight("b1", "fc1.bias", b1_folded)
    fn.weight("w2", "fc2.weight", w2)
    fn.weight("b2", "fc2.bias", b2)
    fn.op("0", "matmul", ["x", "w1"], np.matmul)
    fn.op("1", "add", ["0", "b1"], np.add)
    fn.op("2", "relu", ["1"], lambda x: np.maximum(x, 0.0))
    fn.op("3", "matmul", ["2", "w2"], np.matmul)
    fn.op("4", "add", ["3", "b2"], np.add)
    fn.op("5", "softmax", ["4"], softmax, axis=-1)

    proba = clf.predict_proba(scaler.transform(x_test[:32]))
    drift = np.abs(fn.values["5"] - proba).max()
    assert drift < 1e-4, f"folded float32 MLP drifts {drift} from predict_proba"
    batch_accuracy = (proba.argmax(axis=1) == y_test[:32]).mean()
    print(
        f"mlp: the 32 saved samples: accuracy {batch_accuracy:.4f}, max |numpy - sklearn| {drift:.2e}"
    )
    write_example(
        "mlp",
        fn,
        "5",
        [
            "Digits MLP (64 raw pixels -> 64 relu -> 10), returns probabilities equal to sklearn",
            "MLPClassifier.predict_proba; the StandardScaler is folded into fc1. Weights are",
            f"(in, out) matrices in mlp.npz. Generated by {GENERATOR} (seeded).",
        ],
        {"output_0": proba.astype(np.float32), "labels": y_test[:32].astype(np.int64)},
    )


def make_transformer() -> None:
    seq, d_model, heads, ffn = 16, 64, 4, 256
    d_head = d_model // heads
    rng = np.random.default_rng(0)

    def dense(n_in: int, n_out: int) -> np.ndarray:
        return rng.normal(0.0, 1.0 / math.sqrt(n_in), (n_in, n_out))

    def bias(n: int) -> np.ndarray:
        return rng.normal(0.0, 0.02, n)

    fn = Function()
    fn.arg("x", np.random.default_rng(1).normal(0.0, 1.0, (seq, d_model)))
    for p in ("q", "k", "v", "o"):
        fn.weight(f"w{p}", f"attn.{p}.weight", dense(d_model, d_model))
        fn.weight(f"b{p}", f"attn.{p}.bias", bias(d_model))
    fn.weight("ln1_g", "ln1.weight", 1.0 + rng.normal(0.0, 0.1, d_model))
    fn.weight("ln1_b", "ln1.bias", rng.normal(0.0, 0.1, d_model))
    fn.weight("w_ff1", "ffn.fc1.weight", dense(d_model, ffn))
    fn.weight("b_ff1", "ffn.fc1.bias", bias(ffn))
    fn.weight("w_ff2", "ffn.fc2.weight", dense(ffn, d_model))
    fn.weight("b_ff2", "ffn.fc2.bias", bias(d_model))
    fn.weight("ln2_g", "ln2.weight", 1.0 + rng.normal(0.0, 0.1, d_model))
    fn.weight("ln2_b", "ln2.bias", rng.normal(0.0, 0.1, d_model))
    fn.scalar("scale", 1.0 / math.sqrt(d_head))

    def split_heads(x):
        return x.reshape(seq, heads, d_head)

    for p in ("q", "k", "v"):
        fn.op(f"{p}_proj", "matmul", ["x", f"w{p}"], np.matmul)
        fn.op(p, "add", [f"{p}_proj", f"b{p}"], np.add)
        fn.op(f"{p}_split", "reshape", [p], split_heads)
    fn.op("q_heads", "transpose", ["q_split"], transpose, perm=[1, 0, 2])
    # K goes straight to (heads, d_head, seq), so the scores matmul needs no second transpose.
    fn.op("k_t", "transpose", ["k_split"], transpose, perm=[1, 2, 0])
    fn.op("v_heads", "transpose", ["v_split"], transpose, perm=[1, 0, 2])
    fn.op("scores", "matmul", ["q_heads", "k_t"], np.matmul)
    fn.op("scaled", "mul", ["scores", "scale"], np.multiply)
    fn.op("probs", "softmax", ["scaled"], softmax, axis=-1)
    fn.op("ctx_heads", "matmul", ["probs", "v_heads"], np.matmul)
    fn.op("ctx_t", "transpose", ["ctx_heads"], transpose, perm=[1, 0, 2])
    fn.op("ctx", "reshape", ["ctx_t"], lambda x: x.reshape(seq, d_model))
    fn.op("o_proj", "matmul", ["ctx", "wo"], np.matmul)
    fn.op("attn", "add", ["o_proj", "bo"], np.add)
    fn.op("res1", "add", ["x", "attn"], np.add)
    fn.op("h1", "layer_norm", ["res1", "ln1_g", "ln1_b"], layer_norm, axis=1, epsilon=1e-5)
    fn.op("ff1_proj", "matmul", ["h1", "w_ff1"], np.matmul)
    fn.op("ff1", "add", ["ff1_proj", "b_ff1"], np.add)
    fn.op("ff1_act", "gelu", ["ff1"], gelu, approximate="none")
    fn.op("ff2_proj", "matmul", ["ff1_act", "w_ff2"], np.matmul)
    fn.op("ff2", "add", ["ff2_proj", "b_ff2"], np.add)
    fn.op("res2", "add", ["h1", "ff2"], np.add)
    fn.op("y", "layer_norm", ["res2", "ln2_g", "ln2_b"], layer_norm, axis=1, epsilon=1e-5)
    write_example(
        "transformer",
        fn,
        "y",
        [
            "One post-LN transformer encoder block: seq 16, d_model 64, 4 heads, ffn 256, exact GELU.",
            "Random weights from numpy default_rng(0) (std 1/sqrt(fan_in)), (in, out) matrices in",
            f"transformer.npz; input from default_rng(1). Generated by {GENERATOR}.",
        ],
    )


def make_cnn(digits) -> None:
    rng = np.random.default_rng(0)

    def conv_weight(o: int, i: int) -> np.ndarray:
        return rng.normal(0.0, 1.0 / math.sqrt(i * 9), (o, i, 3, 3))

    fn = Function()
    # A real digit (scaled to 0..1) makes a more natural input than noise.
    fn.arg("x", digits.images[0][None, None] / 16.0)
    fn.weight("w1", "conv1.weight", conv_weight(8, 1))
    fn.weight("b1", "conv1.bias", rng.normal(0.0, 0.1, 8))
    fn.weight("w2", "conv2.weight", conv_weight(16, 8))
    fn.weight("b2", "conv2.bias", rng.normal(0.0, 0.1, 16))
    fn.weight("w_fc", "fc.weight", rng.normal(0.0, 0.25, (16, 10)))
    fn.weight("b_fc", "fc.bias", rng.normal(0.0, 0.1, 10))
    fn.op("c1", "conv2d", ["x", "w1", "b1"], conv2d, strides=[1, 1], padding=[1, 1, 1, 1])
    fn.op("r1", "relu", ["c1"], lambda x: np.maximum(x, 0.0))
    fn.op(
        "p1", "max_pool2d", ["r1"], max_pool2d, kernel=[2, 2], strides=[2, 2], padding=[0, 0, 0, 0]
    )
    fn.op("c2", "conv2d", ["p1", "w2", "b2"], conv2d, strides=[1, 1], padding=[1, 1, 1, 1])
    fn.op("r2", "relu", ["c2"], lambda x: np.maximum(x, 0.0))
    fn.op("g", "global_avg_pool", ["r2"], lambda x: x.mean(axis=(2, 3), keepdims=True))
    fn.op("f", "flatten", ["g"], lambda x, axis: x.reshape(math.prod(x.shape[:axis]), -1), axis=1)
    fn.op("fc", "matmul", ["f", "w_fc"], np.matmul)
    fn.op("logits", "add", ["fc", "b_fc"], np.add)
    write_example(
        "cnn",
        fn,
        "logits",
        [
            "Small CNN on one 1x1x8x8 digit: conv3x3(8)+relu, maxpool 2x2, conv3x3(16)+relu,",
            "global average pool, flatten, linear -> 10 logits. Untrained weights from numpy",
            f"default_rng(0) in cnn.npz (OIHW conv, (in, out) linear). Generated by {GENERATOR}.",
        ],
    )


def main() -> None:
    digits = load_digits()
    make_mlp(digits)
    make_transformer()
    make_cnn(digits)


if __name__ == "__main__":
    main()
