"""grad through the transformers as torch.onnx exports them (issue 15 on issue 16's ops).

The BERT- and GPT-2-pattern models of test_onnx_transformers go through the importer and
`grad{loss=mse}`; the reference is `jax.grad` of the ONNX graph itself, evaluated node by node
by the small jax.numpy interpreter below (ONNX's semantics written out, nothing of mplower's),
for the embedding tables and a weight of each kind: the gathers' scatter-add, the masks' where,
softmax, layer_norm, pow, GatherElements/GatherND on the mask.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper
from test_onnx_transformers import MODELS, SHAPES, feeds

from mplower.backend.executor import Program
from mplower.onnx.importer import import_model
from mplower.pass_manager import PassManager, parse_pipeline

jax = pytest.importorskip("jax")
jnp = jax.numpy

RTOL = 1e-5


def _xp(*xs):
    """jax.numpy once a value depends on the differentiated weights; numpy for the exporter's
    shape and mask arithmetic, whose values must stay concrete."""
    return jnp if any(isinstance(x, jax.Array) for x in xs) else np


def _layer_norm(a, x, g, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / jnp.sqrt(v + a["epsilon"]) * g + b


def _split(a, x, sizes):
    return jnp.split(x, np.cumsum(sizes)[:-1], axis=a["axis"])


ONNX_IN_JAX = {
    "Constant": lambda a: numpy_helper.to_array(a["value"]),
    "Shape": lambda a, x: np.array(x.shape, np.int64),
    "Gather": lambda a, x, i: _xp(x).take(x, i, axis=a.get("axis", 0)),
    "Unsqueeze": lambda a, x, axes: _xp(x).expand_dims(x, tuple(axes)),
    "Range": lambda a, s, e, d: np.arange(s, e, d),
    "Add": lambda a, x, y: x + y,
    "Sub": lambda a, x, y: x - y,
    "Mul": lambda a, x, y: x * y,
    "Div": lambda a, x, y: x / y,
    "Pow": lambda a, x, y: x ** y,
    "MatMul": lambda a, x, y: _xp(x, y).matmul(x, y),
    "Tanh": lambda a, x: jnp.tanh(x),
    "Erf": lambda a, x: jax.scipy.special.erf(x),
    "Softmax": lambda a, x: jax.nn.softmax(x, axis=a["axis"]),
    "LayerNormalization": _layer_norm,
    "Concat": lambda a, *xs: _xp(*xs).concatenate(xs, axis=a["axis"]),
    "Reshape": lambda a, x, s: x.reshape(tuple(s)),
    "Transpose": lambda a, x: _xp(x).transpose(x, a["perm"]),
    "Split": _split,
    "ConstantOfShape": lambda a, s: np.full(tuple(s), numpy_helper.to_array(a["value"])[0]),
    "Trilu": lambda a, x: np.triu(x) if a.get("upper", 1) else np.tril(x),
    "Cast": lambda a, x: x.astype(helper.tensor_dtype_to_np_dtype(a["to"])),
    "Where": lambda a, c, x, y: _xp(c, x, y).where(c, x, y),
    "Equal": lambda a, x, y: x == y,
    "GreaterOrEqual": lambda a, x, y: x >= y,
    "And": lambda a, x, y: x & y,
    "IsNaN": lambda a, x: _xp(x).isnan(x),
    "Expand": lambda a, x, s: _xp(x).broadcast_to(x, np.broadcast_shapes(x.shape, tuple(s))),
    "GatherElements": lambda a, x, i: _xp(x).take_along_axis(x, i, axis=a["axis"]),
    "GatherND": lambda a, x, i: x[tuple(np.moveaxis(i, -1, 0))],
}


def run_onnx_in_jax(model, inputs: dict, weights: dict):
    env = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    env.update(inputs)
    env.update(weights)
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        outs = ONNX_IN_JAX[node.op_type](attrs, *(env[i] for i in node.input))
        outs = outs if len(node.output) > 1 else [outs]
        env.update(zip(node.output, outs))
    return env[model.graph.output[0].name]


WRT = {
    "bert": ("word_embeddings", "token_type_embeddings", "query.weight", "value.bias",
             "embeddings.LayerNorm.weight", "intermediate.weight"),
    "gpt2": ("wte", "c_attn.weight", "ln_1.bias", "c_fc.bias", "mlp_proj.weight"),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_grad_of_an_imported_transformer_matches_jax_for_embeddings_and_weights(name, tmp_path):
    model = MODELS[name]()
    shapes = {i.name: SHAPES[i.name] for i in model.graph.input}
    imp = import_model(model, f"{name}.onnx", input_shapes=shapes)
    np.savez(tmp_path / "w.npz", **imp.weights)
    PassManager(parse_pipeline(f"grad{{loss=mse wrt={','.join(WRT[name])}}}")).run(imp.module)
    x = feeds(model)
    labels = np.random.default_rng(1).standard_normal((2, 8, 16)).astype(np.float32)
    program = Program(imp.module, weights=str(tmp_path / "w.npz"))
    loss, *grads = program.run([*(x[n] for n in imp.inputs), labels], reference=False).outputs

    def ref_loss(weights):
        return jnp.mean((run_onnx_in_jax(model, x, weights) - labels) ** 2)
    weights = {n: jnp.asarray(imp.weights[n]) for n in WRT[name]}
    assert abs(float(loss) - float(ref_loss(weights))) <= RTOL * float(loss)
    ref_grads = jax.grad(ref_loss)(weights)
    assert len(grads) == len(WRT[name])
    for n, ours in zip(WRT[name], grads):
        ref = np.asarray(ref_grads[n], np.float64)
        assert ours.shape == ref.shape, n
        assert np.linalg.norm(ref) > 0, n  # every weight listed does reach the loss
        assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) <= RTOL, n
    # The embedding rows of tokens never fed get no gradient (the scatter adds nothing there).
    unused = sorted(set(range(grads[0].shape[0])) - set(x["input_ids"].ravel().tolist()))
    assert unused and not np.any(grads[0][unused])
