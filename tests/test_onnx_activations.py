"""Activations and elementwise math (mplower.dialect.mp.activations) against onnxruntime.

Each ONNX op runs as a one-node model in onnxruntime and through mplower's importer and
executor, in fp32; the same ops behind a matmul run as a bf16 plan from the bf16 sheet (the
activation follows its bf16 input, sin stays f32) and that plan's ONNX export runs in
onnxruntime with the executor's bits. Gradient rules are checked against JAX, range rules
against the image of sampled points, and the precision class of every op against the sheets.
Where onnxruntime has no kernel for an op's opset (SwiGLU-28, BitShift-28 on signed types),
onnx's own reference implementation stands in.
"""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from mplower.backend.executor import Program
from mplower.dialect.plan import Plan
from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.ir.opdef import OPS
from mplower.onnx import exporter, importer
from mplower.pass_manager import PassManager, parse_pipeline

F32 = np.float32
BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(32)
# Values over the ranges where the activations bend, and the points where they switch branch.
WIDE = np.concatenate([np.linspace(-8, 8, 97), [0.0, -0.0, 0.5, -0.5, 3.0, -3.0, 1.5, -1.5],
                       RNG.standard_normal(45) * 4]).astype(F32).reshape(3, 5, 10)
UNIT = np.concatenate([np.linspace(-0.999, 0.999, 60), [0.0, 0.5, -0.5],
                       RNG.uniform(-1, 1, 87)]).astype(F32).reshape(3, 5, 10)
ABOVE_ONE = (1 + np.abs(WIDE)).astype(F32)


def _model(op: str, inputs: list[np.ndarray], opset: int = 21, n_out: int = 1,
           **attrs) -> onnx.ModelProto:
    names = [f"in{i}" for i in range(len(inputs))]
    node = helper.make_node(op, names, [f"out{k}" for k in range(n_out)], **attrs)
    ins = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
           for n, a in zip(names, inputs)]
    outs = [helper.make_tensor_value_info(f"out{k}", TensorProto.UNDEFINED, None)
            for k in range(n_out)]
    model = helper.make_model(helper.make_graph([node], op, ins, outs),
                              opset_imports=[helper.make_opsetid("", opset)])
    return onnx.shape_inference.infer_shapes(model)


def _theirs(model: onnx.ModelProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """onnxruntime's outputs, or onnx's reference implementation's where onnxruntime has no
    kernel for the op at this opset."""
    feeds = {f"in{i}": a for i, a in enumerate(inputs)}
    try:
        session = ort.InferenceSession(model.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001  (NOT_IMPLEMENTED and the like, by message only)
        with np.errstate(all="ignore"):
            return ReferenceEvaluator(model).run(None, feeds)
    return session.run(None, feeds)


def _ours(model: onnx.ModelProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
    module = importer.import_model(model, "case.onnx", inline_weights=True).module
    with np.errstate(all="ignore"):
        return [np.asarray(o) for o in Program(module).run(inputs, reference=False).outputs]


# (ONNX op, inputs, attributes, opset)
CASES = [
    ("HardSigmoid", [WIDE], {}, 21),
    ("HardSigmoid", [WIDE], {"alpha": 0.3, "beta": 0.4}, 21),
    ("HardSwish", [WIDE], {}, 21),
    ("LeakyRelu", [WIDE], {}, 21),
    ("LeakyRelu", [WIDE], {"alpha": 0.2}, 21),
    ("Elu", [WIDE], {"alpha": 0.7}, 21),
    ("Selu", [WIDE], {}, 21),
    ("Celu", [WIDE], {"alpha": 2.0}, 21),
    ("Mish", [WIDE], {}, 21),
    ("Softplus", [WIDE * 4], {}, 21),
    ("Softsign", [WIDE], {}, 21),
    ("ThresholdedRelu", [WIDE], {"alpha": 0.5}, 21),
    ("Swish", [WIDE], {"alpha": 0.8}, 24),
    ("Shrink", [WIDE], {"bias": 0.25, "lambd": 1.5}, 21),
    ("Hardmax", [np.round(WIDE)], {"axis": 1}, 21),
    ("Hardmax", [np.round(WIDE)], {"axis": 1}, 11),  # coerced to 2-D before opset 13
    ("Abs", [WIDE], {}, 21),
    ("Abs", [np.array([-128, -3, 0, 7, 127], np.int8)], {}, 21),
    ("Sign", [WIDE], {}, 21),
    ("Sign", [np.array([-5, 0, 9], np.int32)], {}, 21),
    ("Floor", [WIDE * 1.3], {}, 21),
    ("Ceil", [WIDE * 1.3], {}, 21),
    ("Round", [np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.49999997, -3.7], F32)], {}, 21),
    ("Sin", [WIDE * 100], {}, 21),
    ("Cos", [WIDE * 100], {}, 21),
    ("Tan", [UNIT * 1.5], {}, 21),
    ("Asin", [UNIT], {}, 21),
    ("Acos", [UNIT], {}, 21),
    ("Atan", [WIDE], {}, 21),
    ("Sinh", [WIDE], {}, 21),
    ("Cosh", [WIDE], {}, 21),
    ("Asinh", [WIDE], {}, 21),
    ("Acosh", [ABOVE_ONE], {}, 21),
    ("Atanh", [UNIT], {}, 21),
    ("Mod", [np.array([-7, -3, 5, 9, 4], np.int32), np.array([3, -2, -3, 4, 2], np.int32)],
     {}, 21),
    ("Mod", [np.array([-7, -3, 5, 9, 4], np.int32), np.array([3, -2, -3, 4, 2], np.int32)],
     {"fmod": 1}, 21),
    ("Mod", [WIDE, np.full((10,), 1.75, F32)], {"fmod": 1}, 21),
    ("Clip", [WIDE, np.array(-1.5, F32), np.array(2.0, F32)], {}, 21),
    ("Clip", [np.array([-9, -1, 0, 4, 12], np.int32), np.array(-2, np.int32),
              np.array(5, np.int32)], {}, 21),
    ("PRelu", [WIDE, RNG.uniform(0, 0.5, (5, 1)).astype(F32)], {}, 21),
    ("Mean", [WIDE, WIDE * 0.5, -WIDE * 0.25], {}, 21),
    ("SwiGLU", [WIDE, WIDE * 0.5], {"alpha": 1.702}, 28),
    ("BitwiseAnd", [np.array([12, 250, 7], np.uint8), np.array([10, 15, 255], np.uint8)],
     {}, 21),
    ("BitwiseOr", [np.array([-12, 3, 7], np.int16), np.array([10, -15, 0], np.int16)], {}, 21),
    ("BitwiseXor", [np.array([12, 3, 7], np.int32), np.array([10, 15, -1], np.int32)], {}, 21),
    ("BitwiseNot", [np.array([0, 1, 200, 255], np.uint8)], {}, 21),
    ("BitwiseNot", [np.array([0, -1, 77], np.int64)], {}, 21),
    ("BitShift", [np.array([1, 200, 255], np.uint8), np.array([1, 2, 7], np.uint8)],
     {"direction": "LEFT"}, 21),
    ("BitShift", [np.array([1, 200, 255], np.uint32), np.array([1, 2, 40], np.uint32)],
     {"direction": "RIGHT"}, 21),
    ("BitShift", [np.array([-16, 16, -1], np.int8), np.array([2, 9, 1], np.int8)],
     {"direction": "RIGHT"}, 28),
    ("EyeLike", [np.zeros((3, 5), F32)], {"k": 1}, 21),
    ("EyeLike", [np.zeros((4, 2), F32)], {"k": -1, "dtype": TensorProto.INT32}, 21),
]


def _id(case) -> str:
    op, ins, attrs, opset = case
    return f"{op}-{ins[0].dtype}-{'-'.join(f'{k}{v}' for k, v in attrs.items())}-{opset}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_each_op_matches_onnxruntime_in_fp32(case) -> None:
    op, inputs, attrs, opset = case
    model = _model(op, inputs, opset, **attrs)
    (theirs,) = _theirs(model, inputs)
    (ours,) = _ours(model, inputs)
    assert ours.shape == theirs.shape
    if theirs.dtype.kind in "iub":  # the executor holds integers as their int64 values
        np.testing.assert_array_equal(ours, theirs.astype(np.int64))
    else:
        assert ours.dtype == theirs.dtype
        # mplower computes in float64 and rounds once; onnxruntime's float kernels
        # approximate (a few ulps for the transcendental ones).
        np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=2e-6)


# ---- bf16 plans -------------------------------------------------------------------------------

# The float activations a bf16 sheet lowers (the @activation and @value-preserving groups).
FOLLOWING = [("HardSigmoid", {}), ("HardSwish", {}), ("LeakyRelu", {"alpha": 0.1}),
             ("Elu", {}), ("Selu", {}), ("Celu", {"alpha": 0.5}), ("Mish", {}),
             ("Softplus", {}), ("Softsign", {}), ("ThresholdedRelu", {"alpha": 0.25}),
             ("Shrink", {"lambd": 0.3, "bias": 0.1}), ("Abs", {}), ("Sign", {}),
             ("Floor", {}), ("Ceil", {}), ("Round", {}), ("Swish", {"alpha": 1.5})]


def _bf16_chain(op: str, attrs: dict) -> onnx.ModelProto:
    """x -> Cast(bf16) -> op -> Cast(f32): the op on bf16 values, as an exporter writes it."""
    opset = 24 if op == "Swish" else 21
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
             helper.make_node(op, ["xb"], ["yb"], **attrs),
             helper.make_node("Cast", ["yb"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, op, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                        WIDE.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, WIDE.shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("op,attrs", FOLLOWING, ids=[op for op, _ in FOLLOWING])
def test_a_bf16_activation_is_its_f32_value_rounded_once(op, attrs) -> None:
    """The executor's bf16 op: the f32 value of the op on the bf16 operand, rounded once to
    bf16 (by ml_dtypes), bit for bit."""
    xb = WIDE.astype(BF16).astype(np.float64)
    f64_model = _model(op, [xb], 24 if op == "Swish" else 21, **attrs)
    # onnx's reference implementation in float64, rounded to f32 and then to bf16: the f32
    # value correctly rounded (onnxruntime's f32 kernels approximate, its Sigmoid by 1e-3 in
    # the far tail), then its one bf16 rounding.
    (exact,) = ReferenceEvaluator(f64_model).run(None, {"in0": xb})
    want = exact.astype(F32).astype(BF16).astype(F32)
    (ours,) = _ours(_bf16_chain(op, attrs), [WIDE])
    # Signed zeros aside: ONNX's formulas give +0 or -0 at x = -0 depending on how they are
    # written (onnxruntime's Selu gives +0, onnx's reference -0).
    np.testing.assert_array_equal((ours + F32(0)).view(np.uint32),
                                  (want + F32(0)).view(np.uint32))


def _matmul_then(op: str, attrs: dict, then_sin: bool = False) -> onnx.ModelProto:
    w = RNG.standard_normal((10, 10)).astype(F32) * 0.5
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node(op, ["h"], ["a" if then_sin else "y"], **attrs)]
    if then_sin:
        nodes.append(helper.make_node("Sin", ["a"], ["y"]))
    graph = helper.make_graph(
        nodes, op, [helper.make_tensor_value_info("x", TensorProto.FLOAT, WIDE.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, WIDE.shape)],
        [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(
        "", 24 if op == "Swish" else 21)])


@pytest.mark.parametrize("op,attrs", FOLLOWING, ids=[op for op, _ in FOLLOWING])
def test_bf16_sheet_lowers_the_activation_and_its_export_runs_in_onnxruntime(op, attrs) -> None:
    module = importer.import_model(_matmul_then(op, attrs, then_sin=True), "m.onnx",
                                   inline_weights=True).module
    PassManager(parse_pipeline("assign-precision{policy=bf16},insert-casts")).run(module)
    f = module.function(None)
    plans = {f.op(n): Plan.at(f, n) for n in f.ops() if f.op(n) not in ("mp.cast", "return")
             and f.op(n) != "mp.constant"}
    mp_op = next(o for o in plans if o not in ("mp.matmul", "mp.sin"))
    assert (plans[mp_op].precision, plans[mp_op].reason) == ("bf16", "follow: inputs bf16")
    # sin's argument is an angle: a bf16 rounding of it is an absolute error of ulp(x).
    assert (plans["mp.sin"].precision, plans["mp.sin"].reason) == ("f32", "not-listed")
    (ours,) = Program(module).run([WIDE], reference=False).outputs
    data = exporter.check_and_serialize(exporter.export_module(module).model,
                                        Location("m.ir", 0, 0))
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    (theirs,) = session.run(None, {session.get_inputs()[0].name: WIDE})
    # The same roundings in the same places; onnxruntime's f32 matmul and transcendental
    # kernels may land an ulp away, which a bf16 rounding can turn into one bf16 ulp.
    np.testing.assert_allclose(ours, theirs, rtol=2 ** -7, atol=1e-6)


# ---- export of every op -------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_each_op_exports_to_onnx_that_onnxruntime_runs_with_the_executors_result(case) -> None:
    op, inputs, attrs, opset = case
    if opset == 28:
        pytest.skip("onnxruntime has no kernel for this op at opset 28")
    module = importer.import_model(_model(op, inputs, opset, **attrs), "m.onnx",
                                   inline_weights=True).module
    with np.errstate(all="ignore"):
        ours = [np.asarray(o) for o in Program(module).run(inputs, reference=False).outputs]
    data = exporter.check_and_serialize(exporter.export_module(module).model,
                                        Location("m.ir", 0, 0))
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    theirs = session.run(None, {i.name: x for i, x in zip(session.get_inputs(), inputs)})
    for a, b in zip(ours, theirs):
        if b.dtype.kind in "iub":
            np.testing.assert_array_equal(a, b.astype(np.int64))
        else:
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)


# ---- precision classes ----------------------------------------------------------------------------


def test_sheets_take_the_precision_class_of_each_op_from_its_traits() -> None:
    from mplower.lowering.policy import load_policy

    bf16, fp8, int8 = (load_policy(n) for n in ("bf16", "fp8", "int8"))
    activations = {"mp.hard_sigmoid", "mp.hard_swish", "mp.leaky_relu", "mp.prelu", "mp.elu",
                   "mp.selu", "mp.celu", "mp.mish", "mp.softplus", "mp.softsign", "mp.swish",
                   "mp.shrink", "mp.hardmax", "mp.sign", "mp.floor", "mp.ceil", "mp.round"}
    picks = {"mp.abs", "mp.clip", "mp.thresholded_relu"}
    wide = {"mp.sin", "mp.cos", "mp.tan", "mp.asin", "mp.acos", "mp.atan", "mp.sinh",
            "mp.cosh", "mp.asinh", "mp.acosh", "mp.atanh", "mp.mod"}
    for op in activations | picks:
        assert bf16.listed(op) == "follow", op
    for op in activations:
        assert fp8.listed(op) == int8.listed(op) == "deny", op
    for op in wide:
        assert bf16.listed(op) is None and fp8.listed(op) is None, op


# ---- range rules ----------------------------------------------------------------------------------

UNARY_OPS = sorted(n for n, d in OPS.items()
                   if d.bounds is not None and d.max_operands == 1 and n != "mp.bitwise_not")


@pytest.mark.parametrize("op", UNARY_OPS)
def test_range_rule_holds_the_image_of_every_sampled_point_and_is_tight(op) -> None:
    from mplower.ir.opdef import check_attrs
    from mplower.ir.types import tensor

    opdef = OPS[op]
    attrs = check_attrs(opdef, {})
    rng = np.random.default_rng(7)
    for lo, hi in [(-3.0, 2.0), (-0.9, 0.6), (0.2, 5.0), (-20.0, -1.2), (1.1, 40.0),
                   *(sorted(rng.uniform(-6, 6, 2)) for _ in range(6))]:
        edges = [e for e in (-1.0, 1.0) if lo < e < hi]  # where asin, acos, acosh end
        xs = np.concatenate([np.linspace(lo, hi, 20001), [lo, hi], edges]).astype(np.float64)
        with np.errstate(all="ignore"):
            ys = opdef.reference([xs], attrs, [tensor(xs.shape, "f64")])[0]
        ys = ys[~np.isnan(ys)]
        if ys.size == 0:
            continue
        b_lo, b_hi = opdef.bounds([(lo, hi)], attrs)
        assert b_lo <= ys.min() + 1e-12 and ys.max() <= b_hi + 1e-12, (op, lo, hi)
        if math.isfinite(b_lo) and math.isfinite(b_hi):  # tight to the sampling's resolution
            span = max(ys.max() - ys.min(), 1.0)
            assert ys.min() - b_lo <= 1e-3 * span and b_hi - ys.max() <= 1e-3 * span, \
                (op, lo, hi, (b_lo, b_hi), (ys.min(), ys.max()))


def test_range_analysis_reads_the_ops_rule_for_clip_and_for_sin() -> None:
    from mplower.ir.types import tensor
    from mplower.passes.range_analysis import Interval, propagate

    t = tensor((4,), "f32")
    got = propagate("mp.clip", [Interval(-1e9, 1e9), Interval(-6.0, -6.0), Interval(6.0, 6.0)],
                    {}, [t, t, t], t, [None] * 3)
    assert (got.lo, got.hi) == (-6.0, 6.0)  # relu6: no overflow in any format
    got = propagate("mp.sin", [Interval(0.1, 1.0)], {}, [t], t, [None])
    assert (got.lo, got.hi) == (math.sin(0.1), math.sin(1.0))
    assert got.tiny == math.sin(0.1)  # away from zero: the smallest magnitude is known


def test_the_declared_minima_of_mish_and_swish_are_where_their_slope_is_zero() -> None:
    from mplower.dialect.mp import activations

    def slope(fn, x: float, h: float = 1e-6) -> float:
        return (fn(np.array(x + h)) - fn(np.array(x - h))) / (2 * h)

    mish = lambda x: x * np.tanh(np.logaddexp(0, x))
    swish = lambda x: x / (1 + np.exp(-x))
    assert abs(slope(mish, activations._MISH_MIN_AT)) < 1e-9
    assert abs(slope(swish, activations._SWISH_MIN_AT)) < 1e-9


# ---- gradients --------------------------------------------------------------------------------------


def _grad_check(args: dict[str, np.ndarray], line: str, fn) -> None:
    """sum(op(args) * probe) through mplower's grad pass against jax.grad."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    shape = next(iter(args.values())).shape
    t = "tensor<" + "".join(f"{d}x" for d in shape) + "f32>"
    sig = ", ".join(f"%{n}: tensor<" + "".join(f"{d}x" for d in a.shape) + "f32>"
                    for n, a in args.items())
    text = (f"func.func @main({sig}, %probe: {t}) -> tensor<f32> {{\n  {line}\n"
            f"  %l = mp.mul %y, %probe : ({t}, {t}) -> {t}\n"
            f"  %loss = mp.reduce_sum %l {{axes = [], keepdims = false}} : ({t}) -> tensor<f32>\n"
            f"  return %loss : tensor<f32>\n}}\n")
    from mplower.ir.parser import parse

    module = parse(text)
    PassManager(parse_pipeline("grad{wrt=args}")).run(module)
    probe = np.random.default_rng(1).standard_normal(shape).astype(F32)
    outs = Program(module).run([*args.values(), probe], reference=False).outputs
    ref = jax.grad(lambda *xs: jnp.sum(fn(*xs) * probe), argnums=tuple(range(len(args))))(
        *args.values())
    for name, ours, want in zip(args, outs[1:], ref):
        want = np.asarray(want, np.float64)
        err = np.linalg.norm(ours - want) / max(np.linalg.norm(want), 1e-30)
        assert err <= 1e-5, (name, err)


# Points away from the kinks, where both sides agree on one derivative.
X = np.array([[-4.2, -2.7, -1.3, -0.6, -0.2], [0.15, 0.45, 1.1, 2.6, 3.4]], F32)
XU = np.array([[-0.9, -0.55, -0.3, -0.1, 0.05], [0.2, 0.35, 0.6, 0.8, 0.95]], F32)
T = "tensor<2x5xf32>"
def _grads(jax) -> list:
    jnp = jax.numpy
    return [
        ("hard_sigmoid", "", X, lambda x: jnp.clip(0.2 * x + 0.5, 0, 1)),
        ("hard_swish", "", X, lambda x: x * jnp.clip(x / 6 + 0.5, 0, 1)),
        ("leaky_relu", "{alpha = 0.1 : f32} ", X, lambda x: jnp.where(x < 0, 0.1 * x, x)),
        ("elu", "{alpha = 0.7 : f32} ", X, lambda x: jnp.where(x > 0, x, 0.7 * jnp.expm1(x))),
        ("selu", "", X, jax.nn.selu),
        ("celu", "{alpha = 2.0 : f32} ", X, lambda x: jax.nn.celu(x, 2.0)),
        ("mish", "", X, lambda x: x * jnp.tanh(jax.nn.softplus(x))),
        ("softplus", "", X, jax.nn.softplus),
        ("softsign", "", X, jax.nn.soft_sign),
        ("thresholded_relu", "{alpha = 0.3 : f32} ", X, lambda x: jnp.where(x > 0.3, x, 0.0)),
        ("swish", "{alpha = 1.5 : f32} ", X, lambda x: x * jax.nn.sigmoid(1.5 * x)),
        ("shrink", "{lambd = 0.5 : f32, bias = 0.2 : f32} ", X,
         lambda x: jnp.where(x < -0.5, x + 0.2, jnp.where(x > 0.5, x - 0.2, 0.0))),
        ("abs", "", X, jnp.abs),
        ("floor", "", X, jnp.floor),
        ("sin", "", X, jnp.sin), ("cos", "", X, jnp.cos), ("tan", "", XU, jnp.tan),
        ("asin", "", XU, jnp.arcsin), ("acos", "", XU, jnp.arccos), ("atan", "", X, jnp.arctan),
        ("sinh", "", X, jnp.sinh), ("cosh", "", X, jnp.cosh), ("asinh", "", X, jnp.arcsinh),
        ("acosh", "", np.abs(X) + 1.1, jnp.arccosh), ("atanh", "", XU, jnp.arctanh),
    ]


GRAD_OPS = ["hard_sigmoid", "hard_swish", "leaky_relu", "elu", "selu", "celu", "mish",
            "softplus", "softsign", "thresholded_relu", "swish", "shrink", "abs", "floor", "sin",
            "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh"]


@pytest.mark.parametrize("name", GRAD_OPS)
def test_unary_gradient_rules_match_jax(name) -> None:
    jax = pytest.importorskip("jax")
    ((_, attrs, x, fn),) = [g for g in _grads(jax) if g[0] == name]
    _grad_check({"x": x}, f"%y = mp.{name} %x {attrs}: ({T}) -> {T}", fn)


def test_binary_gradient_rules_match_jax_for_both_operands() -> None:
    jnp = pytest.importorskip("jax").numpy
    slope = np.array([0.1, 0.2, 0.3, 0.4, 0.5], F32)
    _grad_check({"x": X, "s": slope},
                f"%y = mp.prelu %x, %s : ({T}, tensor<5xf32>) -> {T}",
                lambda x, s: jnp.where(x < 0, s * x, x))
    d = np.full((2, 5), 0.7, F32) + X * 0.01
    _grad_check({"a": X, "b": d}, f"%y = mp.mod %a, %b {{fmod = true}} : ({T}, {T}) -> {T}",
                jnp.fmod)
    lo, hi = np.array(-1.0, F32), np.array(2.0, F32)
    _grad_check({"x": X, "lo": lo, "hi": hi},
                f"%y = mp.clip %x, %lo, %hi : ({T}, tensor<f32>, tensor<f32>) -> {T}",
                lambda x, a, b: jnp.minimum(jnp.maximum(x, a), b))


# ---- what is refused, and where ---------------------------------------------------------------


def _diagnostic(model: onnx.ModelProto) -> str:
    with pytest.raises(DiagnosticError) as info:
        importer.import_model(model, "bad.onnx")
    return info.value.diagnostics[0].message


def test_a_clip_bound_of_several_values_is_a_located_error() -> None:
    x, lo = WIDE, np.zeros((10,), F32)
    assert "operand #1 must hold one value" in _diagnostic(_model("Clip", [x, lo]))


def test_swiglu_of_two_shapes_and_mean_of_integers_are_located_errors() -> None:
    # (onnx's shape inference refuses it before the handler's own check does)
    assert "SwiGLU" in _diagnostic(_model("SwiGLU", [WIDE, WIDE[:, :, :1]], 28))
    ints = np.arange(6, dtype=np.int32)
    assert "ONNX Mean takes float tensors" in _diagnostic(_model("Mean", [ints, ints]))


def test_clip_of_opset_6_takes_its_bounds_from_attributes_and_defaults_to_floats_range() -> None:
    x = np.array([-np.inf, -5.0, 0.5, 9.0, np.inf], F32)
    (y,) = _ours(_model("Clip", [x], 6, max=2.0), [x])
    big = np.finfo(F32).max
    np.testing.assert_array_equal(y, np.array([-big, -5.0, 0.5, 2.0, 2.0], F32))


def test_clip_with_only_an_upper_bound_clips_nothing_below(tmp_path: Path) -> None:
    x = np.array([-np.inf, -5.0, 0.5, 9.0], F32)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Clip", ["x", "", "hi"], ["y"])], "clip",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.array(1.0, F32), "hi")]),
        opset_imports=[helper.make_opsetid("", 13)])
    (y,) = _ours(model, [x])
    np.testing.assert_array_equal(y, np.array([-np.inf, -5.0, 0.5, 1.0], F32))


def test_bitwise_ops_refuse_4_bit_codes_and_masks_which_onnx_has_no_bitwise_op_for() -> None:
    from mplower.ir.opdef import OpError
    from mplower.ir.types import tensor

    for elem in ("i4", "i1"):
        with pytest.raises(OpError, match="must have an integer element type"):
            OPS["mp.bitwise_not"].infer([tensor((3,), elem)], {})
    assert OPS["mp.bitwise_not"].infer([tensor((3,), "ui16")], {}) == [tensor((3,), "ui16")]
