"""grad: every op's gradient rule against JAX.

Each case is one op in a tiny function whose loss is sum(op(x...) * probe) for a random
`probe`, so that every element of the result's cotangent differs. The pass builds the backward
graph, mplower's executor runs it in f32, and `jax.grad` of the same computation written in
jax.numpy is the reference, to 1e-5 relative (L2 over the whole gradient).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mplower.backend.executor import Program
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.parser import parse
from mplower.ir.printer import print_module
from mplower.ir.verifier import verify
from mplower.pass_manager import PassManager, parse_pipeline

jax = pytest.importorskip("jax")
jnp = jax.numpy
lax = jax.lax

F32 = np.float32
RTOL = 1e-5


def t(shape: tuple[int, ...], elem: str = "f32") -> str:
    return "tensor<" + "".join(f"{d}x" for d in shape) + f"{elem}>"


def differentiate(args: dict[str, tuple[int, ...]], body: str, out: tuple[int, ...],
                  pipeline: str = "grad{wrt=args}", func_results: str | None = None):
    """The module `body` (ending in %y of shape `out`) with the probe loss, after `pipeline`."""
    sig = ", ".join(f"%{n}: {t(s)}" for n, s in {**args, "probe": out}.items())
    text = (f"func.func @main({sig}) -> {t(())} {{\n{body}\n"
            f"  %l = mp.mul %y, %probe : ({t(out)}, {t(out)}) -> {t(out)}\n"
            f"  %loss = mp.reduce_sum %l {{axes = [], keepdims = false}} : ({t(out)}) -> {t(())}\n"
            f"  return %loss : {t(())}\n}}\n")
    module = parse(text)
    PassManager(parse_pipeline(pipeline)).run(module)
    return module


def check(args: dict[str, tuple[int, ...]], body: str, out: tuple[int, ...], fn,
          seed: int = 0, positive: tuple[str, ...] = (), values: dict | None = None) -> None:
    rng = np.random.default_rng(seed)
    inputs = {n: rng.standard_normal(s).astype(F32) for n, s in args.items()}
    for n in positive:
        inputs[n] = np.abs(inputs[n]) + F32(0.5)
    inputs.update(values or {})
    probe = rng.standard_normal(out).astype(F32)
    module = differentiate(args, body, out)
    program = Program(module)
    outs = program.run([*inputs.values(), probe], reference=False).outputs
    loss, grads = outs[0], outs[1:]
    ref_fn = lambda *xs: jnp.sum(fn(*xs[:-1]) * xs[-1])
    ref_loss = ref_fn(*inputs.values(), probe)
    ref_grads = jax.grad(ref_fn, argnums=tuple(range(len(inputs) + 1)))(*inputs.values(), probe)
    # The loss is a sum of terms of both signs: relative to the sum of their magnitudes.
    scale = float(jnp.sum(jnp.abs(fn(*inputs.values()) * probe)))
    assert abs(float(loss) - float(ref_loss)) <= RTOL * scale
    assert len(grads) == len(inputs) + 1
    for name, ours, ref in zip([*inputs, "probe"], grads, ref_grads):
        ref = np.asarray(ref, np.float64)
        assert ours.shape == ref.shape, name
        err = np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30)
        assert err <= RTOL, (name, err)


def op(line: str) -> str:
    return f"  {line}"


def unary(name: str, shape=(3, 4), attrs: str = "") -> str:
    return op(f"%y = mp.{name} %x {attrs}: ({t(shape)}) -> {t(shape)}".replace("  :", " :"))


@pytest.mark.parametrize("name,fn,positive", [
    ("neg", jnp.negative, False), ("relu", jax.nn.relu, False), ("sigmoid", jax.nn.sigmoid, False),
    ("tanh", jnp.tanh, False), ("exp", jnp.exp, False), ("log", jnp.log, True),
    ("sqrt", jnp.sqrt, True), ("rsqrt", lax.rsqrt, True), ("erf", jax.scipy.special.erf, False),
])
def test_unary_rules_match_jax(name, fn, positive):
    check({"x": (3, 4)}, unary(name), (3, 4), fn, positive=("x",) if positive else ())


@pytest.mark.parametrize("form,approximate", [("none", False), ("tanh", True)])
def test_gelu_rules_match_jax_in_both_forms(form, approximate):
    check({"x": (3, 4)}, unary("gelu", attrs=f'{{approximate = "{form}"}} '), (3, 4),
          lambda x: jax.nn.gelu(x, approximate=approximate))


@pytest.mark.parametrize("name,fn", [("add", jnp.add), ("sub", jnp.subtract),
                                     ("mul", jnp.multiply), ("div", jnp.divide)])
def test_binary_rules_reduce_broadcast_cotangents_to_operand_shapes(name, fn):
    # b broadcasts along the leading axis (missing) and along a size-1 axis.
    body = op(f"%y = mp.{name} %a, %b : ({t((2, 3, 4))}, {t((3, 1))}) -> {t((2, 3, 4))}")
    check({"a": (2, 3, 4), "b": (3, 1)}, body, (2, 3, 4), fn,
          positive=("b",) if name == "div" else ())


@pytest.mark.parametrize("name,fn", [("maximum", jnp.maximum), ("minimum", jnp.minimum)])
def test_maximum_and_minimum_rules_split_ties_evenly_as_jax(name, fn):
    a = np.array([[1.0, -2.0, 0.0], [3.0, 0.5, -1.0]], F32)
    b = np.array([[0.0, -2.0, 0.0]], F32)  # two ties, broadcast along the rows
    body = op(f"%y = mp.{name} %a, %b : ({t((2, 3))}, {t((1, 3))}) -> {t((2, 3))}")
    check({"a": (2, 3), "b": (1, 3)}, body, (2, 3), fn, values={"a": a, "b": b})


def test_matmul_rule_matches_jax_with_batch_broadcasting():
    body = op(f"%y = mp.matmul %a, %b : ({t((2, 3, 4))}, {t((4, 5))}) -> {t((2, 3, 5))}")
    check({"a": (2, 3, 4), "b": (4, 5)}, body, (2, 3, 5), jnp.matmul)


def _conv(x, w, b=None, strides=(1, 1), padding=(0, 0, 0, 0), dilations=(1, 1)):
    pt, pl, pb, pr = padding
    y = lax.conv_general_dilated(x, w, strides, ((pt, pb), (pl, pr)), rhs_dilation=dilations,
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return y if b is None else y + b.reshape(1, -1, 1, 1)


@pytest.mark.parametrize("strides,padding,dilations,hw", [
    ((1, 1), (1, 1, 1, 1), (1, 1), 5),
    ((2, 2), (1, 0, 0, 1), (1, 1), 6),  # strides with rows the last window leaves out
    ((2, 1), (0, 0, 0, 0), (2, 1), 7),  # dilation, unequal strides
])
def test_conv2d_rule_matches_jax_for_input_weight_and_bias(strides, padding, dilations, hw):
    x, w, b = (2, 3, hw, hw), (4, 3, 3, 2), (4,)
    ho = (hw + padding[0] + padding[2] - dilations[0] * 2 - 1) // strides[0] + 1
    wo = (hw + padding[1] + padding[3] - dilations[1] - 1) // strides[1] + 1
    out = (2, 4, ho, wo)
    attrs = (f"{{strides = {list(strides)}, padding = {list(padding)}, "
             f"dilations = {list(dilations)}}}")
    body = op(f"%y = mp.conv2d %x, %w, %b {attrs} : ({t(x)}, {t(w)}, {t(b)}) -> {t(out)}")
    check({"x": x, "w": w, "b": b}, body, out,
          lambda x, w, b: _conv(x, w, b, strides, padding, dilations))


def test_grouped_conv2d_rule_matches_jax_per_group():
    x, w, out = (2, 4, 5, 5), (6, 2, 3, 3), (2, 6, 3, 3)
    body = op(f"%y = mp.conv2d %x, %w {{groups = 2, strides = [2, 2], padding = [1, 1, 1, 1]}} : "
              f"({t(x)}, {t(w)}) -> {t(out)}")
    check({"x": x, "w": w}, body, out, lambda x, w: lax.conv_general_dilated(
        x, w, (2, 2), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"),
        feature_group_count=2))


def test_softmax_and_log_softmax_rules_match_jax():
    check({"x": (3, 5)}, unary("softmax", (3, 5), "{axis = 0} "), (3, 5),
          lambda x: jax.nn.softmax(x, axis=0))
    check({"x": (3, 5)}, unary("log_softmax", (3, 5), "{axis = -1} "), (3, 5),
          lambda x: jax.nn.log_softmax(x, axis=-1))


def test_layer_norm_rule_matches_jax_for_x_gamma_and_beta():
    x, p = (2, 3, 4), (3, 4)
    body = op(f"%y = mp.layer_norm %x, %g, %b {{axis = 1, epsilon = 0.001}} : "
              f"({t(x)}, {t(p)}, {t(p)}) -> {t(x)}")

    def ln(x, g, b):
        mu = x.mean(axis=(1, 2), keepdims=True)
        var = ((x - mu) ** 2).mean(axis=(1, 2), keepdims=True)
        return (x - mu) / jnp.sqrt(var + 1e-3) * g + b
    check({"x": x, "g": p, "b": p}, body, x, ln)


def test_rms_norm_rule_matches_jax_for_x_and_gamma():
    body = op(f"%y = mp.rms_norm %x, %g : ({t((3, 4))}, {t((4,))}) -> {t((3, 4))}")
    check({"x": (3, 4), "g": (4,)}, body, (3, 4),
          lambda x, g: x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g)


@pytest.mark.parametrize("name,keep,out,fn", [
    ("reduce_sum", "true", (2, 1, 4), lambda x: x.sum(1, keepdims=True)),
    ("reduce_mean", "false", (3,), lambda x: x.mean((0, 2))),
    ("reduce_max", "false", (3,), lambda x: x.max((0, 2))),
])
def test_reduction_rules_broadcast_back(name, keep, out, fn):
    axes = "[1]" if name == "reduce_sum" else "[0, 2]"
    body = op(f"%y = mp.{name} %x {{axes = {axes}, keepdims = {keep}}} : ({t((2, 3, 4))}) -> "
              f"{t(out)}")
    check({"x": (2, 3, 4)}, body, out, fn)


def test_data_movement_rules_match_jax():
    x = (2, 3, 4)
    check({"x": x}, op(f"%y = mp.reshape %x : ({t(x)}) -> {t((4, 6))}"), (4, 6),
          lambda x: x.reshape(4, 6))
    check({"x": x}, op(f"%y = mp.transpose %x {{perm = [2, 0, 1]}} : ({t(x)}) -> {t((4, 2, 3))}"),
          (4, 2, 3), lambda x: x.transpose(2, 0, 1))
    check({"x": x}, op(f"%y = mp.flatten %x {{axis = 2}} : ({t(x)}) -> {t((6, 4))}"), (6, 4),
          lambda x: x.reshape(6, 4))
    check({"x": x}, op(f"%y = mp.slice %x {{starts = [0, 1, 1], ends = [2, 3, -1]}} : "
                       f"({t(x)}) -> {t((2, 2, 2))}"), (2, 2, 2), lambda x: x[:, 1:3, 1:-1])
    check({"a": (2, 3), "b": (2, 2)},
          op(f"%y = mp.concat %a, %b {{axis = 1}} : ({t((2, 3))}, {t((2, 2))}) -> {t((2, 5))}"),
          (2, 5), lambda a, b: jnp.concatenate([a, b], axis=1))


def _pool_jax(x, kernel, strides, padding, kind):
    pt, pl, pb, pr = padding
    pads = ((0, 0), (0, 0), (pt, pb), (pl, pr))
    win, st = (1, 1, *kernel), (1, 1, *strides)
    if kind == "max":
        return lax.reduce_window(x, -jnp.inf, lax.max, win, st, pads)
    total = lax.reduce_window(x, 0.0, lax.add, win, st, pads)
    count = lax.reduce_window(jnp.ones_like(x), 0.0, lax.add, win, st, pads)
    return total / count


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pool_rules_match_jax_with_padding_and_overlap(kind):
    x, out = (2, 2, 5, 5), (2, 2, 3, 3)
    attrs = "{kernel = [3, 3], strides = [2, 2], padding = [1, 1, 1, 1]}"
    body = op(f"%y = mp.{kind}_pool2d %x {attrs} : ({t(x)}) -> {t(out)}")
    check({"x": x}, body, out, lambda x: _pool_jax(x, (3, 3), (2, 2), (1, 1, 1, 1), kind))


def test_global_avg_pool_rule_matches_jax():
    body = op(f"%y = mp.global_avg_pool %x : ({t((2, 3, 4, 4))}) -> {t((2, 3, 1, 1))}")
    check({"x": (2, 3, 4, 4)}, body, (2, 3, 1, 1), lambda x: x.mean((2, 3), keepdims=True))


def test_fake_quant_rule_is_the_straight_through_estimator_clipped_to_the_range():
    # Scale 0.05: values beyond +-6.35 (127 * 0.05, round half even at the edge) saturate and get
    # no gradient; the 4x3 input below has both kinds.
    x = np.array([[-9.0, -6.3, -1.0], [0.2, 6.0, 6.4], [7.0, 0.0, -6.5], [3.3, -2.2, 1.1]], F32)
    body = op(f"%y = mp.fake_quant %x {{scale = 0.05 : f32, zero_point = 0 : i8, dtype = i8}} : "
              f"({t((4, 3))}) -> {t((4, 3))}")

    def fq(x):
        q = jnp.round(x / F32(0.05))
        inside = lax.stop_gradient((q >= -128) & (q <= 127))
        value = lax.stop_gradient(jnp.clip(q, -128, 127) * F32(0.05))
        return value + jnp.where(inside, x - lax.stop_gradient(x), 0.0)
    check({"x": (4, 3)}, body, (4, 3), fq, values={"x": x})


@pytest.mark.parametrize("scale_shape", [(), (3,)])
def test_lsq_rule_matches_jax_for_x_and_the_learned_scale(scale_shape):
    # LSQ with its gradient scale 1 / sqrt(N qmax), written as the paper's grad_scale and
    # round_pass; values stay away from the half-step band past the range ends, where the
    # paper's clip-then-round and the rounded range test differ.
    x = np.array([[-9.0, -6.3, -1.0], [0.2, 6.0, 5.7], [7.0, 0.01, -6.55], [3.3, -2.2, 1.1]], F32)
    s = np.full(scale_shape, 0.05, F32) if scale_shape == () else np.array([0.05, 0.04, 0.06], F32)
    body = op(f"%y = mp.fake_quant_lsq %x, %s {{dtype = i8, axis = 1}} : "
              f"({t((4, 3))}, {t(scale_shape)}) -> {t((4, 3))}")

    def lsq(x, s):
        g = 1.0 / np.sqrt(x.size / max(s.size, 1) * 127)
        s = s * g + lax.stop_gradient(s - s * g)
        v = jnp.clip(x / s, -128, 127)
        return (v + lax.stop_gradient(jnp.round(v) - v)) * s
    check({"x": (4, 3), "s": scale_shape}, body, (4, 3), lsq, values={"x": x, "s": s})


def _train_module(loss: str) -> str:
    return f"""func.func @main(%x: {t((4, 3))}) -> {t((4, 5))} {{
  %w = mp.constant {{name = "w"}} : () -> {t((3, 5))}
  %z = mp.matmul %x, %w : ({t((4, 3))}, {t((3, 5))}) -> {t((4, 5))}
  %p = mp.softmax %z {{axis = -1}} : ({t((4, 5))}) -> {t((4, 5))}
  return %p : {t((4, 5))}
}}
""" if loss == "cross_entropy" else f"""func.func @main(%x: {t((4, 3))}) -> {t((4, 5))} {{
  %w = mp.constant {{name = "w"}} : () -> {t((3, 5))}
  %z = mp.matmul %x, %w : ({t((4, 3))}, {t((3, 5))}) -> {t((4, 5))}
  return %z : {t((4, 5))}
}}
"""


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_losses_match_jax_and_cross_entropy_takes_the_logits_of_a_final_softmax(tmp_path, loss):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3)).astype(F32)
    w = rng.standard_normal((3, 5)).astype(F32)
    target = (np.eye(5, dtype=F32)[[0, 3, 1, 4]] if loss == "cross_entropy"
              else rng.standard_normal((4, 5)).astype(F32))
    np.savez(tmp_path / "w.npz", w=w)
    module = parse(_train_module(loss), str(tmp_path / "m.ir"))
    module.attrs["mp.weights"] = "w.npz"
    PassManager(parse_pipeline(f"grad{{loss={loss} labels=y}}")).run(module)
    f = module.function()
    assert [f.data(a)["name"] for a in f.args] == ["x", "y"]
    if loss == "cross_entropy":  # the softmax is gone: log_softmax of the logits instead
        assert "mp.softmax" not in {f.op(n) for n in f.ops()}
    loss_v, dw = Program(module).run([x, target], reference=False).outputs

    def ref(w):
        z = x @ w
        if loss == "mse":
            return jnp.mean((z - target) ** 2)
        return -jnp.sum(jax.nn.log_softmax(z, axis=-1) * target) / 4
    np.testing.assert_allclose(loss_v, np.asarray(ref(w)), rtol=RTOL)
    g = np.asarray(jax.grad(ref)(w))
    assert np.linalg.norm(dw - g) / np.linalg.norm(g) <= RTOL


def test_grad_returns_loss_then_one_gradient_per_param_and_tags_backward_ops():
    module = parse(Path("ir_examples/mlp.ir").read_text(), "ir_examples/mlp.ir")
    PassManager(parse_pipeline("grad{loss=cross_entropy seed=scale}")).run(module)
    f = module.function()
    assert [str(t) for t in f.result_types] == [
        "tensor<f32>", "tensor<64x64xf32>", "tensor<64xf32>", "tensor<64x10xf32>",
        "tensor<10xf32>"]
    assert [f.data(a)["name"] for a in f.args] == ["x", "labels", "scale"]
    tagged = {f.attrs_of(n).get("mp.grad_of") for n in f.ops()} - {None}
    assert tagged >= {"0", "1", "2", "3", "4"}
    text = print_module(module)
    assert 'mp.relu_grad %d3_1, %1 {mp.grad_of = "2"}' in text
    assert parse(text).function().result_types == f.result_types  # it round-trips


def test_reduce_max_rule_shares_the_gradient_among_tied_maxima_as_jax():
    x = np.array([[1.0, 3.0, 3.0], [2.0, -1.0, 0.5]], F32)  # a tie in the first row
    check({"x": (2, 3)},
          op(f"%y = mp.reduce_max %x {{axes = [1], keepdims = true}} : ({t((2, 3))}) -> "
             f"{t((2, 1))}"), (2, 1), lambda x: x.max(1, keepdims=True), values={"x": x})


def test_grad_of_an_op_without_a_rule_is_a_located_error():
    # The backward ops have no rules of their own (no second derivatives).
    with pytest.raises(DiagnosticError) as e:
        differentiate({"d": (2, 3), "x": (2, 3)},
                      op(f"%y = mp.relu_grad %d, %x : ({t((2, 3))}, {t((2, 3))}) -> "
                         f"{t((2, 3))}"), (2, 3))
    assert str(e.value.diagnostics[0].loc) == "<stdin>:2:3"
    assert e.value.diagnostics[0].message == "grad: mp.relu_grad has no gradient rule"


def _lrn(x, size, alpha, beta, bias):
    """ONNX LRN: channel c sums squares over c - floor((size-1)/2) .. c + ceil((size-1)/2)."""
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = jnp.pad(x * x, ((0, 0), (lo, hi)) + ((0, 0),) * (x.ndim - 2))
    window = sum(sq[:, m:m + x.shape[1]] for m in range(size))
    return x / (bias + alpha / size * window) ** beta


@pytest.mark.parametrize("size", [3, 4])  # an even size has a lopsided window
def test_lrn_rule_matches_jax(size):
    attrs = f"{{size = {size}, alpha = 0.5, beta = 0.75, bias = 1.5}}"
    check({"x": (2, 5, 2)}, op(f"%y = mp.lrn %x {attrs} : ({t((2, 5, 2))}) -> {t((2, 5, 2))}"),
          (2, 5, 2), lambda x: _lrn(x, size, 0.5, 0.75, 1.5))


# ---------------------------------------------------------------------------------------------
# The ops imported transformers add (issue 16): gathers scatter their cotangent back with an
# add, masks and indices carry none.


def const(name: str, values, elem: str) -> str:
    arr = np.asarray(values)
    text = np.array2string(arr, separator=", ").replace("True", "true").replace("False", "false")
    return op(f"%{name} = mp.constant {{value = dense<{text}> : {t(arr.shape, elem)}}} : () -> "
              f"{t(arr.shape, elem)}")


def test_gather_rule_adds_the_rows_an_index_picks_twice_as_jax():
    idx = np.array([[0, 2], [2, -1]])  # 2 twice, and -1 (the last) counted from the end
    body = const("i", idx, "i64") + "\n" + op(
        f"%y = mp.gather %x, %i {{axis = 1}} : ({t((3, 4))}, {t((2, 2), 'i64')}) -> "
        f"{t((3, 2, 2))}")
    check({"x": (3, 4)}, body, (3, 2, 2), lambda x: jnp.take(x, idx % 4, axis=1))
    # A scalar index along a negative axis: the row (here column) of a single lookup.
    body = const("i", np.array(-2), "i32") + "\n" + op(
        f"%y = mp.gather %x, %i {{axis = -1}} : ({t((3, 4))}, {t((), 'i32')}) -> {t((3,))}")
    check({"x": (3, 4)}, body, (3,), lambda x: x[:, 2])


def test_gather_elements_rule_matches_jax():
    idx = np.array([[0, 2, 2, 1], [2, 2, -3, 0]])
    body = const("i", idx, "i32") + "\n" + op(
        f"%y = mp.gather_elements %x, %i {{axis = 0}} : ({t((3, 4))}, {t((2, 4), 'i32')}) -> "
        f"{t((2, 4))}")
    check({"x": (3, 4)}, body, (2, 4), lambda x: jnp.take_along_axis(x, idx % 3, axis=0))


@pytest.mark.parametrize("batch_dims", [0, 1])
def test_gather_nd_rule_matches_jax_with_and_without_batch_dims(batch_dims):
    if batch_dims == 0:
        idx, out = np.array([[1, 2], [0, -1], [1, 2]]), (3, 2)  # (1, 2) twice
        fn = lambda x: x[idx[:, 0] % 2, idx[:, 1] % 3]
    else:
        idx, out = np.array([[[1], [1]], [[0], [2]]]), (2, 2, 2)
        fn = lambda x: x[np.arange(2)[:, None], idx[..., 0]]
    body = const("i", idx, "i64") + "\n" + op(
        f"%y = mp.gather_nd %x, %i {{batch_dims = {batch_dims}}} : ({t((2, 3, 2))}, "
        f"{t(idx.shape, 'i64')}) -> {t(out)}")
    check({"x": (2, 3, 2)}, body, out, fn)


def test_where_rule_masks_the_cotangent_to_each_branch_and_sums_broadcasts():
    body = "\n".join([
        op(f"%c = mp.greater %m, %x : ({t((2, 3))}, {t((2, 3))}) -> {t((2, 3), 'i1')}"),
        op(f"%y = mp.where %c, %x, %z : ({t((2, 3), 'i1')}, {t((2, 3))}, {t((1, 3))}) -> "
           f"{t((2, 3))}")])
    check({"m": (2, 3), "x": (2, 3), "z": (1, 3)}, body, (2, 3),
          lambda m, x, z: jnp.where(m > x, x, z))


def test_masks_and_indices_carry_no_gradient_through_predicates_logic_and_argmax():
    # Every i1/i32 value is a constant to grad: d/dm of m is zero wherever it only decides.
    x = np.array([[0.5, -1.0, np.inf], [2.0, np.nan, -0.25]], F32)
    s = t((2, 3))
    b = t((2, 3), "i1")
    body = "\n".join([
        op(f"%nan = mp.isnan %x : ({s}) -> {b}"),
        op(f"%inf = mp.isinf %x {{detect_negative = false}} : ({s}) -> {b}"),
        op(f"%bad = mp.logical_or %nan, %inf : ({b}, {b}) -> {b}"),
        op(f"%ok = mp.logical_not %bad : ({b}) -> {b}"),
        op(f"%le = mp.less_equal %m, %m : ({s}, {s}) -> {b}"),
        op(f"%lt = mp.less %m, %m : ({s}, {s}) -> {b}"),
        op(f"%ge = mp.greater_equal %m, %m : ({s}, {s}) -> {b}"),
        op(f"%eq = mp.equal %m, %m : ({s}, {s}) -> {b}"),
        op(f"%one = mp.logical_xor %le, %lt : ({b}, {b}) -> {b}"),
        op(f"%two = mp.logical_and %ge, %eq : ({b}, {b}) -> {b}"),
        op(f"%all = mp.logical_and %one, %two : ({b}, {b}) -> {b}"),
        op(f"%keep = mp.logical_and %ok, %all : ({b}, {b}) -> {b}"),
        op(f"%safe = mp.where %keep, %x, %m : ({b}, {s}, {s}) -> {s}"),
        op(f"%am = mp.argmax %safe {{axis = 1, keepdims = true}} : ({s}) -> {t((2, 1), 'i32')}"),
        op(f"%y = mp.gather_elements %safe, %am {{axis = 1}} : ({s}, {t((2, 1), 'i32')}) -> "
           f"{t((2, 1))}")])

    def fn(x, m):
        safe = jnp.where(~(jnp.isnan(x) | jnp.isposinf(x)), x, m)
        return jnp.take_along_axis(safe, jnp.argmax(safe, 1, keepdims=True), 1)
    check({"x": (2, 3), "m": (2, 3)}, body, (2, 1), fn, values={"x": x})


def test_expand_rule_sums_the_cotangent_back_to_the_input_shape():
    check({"x": (3, 1)}, op(f"%y = mp.expand %x : ({t((3, 1))}) -> {t((2, 3, 4))}"), (2, 3, 4),
          lambda x: jnp.broadcast_to(x, (2, 3, 4)))


@pytest.mark.parametrize("upper,k,fn", [("true", 0, lambda x: jnp.triu(x, 0)),
                                         ("false", 1, lambda x: jnp.tril(x, 1))])
def test_trilu_rule_keeps_the_same_triangle_of_the_cotangent(upper, k, fn):
    check({"x": (2, 3, 4)}, op(f"%y = mp.trilu %x {{upper = {upper}, k = {k}}} : "
                               f"({t((2, 3, 4))}) -> {t((2, 3, 4))}"), (2, 3, 4), fn)


def test_pow_rule_matches_jax_for_base_and_broadcast_exponent():
    check({"a": (2, 3), "b": (3,)},
          op(f"%y = mp.pow %a, %b : ({t((2, 3))}, {t((3,))}) -> {t((2, 3))}"), (2, 3),
          jnp.power, positive=("a",))


def test_pow_rule_gives_the_exponent_a_zero_gradient_at_a_zero_base_as_jax():
    a = np.array([[1.5, 0.0, 1.5], [0.5, 0.0, 0.5]], F32)
    b = np.array([0.0, 2.0, -1.0], F32)  # 0^2 at the zero base; x^0 and x^-1 elsewhere
    check({"a": (2, 3), "b": (3,)},
          op(f"%y = mp.pow %a, %b : ({t((2, 3))}, {t((3,))}) -> {t((2, 3))}"), (2, 3),
          jnp.power, values={"a": a, "b": b})


@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_cumsum_rule_is_the_cumsum_the_other_way(exclusive, reverse):
    def fn(x):
        x = jnp.flip(x, 1) if reverse else x
        y = jnp.cumsum(x, axis=1)
        if exclusive:
            y = jnp.concatenate([jnp.zeros_like(y[:, :1]), y[:, :-1]], axis=1)
        return jnp.flip(y, 1) if reverse else y
    flags = f"exclusive = {str(exclusive).lower()}, reverse = {str(reverse).lower()}"
    check({"x": (2, 5)}, op(f"%y = mp.cumsum %x {{axis = -1, {flags}}} : ({t((2, 5))}) -> "
                            f"{t((2, 5))}"), (2, 5), fn)


def test_slice_rule_puts_strided_and_reversed_picks_back_in_place():
    check({"x": (5, 6, 3)},
          op(f"%y = mp.slice %x {{starts = [4, 1, 1], ends = [-10, 6, 3], steps = [-2, 2, 1]}}"
             f" : ({t((5, 6, 3))}) -> {t((3, 3, 2))}"), (3, 3, 2), lambda x: x[4::-2, 1::2, 1:])


M, U, V = t((3, 4)), t((2, 4)), t((3,))
SCATTERS = "\n".join([
    f"func.func @main(%x: {M}, %u: {U}, %v: {V}) -> ({M}, {M}) {{",
    const("i", [[0, 2, 2, -1], [0, 0, 1, 2]], "i64"),
    const("j", [[2, 1], [-1, 0], [2, 1]], "i64"),
    op(f"%0 = mp.scatter_elements_add %x, %i, %u {{axis = 0}} : ({M}, {t((2, 4), 'i64')}, {U})"
       f" -> {M}"),
    op(f"%1 = mp.scatter_nd_add %x, %j, %v : ({M}, {t((3, 2), 'i64')}, {V}) -> {M}"),
    op(f"return %0, %1 : {M}, {M}"), "}"])

def test_scatter_adds_sum_repeated_indices_and_match_onnxruntime():
    from mplower.ir.diagnostics import Location
    from mplower.onnx.exporter import check_and_serialize, export_module
    ort = pytest.importorskip("onnxruntime")
    module = parse(SCATTERS)
    rng = np.random.default_rng(0)
    x, u, v = (rng.standard_normal(s).astype(F32) for s in ((3, 4), (2, 4), (3,)))
    ours = Program(module).run([x, u, v], reference=False).outputs
    # Column 0 gets both of its updates in row 0; (2, 1) is addressed twice (once as -1 = 2).
    assert ours[0][0, 0] == F32(x[0, 0] + u[0, 0] + u[1, 0])
    assert ours[1][2, 1] == F32(F32(x[2, 1] + v[0]) + v[2])
    assert ours[1][2, 0] == F32(x[2, 0] + v[1])
    exported = export_module(module).model
    assert [n.op_type for n in exported.graph.node if n.op_type.startswith("Scatter")] == \
        ["ScatterElements", "ScatterND"]
    session = ort.InferenceSession(check_and_serialize(exported, Location("t", 0, 0)),
                                   providers=["CPUExecutionProvider"])
    theirs = session.run(None, dict(zip((i.name for i in session.get_inputs()), (x, u, v))))
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)



def test_scatter_add_rules_pass_the_cotangent_to_data_and_gather_it_for_updates():
    i = np.array([[0, 2, 2, -1], [0, 0, 1, 2]])
    j = np.array([[1, 2], [0, 1], [1, 2]])  # the pair (1, 2) twice

    def scatter_elements(x, u):
        return jnp.asarray(x).at[i % 3, np.arange(4)].add(u)
    check({"x": (3, 4), "u": (2, 4)}, const("i", i, "i64") + "\n" + op(
        f"%y = mp.scatter_elements_add %x, %i, %u {{axis = 0}} : ({M}, {t((2, 4), 'i64')}, {U})"
        f" -> {M}"), (3, 4), scatter_elements)
    check({"x": (2, 3, 4), "v": (3, 4)}, const("j", j, "i32") + "\n" + op(
        f"%y = mp.scatter_nd_add %x, %j, %v : ({t((2, 3, 4))}, {t((3, 2), 'i32')}, "
        f"{t((3, 4))}) -> {t((2, 3, 4))}"), (2, 3, 4),
        lambda x, v: jnp.asarray(x).at[j[:, 0], j[:, 1]].add(v))

@pytest.mark.parametrize("line,message", [
    (f"%0 = mp.scatter_elements_add %x, %i, %x : ({M}, {t((2, 4), 'i64')}, {M}) -> {M}",
     ("'mp.scatter_elements_add' updates tensor<3x4xf32> must have the shape of indices "
      "tensor<2x4xi64>")),
    (f"%0 = mp.scatter_nd_add %x, %j, %u : ({M}, {t((3, 2), 'i64')}, {U}) -> {M}",
     ("'mp.scatter_nd_add' updates tensor<2x4xf32> must have shape [3] (what gather_nd of "
      "tensor<3x4xf32> at tensor<3x2xi64> gives)")),
])
def test_scatter_add_with_updates_of_the_wrong_shape_is_a_located_error(line, message):
    text = "\n".join([f"func.func @main(%x: {M}, %u: {U}) -> {M} {{",
                      const("i", [[0, 2, 2, -1], [0, 0, 1, 2]], "i64"),
                      const("j", [[2, 1], [-1, 0], [2, 1]], "i64"),
                      op(line), op(f"return %0 : {M}"), "}"])
    with pytest.raises(DiagnosticError) as e:
        verify(parse(text))
    assert str(e.value.diagnostics[0].loc) == "<stdin>:7:3"  # after two multi-line constants
    assert e.value.diagnostics[0].message == message


def test_lrn_rule_of_size_one_matches_jax():
    check({"x": (1, 3, 2)}, op(f"%y = mp.lrn %x {{size = 1}} : ({t((1, 3, 2))}) -> "
                               f"{t((1, 3, 2))}"), (1, 3, 2), lambda x: _lrn(x, 1, 1e-4, 0.75, 1.0))
