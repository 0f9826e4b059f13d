"""Reductions, TopK, the norm-based normalizations and the indexing ops, imported from ONNX and
checked against onnxruntime (an independent implementation) on values; their mp ops export
back to ONNX that onnxruntime runs; and constant folding of what exporters write (the
HuggingFace BERT token-type GatherElements) works where onnx's reference evaluator fails.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mplower.backend.executor import Program
from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.onnx import exporter
from mplower.onnx.backend import MplowerBackend
from mplower.onnx.importer import import_model

ort = pytest.importorskip("onnxruntime")
F = TensorProto.FLOAT
I64 = TensorProto.INT64
_rng = np.random.default_rng(7)


def _model(nodes, inputs, outputs, inits=(), opset=18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=8)


def _vi(name, shape, t=F):
    return helper.make_tensor_value_info(name, t, shape)


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _mplower(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return MplowerBackend.prepare(model).run(feeds)


def _ops(module) -> list[str]:
    f = module.function()
    return [f.op(n) for n in f.ops()]


def _check(model: onnx.ModelProto, feeds: dict, rtol=1e-6, atol=1e-6) -> list[np.ndarray]:
    want = _ort(model, feeds)
    got = _mplower(model, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    return got


# ---- reductions -------------------------------------------------------------------------------

_REDUCES = ["ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
            "ReduceLogSumExp", "ReduceSumSquare"]


def _reduce_model(op: str, axes, keepdims: int, opset: int, noop: int = 0,
                  shape=(2, 3, 4)) -> onnx.ModelProto:
    attrs = {"keepdims": keepdims}
    inputs, inits = ["x"], []
    if opset < 18:
        if axes is not None:
            attrs["axes"] = axes
    else:
        attrs["noop_with_empty_axes"] = noop
        if axes is not None:
            inputs.append("axes")
            inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
    node = helper.make_node(op, inputs, ["y"], **attrs)
    return _model([node], [_vi("x", list(shape))], [_vi("y", None)], inits, opset)


@pytest.mark.parametrize("op", _REDUCES)
@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("axes,keepdims", [([1], 1), ([0, 2], 0), ([-1], 0), (None, 1),
                                           (None, 0)])
def test_reductions_match_onnxruntime_in_every_axes_form(op, opset, axes, keepdims) -> None:
    # Positive values keep the logarithms finite; a 0.5 offset keeps products away from zero.
    x = (_rng.random((2, 3, 4)) + 0.5).astype(np.float32)
    if op in ("ReduceMin", "ReduceL1", "ReduceSumSquare", "ReduceLogSumExp"):
        x -= 1.0  # signs matter to these
    _check(_reduce_model(op, axes, keepdims, opset), {"x": x}, rtol=2e-6)


@pytest.mark.parametrize("op", _REDUCES)
def test_noop_with_empty_axes_leaves_the_tensor_unreduced(op) -> None:
    x = (_rng.random((2, 3)) + 0.5).astype(np.float32)
    model = _reduce_model(op, [], 1, 18, noop=1, shape=(2, 3))
    got = _mplower(model, {"x": x})[0]
    # ONNX's reference: the elementwise part alone (|x|, x^2, log x, ...), no reduction.
    want = {"ReduceMin": x, "ReduceProd": x, "ReduceL1": np.abs(x), "ReduceL2": np.abs(x),
            "ReduceLogSum": np.log(x), "ReduceLogSumExp": x,
            "ReduceSumSquare": x * x}[op]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_reduce_min_and_prod_of_integers_and_over_no_elements() -> None:
    x = np.array([[3, -7, 2], [5, 1, -2]], np.int64)
    for op in ("ReduceMin", "ReduceProd"):
        node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=0)
        model = _model([node], [_vi("x", [2, 3], I64)], [_vi("y", None, I64)],
                       [numpy_helper.from_array(np.array([1], np.int64), "axes")])
        got = _check(model, {"x": x})[0]
        assert got.tolist() == ([-7, -2] if op == "ReduceMin" else [-42, -10])
    empty = np.zeros((2, 0), np.float32)
    for op, want in (("ReduceMin", np.inf), ("ReduceProd", 1.0), ("ReduceLogSumExp", -np.inf),
                     ("ReduceL2", 0.0)):
        model = _reduce_model(op, [1], 1, 18, shape=(2, 0))
        assert _mplower(model, {"x": empty})[0].tolist() == [[want], [want]]


def test_log_sum_exp_of_large_logits_does_not_overflow() -> None:
    x = np.array([[1000.0, 1000.0, 990.0]], np.float32)
    got = _check(_reduce_model("ReduceLogSumExp", [1], 0, 18, shape=(1, 3)), {"x": x})[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, [1000.0 + np.log(2 + np.exp(-10))], rtol=1e-7)


def test_reduce_l2_of_integers_is_refused_with_the_node_named() -> None:
    node = helper.make_node("ReduceL2", ["x"], ["y"], name="norm_node")
    model = _model([node], [_vi("x", [2, 3], I64)], [_vi("y", None, I64)])
    with pytest.raises(DiagnosticError) as info:
        import_model(model, "m.onnx")
    message = info.value.diagnostics[0].message
    assert "norm_node" in message and "float tensors only" in message


@pytest.mark.parametrize("op", ["ArgMin", "ArgMax"])
@pytest.mark.parametrize("last", [0, 1])
def test_argmin_with_ties_and_select_last_index(op, last) -> None:
    x = np.array([[2.0, -1.0, 5.0, -1.0, 5.0], [0.0, 0.0, 0.0, 3.0, 3.0]], np.float32)
    node = helper.make_node(op, ["x"], ["y"], axis=1, keepdims=0, select_last_index=last)
    got = _check(_model([node], [_vi("x", [2, 5])], [_vi("y", None, I64)]), {"x": x})[0]
    want = {("ArgMin", 0): [1, 0], ("ArgMin", 1): [3, 2], ("ArgMax", 0): [2, 3],
            ("ArgMax", 1): [4, 4]}[op, last]
    assert got.tolist() == want


# ---- TopK -------------------------------------------------------------------------------------


@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize("axis", [-1, 0])
def test_topk_values_and_indices_match_onnxruntime_with_ties(largest, axis) -> None:
    x = np.array([[3.0, 1.0, 3.0, 2.0], [0.5, 0.5, -1.0, 4.0], [3.0, 1.0, -2.0, 2.0]],
                 np.float32)
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=largest)
    model = _model([node], [_vi("x", [3, 4])], [_vi("v", None), _vi("i", None, I64)],
                   [numpy_helper.from_array(np.array([2], np.int64), "k")])
    values, indices = _check(model, {"x": x})
    if (largest, axis) == (1, -1):  # ties: the lower index first
        assert indices.tolist() == [[0, 2], [3, 0], [0, 3]]
        assert values.tolist() == [[3.0, 3.0], [4.0, 0.5], [3.0, 2.0]]


def test_topk_at_opset_1_takes_k_as_an_attribute() -> None:
    x = _rng.standard_normal((2, 6)).astype(np.float32)
    node = helper.make_node("TopK", ["x"], ["v", "i"], k=3)
    _check(_model([node], [_vi("x", [2, 6])], [_vi("v", None), _vi("i", None, I64)], opset=1),
           {"x": x})


# ---- normalizations ---------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("axis", [1, -1])
def test_lp_normalization_matches_onnxruntime(p, axis) -> None:
    x = _rng.standard_normal((3, 4, 5)).astype(np.float32)
    node = helper.make_node("LpNormalization", ["x"], ["y"], p=p, axis=axis)
    _check(_model([node], [_vi("x", [3, 4, 5])], [_vi("y", None)], opset=17), {"x": x})


def test_mean_variance_normalization_matches_onnxruntime() -> None:
    x = _rng.standard_normal((2, 3, 4, 5)).astype(np.float32) * 3 + 1
    # Without `axes` onnx's own shape inference of the function body fails: the importer
    # writes the default out first.
    for axes in (None, [1], [-1, 2]):
        kw = {} if axes is None else {"axes": axes}
        node = helper.make_node("MeanVarianceNormalization", ["x"], ["y"], **kw)
        _check(_model([node], [_vi("x", [2, 3, 4, 5])], [_vi("y", None)], opset=13), {"x": x},
               rtol=1e-5, atol=1e-5)


# ---- the mp ops: export, ranges, gradients ------------------------------------------------------


def test_reduction_ops_export_to_onnx_that_onnxruntime_runs() -> None:
    from mplower.ir.parser import parse

    text = """func.func @main(%x: tensor<3x4xf32>) -> (tensor<3xf32>, tensor<4xf32>,
        tensor<1x4xi32>, tensor<3x2xf32>, tensor<3x2xi64>) {
  %a = mp.reduce_min %x {axes = [1], keepdims = false} : (tensor<3x4xf32>) -> tensor<3xf32>
  %b = mp.reduce_prod %x {axes = [0], keepdims = false} : (tensor<3x4xf32>) -> tensor<4xf32>
  %c = mp.argmin %x {axis = 0} : (tensor<3x4xf32>) -> tensor<1x4xi32>
  %d = mp.topk %x {k = 2, axis = 1, largest = false} : (tensor<3x4xf32>) -> tensor<3x2xf32>
  %e = mp.topk_indices %x {k = 2, axis = 1} : (tensor<3x4xf32>) -> tensor<3x2xi64>
  return %a, %b, %c, %d, %e : tensor<3xf32>, tensor<4xf32>, tensor<1x4xi32>, tensor<3x2xf32>,
    tensor<3x2xi64>
}
"""
    module = parse(text, "r.ir")
    x = _rng.standard_normal((3, 4)).astype(np.float32)
    ours = Program(module).run([x], reference=False).outputs
    want = [x.min(1), x.prod(0), x.argmin(0)[None], np.sort(x, 1)[:, :2],
            np.argsort(-x, 1, kind="stable")[:, :2]]
    for o, w in zip(ours, want):
        np.testing.assert_allclose(np.asarray(o), w, rtol=1e-6)
    data = exporter.check_and_serialize(exporter.export_module(module).model,
                                        Location("r.ir", 0, 0))
    s = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    theirs = s.run(None, {s.get_inputs()[0].name: x})
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(np.asarray(o), t, rtol=1e-6)


def test_range_analysis_passes_min_topk_and_written_scatters_through() -> None:
    from mplower.ir.types import tensor
    from mplower.passes.range_analysis import Interval, propagate

    t = [tensor((3, 4), "f32")]
    for op, attrs, out in (("mp.reduce_min", {"axes": (1,), "keepdims": False}, (3,)),
                           ("mp.topk", {"k": 2, "axis": 1}, (3, 2))):
        got = propagate(op, [Interval(-3.0, 7.5)], attrs, t, tensor(out, "f32"), [None])
        assert (got.lo, got.hi) == (-3.0, 7.5)
    ins = [Interval(-3.0, 7.5), Interval(0.0, 2.0), Interval(-9.0, 1.0)]
    types = [tensor((3, 4), "f32"), tensor((2, 4), "i64"), tensor((2, 4), "f32")]
    for reduction, want in (("none", (-9.0, 7.5)), ("max", (-9.0, 7.5)), ("add", None)):
        got = propagate("mp.scatter_elements", ins, {"axis": 0, "reduction": reduction}, types,
                        tensor((3, 4), "f32"), [None, None, None])
        assert (got.lo, got.hi) == want if want else not got.bounded


def test_reduce_min_and_topk_gradients_go_to_the_picked_elements() -> None:
    from mplower.ir.opdef import OPS

    x = np.array([[3.0, 1.0, 2.0], [0.0, 5.0, 4.0]], np.float32)
    got = OPS["mp.topk"].reference([x], {"k": 2, "axis": 1, "largest": True})[0]
    assert got.tolist() == [[3.0, 2.0], [5.0, 4.0]]
    idx = OPS["mp.topk_indices"].reference([x], {"k": 2, "axis": 1, "largest": True})[0]
    dy = np.array([[10.0, 20.0], [30.0, 40.0]], np.float32)
    grad = OPS["mp.scatter_elements_add"].reference([np.zeros_like(x), idx, dy], {"axis": 1})[0]
    assert grad.tolist() == [[10.0, 0.0, 20.0], [0.0, 30.0, 40.0]]
    assert OPS["mp.reduce_min"].vjp is not None and OPS["mp.reduce_prod"].vjp is None


# ---- what exporters write: HuggingFace BERT's token-type ids --------------------------------------


def _bert_token_types(max_positions: int = 512, seq: int = 16) -> onnx.ModelProto:
    """What the TorchScript exporter writes for BertEmbeddings' buffered token-type ids:
    `buffered.expand(batch, -1)` then `torch.gather(..., dim=1, index=position_ids)`, all over
    constants once the batch is fixed."""
    buf = (np.arange(max_positions) % 2).astype(np.int64).reshape(1, max_positions)
    pos = np.arange(seq, dtype=np.int64).reshape(1, seq)[:, ::-1].copy()
    nodes = [
        helper.make_node("Shape", ["input_ids"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "axis0"], ["batch1"]),
        helper.make_node("Concat", ["batch1", "width"], ["target"], axis=0),
        helper.make_node("Expand", ["buffered", "target"], ["expanded"]),
        helper.make_node("GatherElements", ["expanded", "position_ids"], ["token_type_ids"],
                         axis=1),
        helper.make_node("Add", ["input_ids", "token_type_ids"], ["y"]),
    ]
    inits = [numpy_helper.from_array(buf, "buffered"),
             numpy_helper.from_array(pos, "position_ids"),
             numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "axis0"),
             numpy_helper.from_array(np.array([max_positions], np.int64), "width")]
    return _model(nodes, [_vi("input_ids", [1, seq], I64)], [_vi("y", [1, seq], I64)], inits,
                  opset=17)


def test_bert_token_type_gather_elements_folds_past_64_positions() -> None:
    # onnx's ReferenceEvaluator breaks here (np.choose takes at most 64 choices, and its
    # fallback reshapes one element into (1, 16)); the fold must not depend on it.
    model = _bert_token_types()
    ids = np.arange(16, dtype=np.int64).reshape(1, 16) * 10
    got = _check(model, {"input_ids": ids})[0]
    assert got.tolist() == [[10 * k + (15 - k) % 2 for k in range(16)]]
    imported = import_model(model, "bert.onnx")
    assert _ops(imported.module) == ["mp.constant", "mp.add", "return"]


def test_a_node_the_reference_evaluator_cannot_fold_imports_as_ops(monkeypatch) -> None:
    from onnx.reference import ReferenceEvaluator

    def broken(self, *args, **kwargs):
        raise ValueError("cannot reshape array of size 1 into shape (1,16)")

    monkeypatch.setattr(ReferenceEvaluator, "run", broken)
    a = numpy_helper.from_array(np.array([[1.0, 2.0]], np.float32), "a")
    nodes = [helper.make_node("Tanh", ["a"], ["t"]), helper.make_node("Add", ["x", "t"], ["y"])]
    model = _model(nodes, [_vi("x", [1, 2])], [_vi("y", [1, 2])], [a], opset=17)
    imported = import_model(model, "m.onnx")
    assert "mp.tanh" in _ops(imported.module)  # not a Python exception as the reason
    x = np.array([[0.5, -0.5]], np.float32)
    (y,) = Program(imported.module).run([x], reference=False).outputs
    np.testing.assert_allclose(y, x + np.tanh([[1.0, 2.0]]), rtol=1e-6)


def test_gather_elements_fold_with_an_index_out_of_range_is_a_located_diagnostic() -> None:
    data = numpy_helper.from_array(np.zeros((1, 100), np.float32), "d")
    idx = numpy_helper.from_array(np.array([[100]], np.int64), "i")
    nodes = [helper.make_node("GatherElements", ["d", "i"], ["g"], axis=1, name="tt"),
             helper.make_node("Add", ["x", "g"], ["y"])]
    model = _model(nodes, [_vi("x", [1, 1])], [_vi("y", [1, 1])], [data, idx], opset=17)
    with pytest.raises(DiagnosticError) as info:
        import_model(model, "m.onnx")
    message = info.value.diagnostics[0].message
    assert message.startswith("node 'tt' (GatherElements): index 100 is out of range")
    assert "Error" not in message


# ---- indexing and data ops ----------------------------------------------------------------------


def test_tile_matches_onnxruntime_and_computes_nothing() -> None:
    x = _rng.standard_normal((2, 3)).astype(np.float32)
    node = helper.make_node("Tile", ["x", "reps"], ["y"])
    model = _model([node], [_vi("x", [2, 3])], [_vi("y", None)],
                   [numpy_helper.from_array(np.array([3, 2], np.int64), "reps")], opset=13)
    got = _check(model, {"x": x})[0]
    assert np.array_equal(got, np.tile(x, (3, 2)))
    ops = set(_ops(import_model(model, "t.onnx").module))
    assert ops <= {"mp.reshape", "mp.expand", "return"}


@pytest.mark.parametrize("op,mode", [("DepthToSpace", "DCR"), ("DepthToSpace", "CRD"),
                                     ("SpaceToDepth", None)])
def test_depth_to_space_and_back_match_onnxruntime(op, mode) -> None:
    shape = [2, 8, 3, 2] if op == "DepthToSpace" else [2, 2, 6, 4]
    x = _rng.standard_normal(shape).astype(np.float32)
    kw = {"mode": mode} if mode else {}
    node = helper.make_node(op, ["x"], ["y"], blocksize=2, **kw)
    got = _check(_model([node], [_vi("x", shape)], [_vi("y", None)], opset=13), {"x": x})[0]
    assert sorted(got.reshape(-1).tolist()) == sorted(x.reshape(-1).tolist())


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot_with_negative_and_out_of_range_indices(axis) -> None:
    idx = np.array([[0, 3, -1], [-4, 4, 2]], np.int64)  # -4 is 0, 4 and -5 would be all off
    node = helper.make_node("OneHot", ["i", "depth", "values"], ["y"], axis=axis)
    model = _model([node], [_vi("i", [2, 3], I64)], [_vi("y", None)],
                   [numpy_helper.from_array(np.array(4, np.int64), "depth"),
                    numpy_helper.from_array(np.array([-1.0, 5.0], np.float32), "values")],
                   opset=11)
    got = _check(model, {"i": idx})[0]
    assert (got == 5.0).sum() == 5 and (got == -1.0).sum() == got.size - 5


def test_compress_with_a_constant_condition_is_a_gather() -> None:
    x = _rng.standard_normal((3, 4)).astype(np.float32)
    for axis in (1, None):
        kw = {} if axis is None else {"axis": axis}
        node = helper.make_node("Compress", ["x", "c"], ["y"], **kw)
        model = _model([node], [_vi("x", [3, 4])], [_vi("y", None)],
                       [numpy_helper.from_array(np.array([True, False, True]), "c")], opset=11)
        got = _check(model, {"x": x})[0]
        assert np.array_equal(got, np.compress([True, False, True], x, axis=axis))


@pytest.mark.parametrize("equation,shapes", [
    ("bhid,bhjd->bhij", [(2, 3, 4, 5), (2, 3, 6, 5)]),  # attention scores
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ij,jk", [(3, 4), (4, 5)]),  # implicit result
    ("i,i->", [(5,), (5,)]),
    ("ij->ji", [(3, 4)]),
    ("ij->i", [(3, 4)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("bn,anm,bm->ba", [(2, 3), (4, 3, 5), (2, 5)]),  # bilinear, three operands
    ("i,j->ij", [(3,), (4,)]),
    ("ii->i", [(4, 4)]),
])
def test_einsum_common_equations_match_onnxruntime(equation, shapes) -> None:
    names = [f"x{k}" for k in range(len(shapes))]
    feeds = {n: _rng.standard_normal(s).astype(np.float32) for n, s in zip(names, shapes)}
    node = helper.make_node("Einsum", names, ["y"], equation=equation)
    model = _model([node], [_vi(n, list(s)) for n, s in zip(names, shapes)], [_vi("y", None)],
                   opset=12)
    got = _check(model, feeds, rtol=1e-5, atol=1e-5)[0]
    np.testing.assert_allclose(got, np.einsum(equation, *feeds.values()), rtol=1e-5, atol=1e-5)


def test_einsum_that_broadcasts_a_letter_is_refused_with_the_reason() -> None:
    node = helper.make_node("Einsum", ["a", "b"], ["y"], equation="ij,ij->i", name="ein")
    model = _model([node], [_vi("a", [3, 4]), _vi("b", [1, 4])], [_vi("y", None)], opset=12)
    with pytest.raises(DiagnosticError) as info:
        import_model(model, "e.onnx")
    assert "node 'ein' (Einsum)" in info.value.diagnostics[0].message
    assert "letter 'i' stands for dimensions 3 and 1" in info.value.diagnostics[0].message
    node = helper.make_node("Einsum", ["a", "b"], ["y"], equation="...ij,...jk->...ik")
    model = _model([node], [_vi("a", [2, 3, 4]), _vi("b", [1, 4, 5])], [_vi("y", None)],
                   opset=12)
    with pytest.raises(DiagnosticError) as info:
        import_model(model, "e.onnx")
    assert "'...' stands for dimensions 2 and 1" in info.value.diagnostics[0].message


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_elements_and_nd_every_reduction_match_onnxruntime(reduction) -> None:
    data = _rng.standard_normal((3, 4)).astype(np.float32)
    idx = np.array([[1, 0, 2, 2], [1, 2, 1, -1]], np.int64)  # two updates to (1, 0), (2, 3)
    if reduction == "none":
        idx = np.array([[1, 0, 2, 0], [0, 2, 1, -1]], np.int64)  # no element written twice
    upd = _rng.standard_normal((2, 4)).astype(np.float32)
    node = helper.make_node("ScatterElements", ["d", "i", "u"], ["y"], axis=0,
                            reduction=reduction)
    model = _model([node], [_vi("d", [3, 4]), _vi("i", [2, 4], I64), _vi("u", [2, 4])],
                   [_vi("y", None)], opset=18)
    _check(model, {"d": data, "i": idx, "u": upd})
    nd_idx = np.array([[2], [0]] if reduction == "none" else [[2], [0], [2]], np.int64)
    nd_upd = _rng.standard_normal((len(nd_idx), 4)).astype(np.float32)
    node = helper.make_node("ScatterND", ["d", "i", "u"], ["y"], reduction=reduction)
    model = _model([node], [_vi("d", [3, 4]), _vi("i", list(nd_idx.shape), I64),
                            _vi("u", list(nd_upd.shape))], [_vi("y", None)], opset=18)
    _check(model, {"d": data, "i": nd_idx, "u": nd_upd})


def test_scatter_ops_export_and_their_gradients_read_back_the_updates() -> None:
    from mplower.ir.opdef import OPS
    from mplower.ir.parser import parse

    text = """func.func @main(%d: tensor<3x4xf32>, %i: tensor<2x1xi64>, %u: tensor<2x4xf32>)
        -> tensor<3x4xf32> {
  %y = mp.scatter_nd %d, %i, %u {reduction = "max"} : (tensor<3x4xf32>, tensor<2x1xi64>,
    tensor<2x4xf32>) -> tensor<3x4xf32>
  return %y : tensor<3x4xf32>
}
"""
    module = parse(text, "s.ir")
    d = _rng.standard_normal((3, 4)).astype(np.float32)
    i = np.array([[2], [2]], np.int64)
    u = _rng.standard_normal((2, 4)).astype(np.float32)
    (ours,) = Program(module).run([d, i, u], reference=False).outputs
    want = d.copy()
    want[2] = np.maximum(np.maximum(d[2], u[0]), u[1])
    assert np.array_equal(ours, want)
    data = exporter.check_and_serialize(exporter.export_module(module).model,
                                        Location("s.ir", 0, 0))
    s = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    (theirs,) = s.run(None, dict(zip((x.name for x in s.get_inputs()), (d, i, u))))
    assert np.array_equal(theirs, want)
    assert OPS["mp.scatter_nd"].vjp is not None


# ---- gradients, against jax ---------------------------------------------------------------------


def test_reduce_min_topk_and_scatter_gradients_match_jax() -> None:
    jax = pytest.importorskip("jax")
    from test_grad import check, op, t

    jnp = jax.numpy
    check({"x": (2, 3, 4)}, op(f"%y = mp.reduce_min %x {{axes = [0, 2], keepdims = false}} : "
                               f"({t((2, 3, 4))}) -> {t((3,))}"), (3,), lambda x: x.min((0, 2)))
    check({"x": (3, 5)}, op(f"%y = mp.topk %x {{k = 2, axis = 1}} : ({t((3, 5))}) -> "
                            f"{t((3, 2))}"), (3, 2), lambda x: jax.lax.top_k(x, 2)[0])
    idx = np.array([[2, 0, 1], [0, 2, 2]], np.int64)
    const = (f"  %i = mp.constant {{value = dense<{idx.tolist()}> : tensor<2x3xi64>}} : () -> "
             f"tensor<2x3xi64>\n")
    cols = np.arange(3)[None, :].repeat(2, 0)
    for reduction in ("add", "none"):
        rows = idx if reduction == "add" else np.array([[2, 0, 1], [0, 2, 0]])
        body = const.replace(str(idx.tolist()), str(rows.tolist())) + op(
            f'%y = mp.scatter_elements %d, %i, %u {{axis = 0, reduction = "{reduction}"}} : '
            f"({t((3, 3))}, tensor<2x3xi64>, {t((2, 3))}) -> {t((3, 3))}")
        def ref(d, u, rows=rows, reduction=reduction):
            at = jnp.asarray(d).at[rows, cols]
            return at.add(u) if reduction == "add" else at.set(u)
        check({"d": (3, 3), "u": (2, 3)}, body, (3, 3), ref)


def test_range_over_bounds_computed_from_shapes_is_a_constant_and_runtime_ones_are_named() -> None:
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["n"], axis=0),
             helper.make_node("Add", ["n", "one"], ["limit"]),
             helper.make_node("Range", ["one", "limit", "one"], ["r"], name="positions"),
             helper.make_node("Cast", ["r"], ["rf"], to=F),
             helper.make_node("Add", ["x", "rf"], ["y"])]
    inits = [numpy_helper.from_array(np.array(1, np.int64), "one")]
    model = _model(nodes, [_vi("x", [2, 4])], [_vi("y", None)], inits, opset=13)
    got = _check(model, {"x": np.zeros((2, 4), np.float32)})[0]
    assert got.tolist() == [[1.0, 2.0, 3.0, 4.0]] * 2
    assert _ops(import_model(model, "r.onnx").module) == ["mp.constant", "mp.add", "return"]
    nodes[3] = helper.make_node("Range", ["one", "k", "one"], ["r"], name="positions")
    model = _model(nodes, [_vi("x", [2, 4]), _vi("k", [], I64)], [_vi("y", None)], inits,
                   opset=13)
    with pytest.raises(DiagnosticError) as info:
        import_model(model, "r.onnx")
    message = info.value.diagnostics[0].message
    assert "node 'positions' (Range)" in message and "'k'" in message
