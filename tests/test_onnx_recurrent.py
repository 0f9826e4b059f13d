"""LSTM, GRU, RNN and control flow (If, Loop, Scan) imported as straight-line mp ops.

References are independent of mplower: onnxruntime runs the same ONNX models (layout 1, which
onnxruntime's CPU kernels refuse, is checked against the layout-0 model on transposed data), and
ONNX's own node tests cover these ops in tests/test_onnx_conformance.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mplower.ir.diagnostics import DiagnosticError
from mplower.onnx.backend import MplowerBackend
from mplower.onnx.importer import StaticInputsNeeded, import_model

ort = pytest.importorskip("onnxruntime")

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
T, B, I, H = 5, 3, 4, 6


def _vi(name: str, shape, elem=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=(), opset: int = 22) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def recurrent(kind: str, *, direction: str = "forward", bias: bool = True,
              initial: bool = False, peepholes: bool = False, lens=None, layout: int = 0,
              const_weights: bool = True, seed: int = 0, **attrs):
    """A one-node model of `kind` with random weights, and feeds for its graph inputs."""
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    rows = GATES[kind] * H
    w = (rng.standard_normal((dirs, rows, I)) * 0.5).astype(np.float32)
    r = (rng.standard_normal((dirs, rows, H)) * 0.5).astype(np.float32)
    x = rng.standard_normal((B, T, I) if layout else (T, B, I)).astype(np.float32)
    feeds, inputs, inits = {"X": x}, [_vi("X", x.shape)], []
    for name, arr in (("W", w), ("R", r)):
        if const_weights:
            inits.append(numpy_helper.from_array(arr, name))
        else:
            inputs.append(_vi(name, arr.shape))
            feeds[name] = arr
    names = ["X", "W", "R", "", "", "", "", ""]
    if bias:
        names[3] = "B"
        inits.append(numpy_helper.from_array(
            (rng.standard_normal((dirs, 2 * rows)) * 0.5).astype(np.float32), "B"))
    if lens is not None:
        names[4] = "L"
        inits.append(numpy_helper.from_array(np.array(lens, np.int32), "L"))
    states = [("h0", 5)] + ([("c0", 6)] if kind == "LSTM" else [])
    for name, k in states if initial else ():
        shape = (B, dirs, H) if layout else (dirs, B, H)
        names[k] = name
        inputs.append(_vi(name, shape))
        feeds[name] = rng.standard_normal(shape).astype(np.float32)
    if peepholes:
        names[7] = "P"
        inits.append(numpy_helper.from_array(rng.standard_normal((dirs, 3 * H))
                                             .astype(np.float32), "P"))
    while not names[-1]:
        names.pop()
    outs = ["Y", "Y_h", "Y_c"][:3 if kind == "LSTM" else 2]
    if layout:
        attrs["layout"] = 1
    node = helper.make_node(kind, names, outs, hidden_size=H, direction=direction, **attrs)
    model = _model([node], inputs, [_vi(o, None) for o in outs], inits)
    return model, feeds


def ort_run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_close(got: list[np.ndarray], want: list[np.ndarray], rtol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        scale = float(np.max(np.abs(w))) or 1.0
        assert float(np.max(np.abs(g - w))) <= rtol * scale, (g, w)


CONFIGS = [
    ("LSTM", {}),
    ("LSTM", {"direction": "bidirectional", "initial": True, "peepholes": True}),
    ("LSTM", {"direction": "reverse", "lens": [5, 3, 1]}),
    ("LSTM", {"direction": "bidirectional", "lens": [5, 2, 0], "initial": True}),
    ("LSTM", {"clip": 0.7, "peepholes": True}),
    ("LSTM", {"input_forget": 1, "peepholes": True}),
    ("LSTM", {"bias": False, "const_weights": False, "direction": "bidirectional"}),
    ("LSTM", {"activations": ["HardSigmoid", "LeakyRelu", "Softsign"],
              "activation_alpha": [0.3, 0.1], "activation_beta": [0.4]}),
    ("LSTM", {"activations": ["Affine", "Elu", "ScaledTanh"],
              "activation_alpha": [0.3, 0.9, 1.5], "activation_beta": [0.4, 0.7]}),
    ("LSTM", {"activations": ["Sigmoid", "ThresholdedRelu", "Softplus"],
              "activation_alpha": [0.2]}),
    ("GRU", {}),
    ("GRU", {"direction": "bidirectional", "initial": True, "linear_before_reset": 1}),
    ("GRU", {"linear_before_reset": 1, "lens": [2, 5, 4]}),
    ("GRU", {"direction": "reverse", "clip": 0.5, "lens": [4, 5, 0], "initial": True}),
    ("GRU", {"activations": ["Relu", "Softplus"], "const_weights": False}),
    ("RNN", {}),
    ("RNN", {"direction": "bidirectional", "initial": True, "lens": [1, 5, 3]}),
    ("RNN", {"activations": ["Relu"], "clip": 1.0, "bias": False}),
]


@pytest.mark.parametrize(("kind", "config"), CONFIGS,
                         ids=[f"{k}-{'-'.join(map(str, c)) or 'defaults'}" for k, c in CONFIGS])
def test_recurrent_matches_onnxruntime(kind: str, config: dict) -> None:
    model, feeds = recurrent(kind, **config)
    assert_close(MplowerBackend.prepare(model).run(feeds), ort_run(model, feeds))


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_batch_first_layout_matches_onnxruntime_on_transposed_data(kind: str) -> None:
    """layout 1 is layout 0 with batch and time (X, Y) or batch and direction (states)
    swapped; onnxruntime's CPU kernels take layout 0 only."""
    common = {"direction": "bidirectional", "initial": True, "lens": [5, 2, 4]}
    batch_first, feeds = recurrent(kind, layout=1, **common)
    time_first, _ = recurrent(kind, **common)
    swapped = {k: np.swapaxes(v, 0, 1) for k, v in feeds.items()}
    want = ort_run(time_first, swapped)
    want = [np.transpose(want[0], (2, 0, 1, 3))] + [np.swapaxes(s, 0, 1) for s in want[1:]]
    assert_close(MplowerBackend.prepare(batch_first).run(feeds), want)


def test_only_the_outputs_asked_for_are_built() -> None:
    model, feeds = recurrent("LSTM")
    node = model.graph.node[0]
    node.output[:] = ["", "Y_h"]
    del model.graph.output[:]
    model.graph.output.extend([_vi("Y_h", None)])
    got = MplowerBackend.prepare(model).run(feeds)
    assert_close(got, ort_run(model, feeds))
    ops = import_model(model).module.function()
    assert sum(ops.op(n) == "mp.concat" for n in ops.ops()) == 0  # no Y stacked


def test_recurrent_matmuls_run_in_bf16_under_a_bf16_plan() -> None:
    model, feeds = recurrent("LSTM", direction="bidirectional", initial=True)
    fp32 = MplowerBackend.prepare(model).run(feeds)
    rep = MplowerBackend.prepare(model, precision="bf16")
    bf16 = rep.run(feeds)
    f = next(iter(rep._programs.values()))[0].module.function()  # as the plan lowered it
    matmuls = list(f.walk("mp.matmul"))
    # Per direction: one projection of the whole sequence and one recurrent matmul per step.
    assert len(matmuls) == 2 * (1 + T)
    assert all(t.elem == "bf16" for n in matmuls for t in f.operand_types(n))
    for b, a in zip(bf16, fp32):
        assert not np.array_equal(b, a)
        np.testing.assert_allclose(b, a, atol=0.05)


def test_data_dependent_sequence_lens_is_refused_naming_the_node() -> None:
    model, _ = recurrent("GRU", lens=[5, 5, 5])
    model.graph.node[0].name = "encoder_gru"
    del model.graph.initializer[[t.name for t in model.graph.initializer].index("L")]
    model.graph.input.append(_vi("L", [B], TensorProto.INT32))
    with pytest.raises(StaticInputsNeeded) as e:
        import_model(model)
    msg = str(e.value)
    assert "encoder_gru" in msg and "sequence_lens" in msg and "'L'" in msg
    assert e.value.names == ["L"]


def test_unknown_activation_is_refused_naming_the_node() -> None:
    model, _ = recurrent("RNN", activations=["Swish"])
    with pytest.raises(DiagnosticError, match=r"'Y' \(RNN\): activation 'Swish'"):
        import_model(model)


def test_bidirectional_node_with_one_direction_of_activations_is_refused() -> None:
    """onnxruntime refuses it too: the spec lists the functions of both directions."""
    model, _ = recurrent("GRU", direction="bidirectional", activations=["Sigmoid", "Relu"])
    with pytest.raises(DiagnosticError, match=r"'activations' lists 2 function\(s\); GRU "
                                              r"with 2 direction\(s\) takes 4"):
        import_model(model)


# ---- If --------------------------------------------------------------------------------------


def _branch(name: str, op: str, const: float, shape=(2, 3)) -> onnx.GraphProto:
    """A branch computing `op`(x, const) from the outer value x (of shape (2, 3)), or, for
    another shape, `op`(const, const)."""
    c = helper.make_node("Constant", [], [f"{name}_c"], value=numpy_helper.from_array(
        np.full(shape, const, np.float32)))
    n = helper.make_node(op, ["x" if shape == (2, 3) else f"{name}_c", f"{name}_c"],
                         [f"{name}_out"])
    return helper.make_graph([c, n], name, [], [_vi(f"{name}_out", list(shape))])


def _if_model(cond_init: bool | None, else_shape=(2, 3)) -> onnx.ModelProto:
    inputs, inits = [_vi("x", [2, 3])], []
    if cond_init is None:
        inputs.append(_vi("cond", [], TensorProto.BOOL))
    else:
        inits.append(numpy_helper.from_array(np.array(cond_init), "cond"))
    node = helper.make_node("If", ["cond"], ["y"], name="pick",
                            then_branch=_branch("then", "Add", 10.0),
                            else_branch=_branch("else", "Mul", -2.0, else_shape))
    return _model([node], inputs, [_vi("y", None)], inits)


@pytest.mark.parametrize("cond", [True, False])
def test_if_on_a_constant_imports_the_taken_branch_only(cond: bool) -> None:
    model = _if_model(cond)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert_close(MplowerBackend.prepare(model).run({"x": x}), ort_run(model, {"x": x}))
    f = import_model(model).module.function()
    ops = {f.op(n) for n in f.ops()}
    assert ("mp.add" in ops) == cond and ("mp.mul" in ops) != cond and "mp.where" not in ops


@pytest.mark.parametrize("cond", [True, False])
def test_if_on_runtime_data_selects_between_both_branches(cond: bool) -> None:
    model = _if_model(None)
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "cond": np.array(cond)}
    assert_close(MplowerBackend.prepare(model).run(feeds), ort_run(model, feeds))
    f = import_model(model).module.function()
    assert {"mp.add", "mp.mul", "mp.where"} <= {f.op(n) for n in f.ops()}


def test_if_on_runtime_data_with_branches_of_different_shapes_is_refused() -> None:
    model = _if_model(None, else_shape=(1, 3))
    with pytest.raises(DiagnosticError, match=r"node 'pick' \(If\): output #0: then_branch "
                                              r"gives \[2, 3\].*else_branch \[1, 3\]"):
        import_model(model)


def test_if_on_runtime_data_selects_between_a_constant_and_a_computed_branch() -> None:
    model = _if_model(None)
    then = next(a.g for a in model.graph.node[0].attribute if a.name == "then_branch")
    then.node[1].CopyFrom(helper.make_node("Identity", ["then_c"], ["then_out"]))
    f = import_model(model).module.function()  # selects, without binding the condition
    assert "mp.where" in {f.op(n) for n in f.ops()}
    for cond in (True, False):
        feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "cond": np.array(cond)}
        assert_close(MplowerBackend.prepare(model).run(feeds), ort_run(model, feeds))


@pytest.mark.parametrize("cond", [True, False])
def test_if_with_unequal_branches_runs_once_its_condition_input_is_bound(cond: bool) -> None:
    """The ONNX backend binds the graph input the refusal names, and the If then folds."""
    model = _if_model(None, else_shape=(1, 3))
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "cond": np.array(cond)}
    with pytest.raises(StaticInputsNeeded) as e:
        import_model(model)
    assert e.value.names == ["cond"]
    assert_close(MplowerBackend.prepare(model).run(feeds), ort_run(model, feeds))


def test_value_inside_a_branch_that_must_be_constant_names_the_graph_input() -> None:
    """A Reshape target computed inside a branch from a graph input: the refusal names that
    input (the subgraph's nodes are searched too), so the backend can bind it."""
    then = helper.make_graph(
        [helper.make_node("Identity", ["target"], ["t2"]),
         helper.make_node("Reshape", ["x", "t2"], ["then_out"])],
        "then", [], [_vi("then_out", [3, 2])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["else_out"])], "else", [],
                              [_vi("else_out", [2, 3])])
    on = numpy_helper.from_array(np.array(True), "on")
    node = helper.make_node("If", ["on"], ["y"], name="maybe_reshape", then_branch=then,
                            else_branch=other)
    model = _model([node], [_vi("x", [2, 3]), _vi("target", [2], TensorProto.INT64)],
                   [_vi("y", [3, 2])], [on])
    with pytest.raises(StaticInputsNeeded, match=r"'maybe_reshape' \(If\): in then_branch: "
                                                 r"node 'then_out' \(Reshape\): the target "
                                                 r"shape \('t2'\) must be a constant") as e:
        import_model(model)
    assert e.value.names == ["target"]
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3),
             "target": np.array([3, 2], np.int64)}
    assert_close(MplowerBackend.prepare(model).run(feeds), ort_run(model, feeds))


def test_if_error_inside_a_branch_names_the_if_and_the_branch() -> None:
    model = _if_model(True)
    then = next(a.g for a in model.graph.node[0].attribute if a.name == "then_branch")
    del then.node[1:]
    then.node.extend([
        helper.make_node("Constant", [], ["on"], value=numpy_helper.from_array(np.array(True))),
        helper.make_node("Dropout", ["x", "", "on"], ["then_out"], name="drop")])
    with pytest.raises(DiagnosticError, match=r"node 'pick' \(If\): in then_branch: node "
                                              r"'drop' \(Dropout\): training-mode dropout"):
        import_model(model)


# ---- Loop ------------------------------------------------------------------------------------


def _loop_body(cond_expr: str) -> onnx.GraphProto:
    """acc <- acc + x * i; scan out acc; cond: 'keep' passes it through, 'below3' is i < 3."""
    nodes = [helper.make_node("Cast", ["i"], ["i_f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x", "i_f"], ["xi"]),
             helper.make_node("Add", ["acc", "xi"], ["acc_out"]),
             helper.make_node("Identity", ["acc_out"], ["scan_out"])]
    if cond_expr == "keep":
        nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    else:
        three = numpy_helper.from_array(np.array(3, np.int64), "three")
        nodes += [helper.make_node("Constant", [], ["three"], value=three),
                  helper.make_node("Less", ["i", "three"], ["cond_out"])]
    return helper.make_graph(
        nodes, "body", [_vi("i", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL),
                        _vi("acc", [2])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("acc_out", [2]), _vi("scan_out", [2])])


@pytest.mark.parametrize(("trips", "cond_expr"), [(4, "keep"), (10, "below3")])
def test_loop_with_a_static_trip_count_unrolls(trips: int, cond_expr: str) -> None:
    inits = [numpy_helper.from_array(np.array(trips, np.int64), "M"),
             numpy_helper.from_array(np.array(True), "go"),
             numpy_helper.from_array(np.zeros(2, np.float32), "acc0")]
    node = helper.make_node("Loop", ["M", "go", "acc0"], ["acc", "steps"],
                            body=_loop_body(cond_expr))
    model = _model([node], [_vi("x", [2])], [_vi("acc", [2]), _vi("steps", [None, 2])], inits)
    feeds = {"x": np.array([1.5, -2.0], np.float32)}
    got = MplowerBackend.prepare(model).run(feeds)
    want = ort_run(model, feeds)
    assert got[1].shape == (4, 2)  # four iterations either way: 'below3' stops after i = 3
    assert_close(got, want)


def test_loop_whose_condition_depends_on_data_is_refused() -> None:
    body = _loop_body("keep")
    body.node[-1].CopyFrom(helper.make_node("ReduceSum", ["acc_out"], ["s"], keepdims=0))
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    body.node.extend([helper.make_node("Constant", [], ["zero"], value=zero),
                      helper.make_node("Less", ["s", "zero"], ["cond_out"])])
    inits = [numpy_helper.from_array(np.array(5, np.int64), "M"),
             numpy_helper.from_array(np.zeros(2, np.float32), "acc0")]
    node = helper.make_node("Loop", ["M", "", "acc0"], ["acc", "steps"], name="until",
                            body=body)
    model = _model([node], [_vi("x", [2])], [_vi("acc", [2])], inits)
    with pytest.raises(DiagnosticError, match=r"node 'until' \(Loop\): the loop condition "
                                              r"after iteration 0 depends on run-time data"):
        import_model(model, outputs=["acc"])


def test_loop_with_a_trip_count_from_an_input_asks_for_it() -> None:
    inits = [numpy_helper.from_array(np.zeros(2, np.float32), "acc0")]
    node = helper.make_node("Loop", ["M", "", "acc0"], ["acc", "steps"], name="n_times",
                            body=_loop_body("keep"))
    model = _model([node], [_vi("x", [2]), _vi("M", [], TensorProto.INT64)],
                   [_vi("acc", [2]), _vi("steps", [None, 2])], inits)
    with pytest.raises(StaticInputsNeeded, match=r"'n_times' \(Loop\): the trip count M"):
        import_model(model)
    feeds = {"x": np.array([1.0, 2.0], np.float32), "M": np.array(3, np.int64)}
    assert_close(MplowerBackend.prepare(model).run(feeds), ort_run(model, feeds))


# ---- Scan ------------------------------------------------------------------------------------


def test_scan_unrolls_with_directions_and_axes() -> None:
    """A running sum over axis 1 of one input read backwards, and a product with a second
    input read forwards; the outputs stacked on axis 1, the second in reverse."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s", "a_t"], ["s_out"]),
         helper.make_node("Mul", ["s_out", "b_t"], ["p_t"]),
         helper.make_node("Identity", ["s_out"], ["sum_t"])],
        "body", [_vi("s", [2]), _vi("a_t", [2]), _vi("b_t", [2])],
        [_vi("s_out", [2]), _vi("sum_t", [2]), _vi("p_t", [2])])
    node = helper.make_node("Scan", ["s0", "a", "b"], ["s", "sums", "prods"], body=body,
                            num_scan_inputs=2, scan_input_axes=[1, 0],
                            scan_input_directions=[1, 0], scan_output_axes=[1, -1],
                            scan_output_directions=[0, 1])
    model = _model([node], [_vi("s0", [2]), _vi("a", [2, 4]), _vi("b", [4, 2])],
                   [_vi(o, None) for o in ("s", "sums", "prods")], opset=16)
    rng = np.random.default_rng(1)
    feeds = {"s0": rng.standard_normal(2).astype(np.float32),
             "a": rng.standard_normal((2, 4)).astype(np.float32),
             "b": rng.standard_normal((4, 2)).astype(np.float32)}
    got = MplowerBackend.prepare(model).run(feeds)
    assert [g.shape for g in got] == [(2,), (2, 4), (2, 4)]
    assert_close(got, ort_run(model, feeds))


# ---- a recurrent model as an exporter writes it ----------------------------------------------


def test_torch_exported_lstm_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    import inspect
    import io

    torch.manual_seed(0)
    net = torch.nn.LSTM(input_size=I, hidden_size=H, num_layers=2, bidirectional=True)
    x = torch.randn(T, B, I)
    buf = io.BytesIO()
    # The TorchScript exporter, which writes LSTM nodes (newer torch defaults to dynamo).
    legacy = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters \
        else {}
    torch.onnx.export(net, (x,), buf, input_names=["x"], output_names=["y", "h", "c"],
                      **legacy)
    model = onnx.load_from_string(buf.getvalue())
    with torch.no_grad():
        want = [t.numpy() for t in (net(x)[0], *net(x)[1])]
    got = MplowerBackend.prepare(model).run({"x": x.numpy()})
    assert_close(got, want, rtol=1e-5)


# ---- the command line ------------------------------------------------------------------------


def test_import_cli_writes_the_unrolled_lstm_and_refuses_a_runtime_loop(tmp_path, cli) -> None:
    model, _ = recurrent("LSTM", direction="bidirectional")
    onnx.save(model, tmp_path / "lstm.onnx")
    r = cli("import", tmp_path / "lstm.onnx", "-o", tmp_path / "lstm.ir")
    assert r.rc == 0, r.err
    text = (tmp_path / "lstm.ir").read_text()
    # Per direction: the projection, and a recurrent matmul per step but the first (its state
    # is the zero default, which multiplies to nothing).
    assert text.count("mp.matmul") == 2 * (1 + T - 1) and "LSTM" not in text
    inits = [numpy_helper.from_array(np.zeros(2, np.float32), "acc0")]
    node = helper.make_node("Loop", ["M", "", "acc0"], ["acc", "steps"], name="n_times",
                            body=_loop_body("keep"))
    model = _model([node], [_vi("x", [2]), _vi("M", [], TensorProto.INT64)],
                   [_vi("acc", [2])], inits)
    onnx.save(model, tmp_path / "loop.onnx")
    r = cli("import", tmp_path / "loop.onnx", "-o", tmp_path / "loop.ir")
    assert r.rc == 1 and "Traceback" not in r.err
    assert "node 'n_times' (Loop): the trip count M ('M') must be a constant" in r.err
    assert not (tmp_path / "loop.ir").exists()


def test_if_inside_a_loop_folds_per_iteration_on_the_iteration_number() -> None:
    """acc <- acc + x for the first two iterations, acc * x after: the If's condition is
    computed from the iteration number, so each unrolled copy takes one branch."""
    two = numpy_helper.from_array(np.array(2, np.int64), "two")
    branch = {name: helper.make_graph([helper.make_node(op, ["acc", "x"], [f"{name}_out"])],
                                      name, [], [_vi(f"{name}_out", [2])])
              for name, op in (("early", "Add"), ("late", "Mul"))}
    body = helper.make_graph(
        [helper.make_node("Constant", [], ["two"], value=two),
         helper.make_node("Less", ["i", "two"], ["is_early"]),
         helper.make_node("If", ["is_early"], ["acc_out"], then_branch=branch["early"],
                          else_branch=branch["late"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [_vi("i", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL),
                 _vi("acc", [2])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("acc_out", [2])])
    inits = [numpy_helper.from_array(np.array(4, np.int64), "M"),
             numpy_helper.from_array(np.ones(2, np.float32), "acc0")]
    node = helper.make_node("Loop", ["M", "", "acc0"], ["acc"], body=body)
    model = _model([node], [_vi("x", [2])], [_vi("acc", [2])], inits)
    feeds = {"x": np.array([1.5, -2.0], np.float32)}
    assert_close(MplowerBackend.prepare(model).run(feeds), ort_run(model, feeds))
    f = import_model(model).module.function()
    ops = [f.op(n) for n in f.ops()]
    assert ops.count("mp.add") == 2 and ops.count("mp.mul") == 2 and "mp.where" not in ops
