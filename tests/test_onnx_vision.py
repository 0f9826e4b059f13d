"""Vision operators from ONNX (ConvTranspose, Resize, Upsample, InstanceNormalization,
GroupNormalization) against onnxruntime, and models whose declared shapes say "any size".

Each op is lowered at import to mp ops the passes already know (mplower/onnx/importer/
vision.py); these tests hold the lowering to onnxruntime's CPU results in fp32 (to 1e-5
relative), run a bf16 plan end to end, export the result back to ONNX, and differentiate it.
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mplower.backend.executor import Program
from mplower.dialect.plan import BOUND, RANGE, Plan
from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.ir.opdef import OPS
from mplower.onnx import exporter
from mplower.onnx.backend import MplowerBackend
from mplower.onnx.importer import import_model
from mplower.pass_manager import PassManager, parse_pipeline

F = TensorProto.FLOAT
RNG = np.random.default_rng(7)


def model(nodes, inputs, outputs, inits=(), opset=19) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=9)


def vi(name, shape, t=F):
    return helper.make_tensor_value_info(name, t, shape)


def init(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def ort_run(m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-5) -> None:
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.abs(want).max()))


def ops_of(m: onnx.ModelProto, **kw) -> list[str]:
    f = import_model(m, "m.onnx", **kw).module.function()
    return [f.op(n) for n in f.ops()]


# ---- ConvTranspose ---------------------------------------------------------------------------

CONV_T = {  # name: (input shape, weight shape, attributes)
    "plain": ((2, 3, 5, 4), (3, 2, 3, 3), {}),
    "strided": ((1, 2, 4, 5), (2, 3, 3, 2), {"strides": [2, 3]}),
    "pads": ((1, 2, 5, 5), (2, 2, 3, 3), {"strides": [2, 2], "pads": [1, 0, 2, 1]}),
    "big_pads_crop": ((1, 1, 4, 4), (1, 2, 2, 2), {"pads": [2, 1, 3, 2], "strides": [3, 1]}),
    "dilations": ((1, 2, 4, 4), (2, 3, 3, 2), {"dilations": [2, 3], "strides": [2, 1]}),
    "groups": ((2, 6, 3, 4), (6, 2, 3, 3), {"group": 3, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "depthwise": ((1, 4, 5, 5), (4, 1, 4, 4), {"group": 4, "strides": [2, 2], "pads": [1] * 4}),
    "output_padding": ((1, 2, 3, 3), (2, 2, 3, 3), {"strides": [3, 2], "output_padding": [2, 1]}),
    "output_shape": ((1, 1, 3, 3), (1, 2, 3, 3), {"strides": [3, 2], "output_shape": [10, 8]}),
    "output_shape_pads": ((1, 2, 3, 4), (2, 1, 3, 3),
                          {"strides": [2, 2], "output_shape": [6, 8], "pads": [1, 1, 1, 1]}),
    "output_shape_cut": ((1, 2, 4, 4), (2, 1, 3, 2), {"strides": [3, 3], "dilations": [2, 1],
                                                       "output_shape": [9, 8]}),
    "output_shape_cut_same_upper": ((1, 1, 4, 4), (1, 1, 3, 3),
                                    {"strides": [3, 3], "output_shape": [9, 10],
                                     "auto_pad": "SAME_UPPER"}),
    "same_upper_under_in_times_stride": ((1, 1, 3, 3), (1, 1, 1, 2),
                                         {"strides": [2, 3], "auto_pad": "SAME_UPPER"}),
    "same_upper": ((1, 2, 5, 4), (2, 2, 3, 4), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    "same_lower": ((1, 2, 5, 4), (2, 2, 3, 4), {"strides": [2, 3], "auto_pad": "SAME_LOWER"}),
    "valid": ((1, 2, 3, 3), (2, 1, 2, 2), {"strides": [2, 2], "auto_pad": "VALID"}),
    "one_d": ((2, 3, 7), (3, 4, 3), {"strides": [2], "pads": [1, 2], "output_padding": [1]}),
    "one_d_groups": ((1, 4, 5), (4, 3, 2), {"group": 2, "dilations": [2], "strides": [3]}),
}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", sorted(CONV_T))
def test_conv_transpose_matches_onnxruntime(case: str, bias: bool) -> None:
    xs, ws, attrs = CONV_T[case]
    x = RNG.standard_normal(xs).astype(np.float32)
    w = RNG.standard_normal(ws).astype(np.float32)
    m_out = ws[1] * attrs.get("group", 1)
    inits = [init("w", w)] + ([init("b", RNG.standard_normal(m_out).astype(np.float32))]
                              if bias else [])
    node = helper.make_node("ConvTranspose", ["x", "w"] + ["b"] * bias, ["y"], **attrs)
    m = model([node], [vi("x", xs)], [vi("y", None)], inits)
    (want,) = ort_run(m, {"x": x})
    (got,) = MplowerBackend.prepare(m).run({"x": x})
    assert_close(got, want)


def test_conv_transpose_with_a_runtime_weight_matches_onnxruntime() -> None:
    x = RNG.standard_normal((1, 4, 3, 5)).astype(np.float32)
    w = RNG.standard_normal((4, 3, 2, 3)).astype(np.float32)
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], group=2, strides=[2, 2],
                            pads=[0, 1, 1, 0])
    m = model([node], [vi("x", x.shape), vi("w", w.shape)], [vi("y", None)])
    (want,) = ort_run(m, {"x": x, "w": w})
    (got,) = MplowerBackend.prepare(m).run({"x": x, "w": w})
    assert_close(got, want)


def test_conv_transpose_costs_the_products_of_the_scatter_form_and_no_zeros() -> None:
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], pads=[1] * 4)
    m = model([node], [vi("x", (1, 8, 6, 6))], [vi("y", None)],
              [init("w", np.ones((8, 4, 3, 3), np.float32))])
    f = import_model(m, "m.onnx").module.function()
    assert f.result_types[0].shape == (1, 4, 11, 11)  # 2 * (6 - 1) + 3 - 2
    convs = [n for n in f.ops() if f.op(n) == "mp.conv2d"]
    assert len(convs) == 4  # one per output phase (row and column parity)
    flops = sum(OPS["mp.conv2d"].flops([f.type_of(v) for v in f.operands(c)], f.types(c),
                                       f.attrs_of(c)) for c in convs)
    # Every input element times every kernel tap, once: 2 * N * C * H * W * M * kh * kw
    # (stuffing zeros between the inputs would cost 2 * 4 * 11 * 11 * 8 * 9, 3.4 times more).
    assert flops == 2 * 8 * 6 * 6 * 4 * 3 * 3


def test_conv_transpose_3d_is_refused_with_the_reason() -> None:
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="up3")
    m = model([node], [vi("x", (1, 1, 2, 2, 2))], [vi("y", None)],
              [init("w", np.ones((1, 1, 2, 2, 2), np.float32))])
    with pytest.raises(DiagnosticError, match=r"node 'up3' \(ConvTranspose\): 3-D "
                                              r"ConvTranspose: mplower lowers 1-D and 2-D"):
        import_model(m, "m.onnx")


# ---- Resize and Upsample ----------------------------------------------------------------------

X4 = RNG.standard_normal((1, 2, 5, 7)).astype(np.float32)
COORDS = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric")
NEAREST = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
TARGETS = (("scales", [1, 1, 2.0, 1.5]), ("scales", [1, 1, 0.6, 0.5]),
           ("scales", [1, 1, 1.7, 2.3]), ("sizes", [1, 2, 8, 3]), ("sizes", [1, 2, 3, 11]))


def _resize_model(opset: int, target: tuple[str, list], **attrs) -> onnx.ModelProto:
    kind, values = target
    inits = [init("roi", np.zeros(0, np.float32))]
    if kind == "scales":
        inits.append(init("s", np.array(values, np.float32)))
        ins = ["x", "roi", "s"]
    else:
        inits.append(init("s", np.array(values, np.int64)))
        ins = ["x", "roi", "", "s"]
    node = helper.make_node("Resize", ins, ["y"], **attrs)
    return model([node], [vi("x", X4.shape)], [vi("y", None)], inits, opset=opset)


def _same_as_onnxruntime(m: onnx.ModelProto, x: np.ndarray = X4) -> None:
    (want,) = ort_run(m, {"x": x})
    (got,) = MplowerBackend.prepare(m).run({"x": x})
    assert_close(got, want)


@pytest.mark.parametrize("opset", [11, 13, 18, 19])
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_matches_onnxruntime_in_every_coordinate_and_rounding_mode(opset, mode) -> None:
    coords = COORDS + (("half_pixel_symmetric",) if opset >= 19 else ())
    rounding = NEAREST if mode == "nearest" else ("round_prefer_floor",)
    for coord, nearest, target in itertools.product(coords, rounding, TARGETS):
        if opset == 11 and target[0] == "sizes":
            continue  # Resize-11 needs a scales input even when empty; covered at 13
        for exclude in (0, 1) if mode == "cubic" else (0,):
            m = _resize_model(opset, target, mode=mode, coordinate_transformation_mode=coord,
                              nearest_mode=nearest, exclude_outside=exclude)
            _same_as_onnxruntime(m)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_10_and_upsample_use_asymmetric_coordinates_as_onnxruntime(mode) -> None:
    for scales in ([1, 1, 2.0, 1.5], [1, 1, 0.6, 0.5], [1, 1, 1.7, 2.3]):
        node = helper.make_node("Resize", ["x", "s"], ["y"], mode=mode)
        _same_as_onnxruntime(model([node], [vi("x", X4.shape)], [vi("y", None)],
                                   [init("s", np.array(scales, np.float32))], opset=10))
    for scales in ([1, 1, 2.0, 3.0], [1, 1, 1.5, 2.5]):
        node = helper.make_node("Upsample", ["x", "s"], ["y"], mode=mode)
        _same_as_onnxruntime(model([node], [vi("x", X4.shape)], [vi("y", None)],
                                   [init("s", np.array(scales, np.float32))], opset=9))
    node = helper.make_node("Upsample", ["x"], ["y"], mode=mode, scales=[1.0, 1.0, 2.0, 2.0])
    _same_as_onnxruntime(model([node], [vi("x", X4.shape)], [vi("y", None)], opset=7))


def test_resize_of_rank_3_and_5_and_of_uint8_matches_onnxruntime() -> None:
    cases = [((2, 3, 9), [1, 1, 2.5], "linear", np.float32),
             ((1, 2, 3, 4, 5), [1, 1, 2, 1.5, 0.6], "linear", np.float32),
             ((1, 2, 3, 4, 5), [1, 1, 2, 1.5, 0.6], "nearest", np.float32),
             ((1, 3, 4, 5), [1, 1, 2, 0.5], "nearest", np.uint8)]
    for shape, scales, mode, dtype in cases:
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        x = (RNG.standard_normal(shape) * 50 + 100).astype(dtype)
        node = helper.make_node("Resize", ["x", "", "s"], ["y"], mode=mode)
        m = model([node], [vi("x", shape, elem)], [vi("y", None, elem)],
                  [init("s", np.array(scales, np.float32))])
        _same_as_onnxruntime(m, x)


def test_resize_11_tf_half_pixel_for_nn_matches_onnxruntime() -> None:
    for target in TARGETS[:3]:
        _same_as_onnxruntime(_resize_model(11, target, mode="nearest",
                                           coordinate_transformation_mode="tf_half_pixel_for_nn"))


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_18_crop_axes_antialias_and_aspect_policy_match_onnxruntime(mode) -> None:
    for extrapolation in (0.0, 10.0):
        roi = np.array([0, 0, 0.4, -0.2, 1, 1, 1.2, 0.9], np.float32)
        node = helper.make_node("Resize", ["x", "roi", "", "s"], ["y"], mode=mode,
                                coordinate_transformation_mode="tf_crop_and_resize",
                                extrapolation_value=extrapolation)
        _same_as_onnxruntime(model([node], [vi("x", X4.shape)], [vi("y", None)],
                                   [init("roi", roi), init("s", np.array([1, 2, 4, 6]))], 18))
    for antialias, scales in itertools.product((0, 1), ([0.6, 0.5], [0.3, 0.45], [2.0, 1.5])):
        if mode == "nearest" and antialias:
            continue
        node = helper.make_node("Resize", ["x", "", "s"], ["y"], mode=mode, antialias=antialias,
                                axes=[3, 2])
        _same_as_onnxruntime(model([node], [vi("x", X4.shape)], [vi("y", None)],
                                   [init("s", np.array(scales, np.float32))], 18))
    for policy in ("not_larger", "not_smaller"):
        node = helper.make_node("Resize", ["x", "", "", "s"], ["y"], mode=mode, axes=[2, 3],
                                keep_aspect_ratio_policy=policy)
        _same_as_onnxruntime(model([node], [vi("x", X4.shape)], [vi("y", None)],
                                   [init("s", np.array([9, 9]))], 18))


def test_nearest_resize_moves_elements_only_and_is_exact_in_bf16() -> None:
    m = _resize_model(19, ("scales", [1, 1, 2.0, 1.5]), mode="nearest")
    ops = ops_of(m)
    assert set(ops) == {"mp.constant", "mp.gather", "return"}
    assert all("data-movement" in {t.value for t in OPS[op].traits}
               for op in ops if op == "mp.gather")
    (want,) = ort_run(m, {"x": X4})
    # Gathers follow their input's format: an f32 input moves through the bf16 sheet as it is.
    (got,) = MplowerBackend.prepare(m, precision="bf16").run({"x": X4})
    assert np.array_equal(np.asarray(got, np.float32), want)
    # A bf16 input moves bit for bit (ml_dtypes' rounding of onnxruntime's f32 result).
    xb = X4.astype(ml_dtypes.bfloat16)
    mb = _resize_model(19, ("scales", [1, 1, 2.0, 1.5]), mode="nearest")
    mb.graph.input[0].type.tensor_type.elem_type = TensorProto.BFLOAT16
    mb.graph.output[0].type.tensor_type.elem_type = TensorProto.BFLOAT16
    (got,) = MplowerBackend.prepare(mb, precision="bf16").run({"x": xb})
    assert np.array_equal(np.asarray(got).astype(np.float32),
                          want.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_resize_refusals_are_located_and_say_why() -> None:
    def refused(node, inits, pattern, opset=19):
        m = model([node], [vi("x", X4.shape)], [vi("y", None)], inits, opset=opset)
        with pytest.raises(DiagnosticError, match=pattern):
            import_model(m, "m.onnx")

    scales = init("s", np.array([1, 1, 0.5, 0.5], np.float32))
    refused(helper.make_node("Resize", ["x", "", "s"], ["y"], name="r", antialias=1),
            [scales], r"node 'r' \(Resize\): antialias = 1 applies to linear and cubic modes")
    node = helper.make_node("Resize", ["x", "", "s"], ["y"], name="r")
    m = model([node], [vi("x", X4.shape), vi("s", [4])], [vi("y", None)], opset=19)
    with pytest.raises(DiagnosticError, match=r"node 'r' \(Resize\): the scales \('s'\) must "
                                              r"be a constant .* graph input\(s\) 's'"):
        import_model(m, "m.onnx")
    refused(helper.make_node("Resize", ["x", "", "s"], ["y"], name="r", mode="area"),
            [scales], r"mode 'area' is not an ONNX Resize mode")


# ---- InstanceNormalization and GroupNormalization ----------------------------------------------


def test_instance_normalization_matches_onnxruntime() -> None:
    for shape in ((2, 3, 4, 5), (2, 4, 6)):
        x = (RNG.standard_normal(shape) * 3 + 1).astype(np.float32)
        c = shape[1]
        node = helper.make_node("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=1e-3)
        m = model([node], [vi("x", shape)], [vi("y", shape)],
                  [init("s", RNG.standard_normal(c).astype(np.float32)),
                   init("b", RNG.standard_normal(c).astype(np.float32))])
        _same_as_onnxruntime(m, x)


@pytest.mark.parametrize(("opset", "groups", "per"), [(18, 3, "group"), (18, 6, "group"),
                                                      (20, 2, "group"), (21, 3, "channel"),
                                                      (21, 1, "channel")])
def test_group_normalization_forms_of_opsets_18_and_21_match_onnxruntime(opset, groups,
                                                                         per) -> None:
    x = (RNG.standard_normal((2, 6, 3, 4)) * 2 - 1).astype(np.float32)
    n = groups if per == "group" else 6
    node = helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=groups,
                            epsilon=1e-3)
    m = model([node], [vi("x", x.shape)], [vi("y", x.shape)],
              [init("s", RNG.standard_normal(n).astype(np.float32)),
               init("b", RNG.standard_normal(n).astype(np.float32))], opset=opset)
    _same_as_onnxruntime(m, x)
    assert "mp.layer_norm" in ops_of(m)


def test_group_normalization_with_the_other_opsets_scale_shape_is_refused() -> None:
    node = helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], name="gn",
                            num_groups=3)
    m = model([node], [vi("x", (1, 6, 2, 2))], [vi("y", (1, 6, 2, 2))],
              [init("s", np.ones(6, np.float32)), init("b", np.zeros(6, np.float32))], 18)
    with pytest.raises(DiagnosticError, match=r"node 'gn' \(GroupNormalization\): scale must "
                                              r"have shape \[3\] \(one per group at opset 18\)"):
        import_model(m, "m.onnx")


# ---- a small decoder: bf16 end to end, export, gradients ---------------------------------------


def _decoder() -> onnx.ModelProto:
    """Conv -> ConvTranspose (x2) -> GroupNorm -> linear Resize (x2) -> InstanceNorm ->
    nearest Resize: the shape of a segmentation head."""
    def w(*shape):
        return (RNG.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1] * 4),
        helper.make_node("ConvTranspose", ["c0", "w1", "b1"], ["c1"], strides=[2, 2],
                         pads=[1, 1, 1, 1], output_padding=[1, 1], group=2),
        helper.make_node("GroupNormalization", ["c1", "gs", "gb"], ["g"], num_groups=2),
        helper.make_node("Resize", ["g", "", "rs"], ["r"], mode="linear"),
        helper.make_node("InstanceNormalization", ["r", "is", "ib"], ["i"]),
        helper.make_node("Resize", ["i", "", "", "sz"], ["y"], mode="nearest"),
    ]
    inits = [init("w0", w(4, 3, 3, 3)), init("w1", w(4, 3, 3, 3)), init("b1", w(6)),
             init("gs", 1 + w(6)), init("gb", w(6)), init("rs", np.array([1, 1, 2, 2], np.float32)),
             init("is", 1 + w(6)), init("ib", w(6)), init("sz", np.array([2, 6, 40, 36]))]
    return model([*nodes], [vi("x", ("N", 3, 6, 6))], [vi("y", [-1, 6, 40, 36])], inits,
                 opset=21)


def test_decoder_runs_a_bf16_plan_end_to_end_close_to_onnxruntime() -> None:
    m = _decoder()
    x = RNG.standard_normal((2, 3, 6, 6)).astype(np.float32)
    (want,) = ort_run(m, {"x": x})
    module = import_model(m, "dec.onnx", input_shapes={"x": (2, 3, 6, 6)},
                          inline_weights=True).module
    PassManager(parse_pipeline("assign-precision{policy=bf16},insert-casts")).run(module)
    f = module.function()
    convs = [n for n in f.ops() if f.op(n) == "mp.conv2d"]
    assert len(convs) == 5  # the Conv and the ConvTranspose's four phases, bf16 convolutions
    assert all(Plan.at(f, n).precision == "bf16" for n in convs)
    result = Program(module).run([x])
    (got,) = result.outputs
    got = np.asarray(got, np.float32)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 1e-4 < rel < 3e-2  # bf16 rounding shows, and stays small
    ref = np.asarray(result.reference[0], np.float32)
    assert_close(ref, want)


def test_decoder_exports_to_onnx_that_onnxruntime_runs_to_the_same_values() -> None:
    m = _decoder()
    x = RNG.standard_normal((2, 3, 6, 6)).astype(np.float32)
    imported = import_model(m, "dec.onnx", input_shapes={"x": x.shape}, inline_weights=True)
    (ours,) = Program(imported.module).run([x], reference=False).outputs
    data = exporter.check_and_serialize(exporter.export_module(imported.module).model,
                                        Location("dec.ir", 0, 0))
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    (theirs,) = session.run(None, {session.get_inputs()[0].name: x})
    assert_close(np.asarray(ours, np.float32), theirs)
    assert_close(theirs, ort_run(m, {"x": x})[0])


def test_gradients_through_conv_transpose_and_resize_are_the_transposed_maps() -> None:
    """The loss sum(op(x) * p) is linear in x, so <dL/dx, v> = sum(op(v) * p) for any v:
    onnxruntime's forward run of v checks mplower's backward graph."""
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["c"], strides=[2, 2], pads=[1] * 4,
                              group=2, output_padding=[1, 0]),
             helper.make_node("Resize", ["c", "", "s"], ["r"], mode="cubic"),
             helper.make_node("Mul", ["r", "p"], ["m"]),
             helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    w = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
    scales = np.array([1, 1, 1.5, 0.75], np.float32)
    r_shape = (1, 6, 15, 8)  # ConvTranspose: 10 x 11, resized by 1.5 x 0.75
    m = model(nodes, [vi("x", (1, 4, 5, 6)), vi("p", r_shape)], [vi("loss", [])],
              [init("w", w), init("s", scales)])
    x = RNG.standard_normal((1, 4, 5, 6)).astype(np.float32)
    p = RNG.standard_normal(r_shape).astype(np.float32)
    module = import_model(m, "g.onnx", inline_weights=True).module
    PassManager(parse_pipeline("grad{wrt=args}")).run(module)
    loss, dx, _ = Program(module).run([x, p], reference=False).outputs
    assert np.isclose(float(loss), ort_run(m, {"x": x, "p": p})[0], rtol=1e-5)
    for _ in range(3):
        v = RNG.standard_normal(x.shape).astype(np.float32)
        (directional,) = ort_run(m, {"x": v, "p": p})
        assert np.isclose(float(np.sum(np.asarray(dx, np.float64) * v)), float(directional),
                          rtol=1e-4)


def test_range_analysis_bounds_a_linear_resize_by_its_input_range() -> None:
    from mplower.backend.executor import reference_runner
    from mplower.lowering.calibration import set_value_attrs
    from mplower.pass_manager import PassContext

    m = _resize_model(19, ("scales", [1, 1, 2.0, 2.0]), mode="linear")
    module = import_model(m, "m.onnx", inline_weights=True).module
    f = module.function()
    set_value_attrs(f, (f.args[0], 0), {RANGE: (-2.0, 3.0)})
    PassManager(parse_pipeline("range-analysis")).run(module, PassContext(runner=reference_runner))
    (ret,) = [n for n in f.ops() if f.op(n) == "return"]
    lo, hi = f.attrs_of(f.operands(ret)[0][0])[BOUND]
    # Each axis is a sum of two taps with weights in [0, 1]: at most twice the range per axis.
    assert -8.0 <= lo <= -2.0 and 3.0 <= hi <= 12.0


# ---- shapes as models declare them ------------------------------------------------------------


def _classifier(out_dims, in_dims=("N", 3)) -> onnx.ModelProto:
    return model([helper.make_node("MatMul", ["x", "w"], ["y"])], [vi("x", list(in_dims))],
                 [vi("y", out_dims)], [init("w", RNG.standard_normal((3, 2)).astype(np.float32))],
                 opset=17)


@pytest.mark.parametrize("declared", [[-1, 2], [0, 2], ["batch", 2], [None, 2]])
def test_an_output_declared_with_an_unknown_dim_imports_at_the_given_batch(declared) -> None:
    m = _classifier(declared)
    f = import_model(m, "clf.onnx", input_shapes={"x": (64, 3)}).module.function()
    assert f.result_types[0].shape == (64, 2)
    x = RNG.standard_normal((64, 3)).astype(np.float32)
    (got,) = MplowerBackend.prepare(m).run({"x": x})
    assert_close(got, ort_run(m, {"x": x})[0])


def test_an_input_declared_with_minus_one_is_a_dynamic_dimension() -> None:
    f = import_model(_classifier([-1, 2], [-1, 3]), "clf.onnx",
                     input_shapes={"x": (8, 3)}).module.function()
    assert f.result_types[0].shape == (8, 2)
    assert import_model(_classifier([-1, 2], [-1, 3]), "clf.onnx").module.function() \
        .result_types[0].shape == (1, 2)


def test_a_declared_output_size_that_disagrees_is_still_an_error() -> None:
    with pytest.raises(DiagnosticError, match="ONNX shape inference rejects the model"):
        import_model(_classifier([64, 3]), "clf.onnx", input_shapes={"x": (64, 3)})


def test_a_symbolic_dim_takes_its_size_from_the_input_shape_of_another_input() -> None:
    nodes = [helper.make_node("Add", ["a", "b"], ["y"])]
    m = model(nodes, [vi("a", ["batch", "seq"]), vi("b", ["batch", "seq"])],
              [vi("y", ["batch", "seq"])], opset=17)
    f = import_model(m, "m.onnx", input_shapes={"a": (4, 7)}).module.function()
    assert [f.types(a)[0].shape for a in f.args] == [(4, 7), (4, 7)]
    assert f.result_types[0].shape == (4, 7)
    with pytest.raises(DiagnosticError, match=r"gives the symbolic dimension 'seq' the size 7 "
                                              r"for input 'a' and 5 for input 'b'"):
        import_model(m, "m.onnx", input_shapes={"a": (4, 7), "b": (4, 5)})


def test_cli_imports_a_classifier_declared_with_minus_one(tmp_path, cli) -> None:
    path = tmp_path / "clf.onnx"
    path.write_bytes(_classifier([-1, 2]).SerializeToString())
    r = cli("import", path, "--input-shape", "x=64x3", "-o", tmp_path / "clf.ir")
    assert r.rc == 0, r.err
    assert "-> tensor<64x2xf32>" in (tmp_path / "clf.ir").read_text()


@pytest.mark.parametrize("strides", [[1, 1], [2, 2]])
def test_batch_norm_after_conv_transpose_matches_onnxruntime(strides) -> None:
    c = 3
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "bias"], ["t"], strides=strides),
             helper.make_node("BatchNormalization", ["t", "s", "b", "m", "v"], ["y"])]
    stats = [init(n, RNG.uniform(0.5, 1.5, c).astype(np.float32)) for n in ("s", "b", "m", "v")]
    m = model(nodes, [vi("x", (1, 2, 4, 4))], [vi("y", None)],
              [init("w", RNG.standard_normal((2, c, 3, 3)).astype(np.float32)),
               init("bias", RNG.standard_normal(c).astype(np.float32)), *stats])
    if strides == [1, 1]:  # one convolution, into which the normalization folds
        assert [op for op in ops_of(m) if op != "mp.constant"] == ["mp.conv2d", "return"]
    _same_as_onnxruntime(m, RNG.standard_normal((1, 2, 4, 4)).astype(np.float32))


def test_group_normalization_gradient_matches_jax() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    shape = (2, 6, 3, 4)
    scale = RNG.standard_normal(6).astype(np.float32)
    bias = RNG.standard_normal(6).astype(np.float32)
    nodes = [helper.make_node("GroupNormalization", ["x", "s", "b"], ["g"], num_groups=3,
                              epsilon=1e-3),
             helper.make_node("Mul", ["g", "p"], ["m"]),
             helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    m = model(nodes, [vi("x", shape), vi("p", shape)], [vi("loss", [])],
              [init("s", scale), init("b", bias)], opset=21)
    x = RNG.standard_normal(shape).astype(np.float32)
    p = RNG.standard_normal(shape).astype(np.float32)
    module = import_model(m, "g.onnx", inline_weights=True).module
    PassManager(parse_pipeline("grad{wrt=args}")).run(module)
    _, dx, _ = Program(module).run([x, p], reference=False).outputs

    def loss(x):
        g = x.reshape(2, 3, -1)
        z = (g - g.mean(-1, keepdims=True)) / jnp.sqrt(g.var(-1, keepdims=True) + 1e-3)
        return jnp.sum((z.reshape(shape) * scale[:, None, None] + bias[:, None, None]) * p)

    want = np.asarray(jax.grad(loss)(x))
    assert np.linalg.norm(np.asarray(dx) - want) <= 1e-5 * np.linalg.norm(want)


def test_question_mark_dims_are_each_their_own_unknown(tmp_path) -> None:
    """Paddle2ONNX writes '?' for every size it knows nothing about (a text-line classifier
    declares x as [batch, 3, '?', '?']): '?' is no symbol that ties the dims together."""
    from mplower.onnx.importer import import_model

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "?", "?"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, "?", "?"])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                                                [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    module = import_model(model, "m.onnx", input_shapes={"x": (2, 3, 48, 192)}).module
    f = module.function(None)
    assert f.types(f.args[0])[0].shape == (2, 3, 48, 192)
