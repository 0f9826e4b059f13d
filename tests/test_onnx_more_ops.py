"""Pad, CenterCropPad, the global/Lp pools, MaxPool's Indices and MaxUnpool, the losses and
the other ops of issue 32's second list, imported from ONNX and checked on values against
onnxruntime (an independent implementation); refusals name the node and why.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mplower.ir.diagnostics import DiagnosticError
from mplower.onnx.backend import MplowerBackend
from mplower.onnx.importer import import_model

ort = pytest.importorskip("onnxruntime")
F = TensorProto.FLOAT
I64 = TensorProto.INT64
_rng = np.random.default_rng(32)


def _model(nodes, inputs, outputs, inits=(), opset=18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=8)


def _vi(name, shape, t=F):
    return helper.make_tensor_value_info(name, t, shape)


def _init(name, values, dtype=np.int64):
    return numpy_helper.from_array(np.asarray(values, dtype), name)


def _check(model: onnx.ModelProto, feeds: dict, rtol=1e-6, atol=1e-6) -> list[np.ndarray]:
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = s.run(None, feeds)
    got = MplowerBackend.prepare(model).run(feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    return got


def _ops(model: onnx.ModelProto) -> list[str]:
    f = import_model(model).module.function()
    return [f.op(n) for n in f.ops()]


# ---- Pad ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize("pads", [[0, 1, 2, 0, 2, 1], [1, 0, 3, 1, 2, 2], [0, -1, 2, 0, 1, -1]])
def test_pad_modes_match_onnxruntime(mode: str, pads: list[int]) -> None:
    inputs = ["x", "pads"] + (["value"] if mode == "constant" else [])
    inits = [_init("pads", pads)]
    if mode == "constant":
        inits.append(numpy_helper.from_array(np.array(1.5, np.float32), "value"))
    node = helper.make_node("Pad", inputs, ["y"], mode=mode)
    m = _model([node], [_vi("x", [2, 3, 4])], [_vi("y", None)], inits, opset=19)
    x = _rng.standard_normal((2, 3, 4)).astype(np.float32)
    got = _check(m, {"x": x})[0]
    if min(pads) >= 0:  # numpy's own pad, where it applies (no crops)
        width = list(zip(pads[:3], pads[3:]))
        kw = {"constant_values": 1.5} if mode == "constant" else {}
        np.testing.assert_array_equal(got, np.pad(x, width, mode=mode, **kw))


def test_pad_axes_input_and_integer_data_match_onnxruntime() -> None:
    node = helper.make_node("Pad", ["x", "pads", "", "axes"], ["y"], mode="reflect")
    m = _model([node], [_vi("x", [2, 5, 3], TensorProto.INT32)],
               [_vi("y", None, TensorProto.INT32)],
               [_init("pads", [2, 1, 3, 0]), _init("axes", [-2, 0])], opset=18)
    _check(m, {"x": _rng.integers(-9, 9, (2, 5, 3)).astype(np.int32)})


def test_pad_before_opset_11_takes_pads_and_value_attributes() -> None:
    node = helper.make_node("Pad", ["x"], ["y"], pads=[1, 0, 0, 2], value=-3.0)
    m = _model([node], [_vi("x", [2, 3])], [_vi("y", None)], opset=2)
    x = _rng.standard_normal((2, 3)).astype(np.float32)
    got = MplowerBackend.prepare(m).run({"x": x})[0]
    np.testing.assert_array_equal(got, np.pad(x, [(1, 0), (0, 2)], constant_values=-3.0))


def test_pad_is_data_movement_only() -> None:
    node = helper.make_node("Pad", ["x", "pads"], ["y"], mode="reflect")
    m = _model([node], [_vi("x", [1, 2, 8])], [_vi("y", None)], [_init("pads", [0, 0, 2,
                                                                                  0, 0, 2])])
    assert set(_ops(m)) <= {"mp.constant", "mp.gather", "return"}


def test_pad_with_runtime_pads_is_refused_naming_the_node() -> None:
    node = helper.make_node("Pad", ["x", "pads"], ["y"], name="the_pad")
    m = _model([node], [_vi("x", [2, 3]), _vi("pads", [4], I64)], [_vi("y", None)])
    with pytest.raises(DiagnosticError, match=r"the_pad.*Pad's pads \('pads'\) must be a "
                                              r"constant"):
        import_model(m)


def test_reflect_pad_wider_than_the_axis_reflects_again_as_onnx_reference_does() -> None:
    # onnxruntime refuses this; ONNX's reference (numpy's pad) reflects back and forth.
    node = helper.make_node("Pad", ["x", "pads"], ["y"], mode="reflect")
    m = _model([node], [_vi("x", [1, 3])], [_vi("y", None)], [_init("pads", [0, 4, 0, 3])])
    got = MplowerBackend.prepare(m).run({"x": np.array([[1, 2, 3]], np.float32)})[0]
    np.testing.assert_array_equal(got, [[1, 2, 3, 2, 1, 2, 3, 2, 1, 2]])


def test_center_crop_pad_crops_and_pads_around_the_center() -> None:
    node = helper.make_node("CenterCropPad", ["x", "shape"], ["y"], axes=[1, 2])
    m = _model([node], [_vi("x", [2, 5, 4])], [_vi("y", None)], [_init("shape", [2, 7])])
    x = _rng.standard_normal((2, 5, 4)).astype(np.float32)
    got = MplowerBackend.prepare(m).run({"x": x})[0]
    want = np.zeros((2, 2, 7), np.float32)
    want[:, :, 1:5] = x[:, 1:3, :]  # crop 5 -> 2 starts at 1; pad 4 -> 7 puts 1 before
    np.testing.assert_array_equal(got, want)


# ---- pools ----------------------------------------------------------------------------------------


def test_global_max_pool_and_global_lp_pool_match_onnxruntime() -> None:
    nodes = [helper.make_node("GlobalMaxPool", ["x"], ["a"]),
             helper.make_node("GlobalLpPool", ["x"], ["b"], p=2),
             helper.make_node("GlobalLpPool", ["x"], ["c"], p=3)]
    m = _model(nodes, [_vi("x", [2, 3, 4, 5])], [_vi(n, None) for n in "abc"])
    _check(m, {"x": _rng.standard_normal((2, 3, 4, 5)).astype(np.float32)}, rtol=1e-5)


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [3, 2], "p": 2},
    {"kernel_shape": [2, 2], "strides": [2, 1], "pads": [1, 0, 1, 1], "p": 3},
    {"kernel_shape": [2, 3], "dilations": [2, 1], "p": 1},
    {"kernel_shape": [3], "p": 2},
])
def test_lp_pool_matches_onnxruntime(attrs: dict) -> None:
    shape = [2, 3, 6, 7][:2 + len(attrs["kernel_shape"])]
    node = helper.make_node("LpPool", ["x"], ["y"], **attrs)
    m = _model([node], [_vi("x", shape)], [_vi("y", None)])
    _check(m, {"x": _rng.standard_normal(shape).astype(np.float32)}, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [2, 2], "strides": [2, 2]},
    {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 1]},
    {"kernel_shape": [2, 2], "dilations": [2, 1]},
])
def test_max_pool_indices_match_onnxruntime(attrs: dict, storage_order: int) -> None:
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], storage_order=storage_order, **attrs)
    m = _model([node], [_vi("x", [2, 3, 5, 6])], [_vi("y", None), _vi("i", None, I64)],
               opset=12)
    # Distinct values: ties would make the index depend on the scan order.
    x = _rng.permutation(180).astype(np.float32).reshape(2, 3, 5, 6)
    _check(m, {"x": x})


def test_max_unpool_inverts_max_pool_with_indices() -> None:
    nodes = [helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2],
                              strides=[2, 2]),
             helper.make_node("MaxUnpool", ["y", "i"], ["z"], kernel_shape=[2, 2],
                              strides=[2, 2])]
    m = _model(nodes, [_vi("x", [1, 2, 4, 6])], [_vi("z", None)], opset=12)
    x = _rng.permutation(48).astype(np.float32).reshape(1, 2, 4, 6)
    z = _check(m, {"x": x})[0]
    assert np.count_nonzero(z) == 12 and set(z[z != 0]) <= set(x.reshape(-1))


# ---- ReverseSequence, EyeLike, CumProd ------------------------------------------------------


@pytest.mark.parametrize("runtime_lens", [False, True])
@pytest.mark.parametrize("time_axis,batch_axis", [(0, 1), (1, 0)])
def test_reverse_sequence_matches_onnxruntime(time_axis: int, batch_axis: int,
                                              runtime_lens: bool) -> None:
    shape = [5, 3, 2] if time_axis == 0 else [3, 5, 2]
    node = helper.make_node("ReverseSequence", ["x", "lens"], ["y"], time_axis=time_axis,
                            batch_axis=batch_axis)
    lens = np.array([5, 1, 3], np.int64)
    inputs = [_vi("x", shape)] + ([_vi("lens", [3], I64)] if runtime_lens else [])
    m = _model([node], inputs, [_vi("y", None)], [] if runtime_lens else [_init("lens", lens)])
    feeds = {"x": _rng.standard_normal(shape).astype(np.float32)}
    if runtime_lens:
        feeds["lens"] = lens
    _check(m, feeds)


def test_eye_like_matches_onnxruntime() -> None:
    nodes = [helper.make_node("EyeLike", ["x"], ["a"], k=1),
             helper.make_node("EyeLike", ["x"], ["b"], k=-2, dtype=TensorProto.INT32)]
    m = _model(nodes, [_vi("x", [3, 4])], [_vi("a", None), _vi("b", None, TensorProto.INT32)])
    _check(m, {"x": np.zeros((3, 4), np.float32)})


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cum_prod_multiplies_in_sequence_order(exclusive: int, reverse: int) -> None:
    node = helper.make_node("CumProd", ["x", "axis"], ["y"], exclusive=exclusive,
                            reverse=reverse)
    m = _model([node], [_vi("x", [2, 5])], [_vi("y", None)],
               [_init("axis", np.array(-1))], opset=26)
    x = _rng.uniform(0.5, 2, (2, 5)).astype(np.float32)
    got = MplowerBackend.prepare(m).run({"x": x})[0]
    want = x[:, ::-1] if reverse else x
    if exclusive:
        want = np.concatenate([np.ones((2, 1), np.float32), want[:, :-1]], axis=1)
    want = np.cumprod(want, axis=1, dtype=np.float32)
    np.testing.assert_array_equal(got, want[:, ::-1] if reverse else want)


# ---- losses ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore_index", [None, 2, -1])
def test_losses_match_onnxruntime(op: str, reduction: str, weighted: bool,
                                  ignore_index: int | None) -> None:
    attrs = {"reduction": reduction}
    if ignore_index is not None:
        attrs["ignore_index"] = ignore_index
    inputs = ["x", "t"] + (["w"] if weighted else [])
    outputs = ["loss"] + (["log_prob"] if op == "SoftmaxCrossEntropyLoss" else [])
    node = helper.make_node(op, inputs, outputs, **attrs)
    inits = [numpy_helper.from_array(_rng.uniform(0.2, 2, 4).astype(np.float32), "w")] \
        if weighted else []
    m = _model([node], [_vi("x", [3, 4, 2]), _vi("t", [3, 2], I64)],
               [_vi(o, None) for o in outputs], inits, opset=13)
    t = np.array([[0, 2], [3, 1], [2, 2]] if ignore_index != -1 else [[0, -1], [3, 1], [2, -1]],
                 np.int64)
    _check(m, {"x": _rng.standard_normal((3, 4, 2)).astype(np.float32), "t": t}, rtol=1e-5)


# ---- signal ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("attrs,shape,length", [
    ({}, [2, 8, 2], None),
    ({"onesided": 1}, [2, 8, 1], None),
    ({"onesided": 1}, [2, 8, 1], 10),
    ({"inverse": 1}, [3, 6, 2], None),
    ({"inverse": 1, "onesided": 1}, [2, 5, 2], 8),
    ({}, [6, 4, 2], 3),
])
def test_dft_of_a_runtime_signal_matches_onnxruntime(attrs: dict, shape: list[int],
                                                     length: int | None) -> None:
    inputs = ["x", "n" if length else "", "axis"]
    inits = [_init("axis", np.array(1))] + ([_init("n", np.array(length))] if length else [])
    m = _model([helper.make_node("DFT", inputs, ["y"], **attrs)], [_vi("x", shape)],
               [_vi("y", None)], inits, opset=20)
    x = _rng.standard_normal(shape).astype(np.float32)
    _check(m, {"x": x}, rtol=1e-4, atol=1e-5)
    assert "mp.matmul" in _ops(m)


def test_stft_with_a_window_matches_onnxruntime() -> None:
    node = helper.make_node("STFT", ["x", "step", "w", "len"], ["y"], onesided=1)
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(8) / 8)).astype(np.float32)
    m = _model([node], [_vi("x", [2, 30, 1])], [_vi("y", None)],
               [_init("step", np.array(4)), _init("len", np.array(8)),
                numpy_helper.from_array(window, "w")], opset=17)
    _check(m, {"x": _rng.standard_normal((2, 30, 1)).astype(np.float32)}, rtol=1e-4, atol=1e-5)


def test_window_with_a_constant_size_folds_and_a_runtime_size_is_refused() -> None:
    node = helper.make_node("HannWindow", ["n"], ["w"], name="win")
    m = _model([node], [], [_vi("w", None)], [_init("n", np.array(6))], opset=17)
    got = MplowerBackend.prepare(m).run({})[0]
    np.testing.assert_allclose(got, np.hanning(7)[:6], atol=1e-7)  # periodic: N+1 points
    m = _model([node], [_vi("n", [], I64)], [_vi("w", [6])], opset=17)
    with pytest.raises(DiagnosticError, match=r"win.*HannWindow's size \('n'\) must be a "
                                              r"constant"):
        import_model(m)


# ---- AffineGrid, GridSample ----------------------------------------------------------------------


@pytest.mark.parametrize("align_corners", [0, 1])
@pytest.mark.parametrize("size", [[2, 3, 4, 5], [2, 1, 3, 4, 2]])
def test_affine_grid_matches_onnxruntime(size: list[int], align_corners: int) -> None:
    r = len(size) - 2
    node = helper.make_node("AffineGrid", ["theta", "size"], ["grid"],
                            align_corners=align_corners)
    m = _model([node], [_vi("theta", [2, r, r + 1])], [_vi("grid", None)],
               [_init("size", size)], opset=20)
    _check(m, {"theta": _rng.standard_normal((2, r, r + 1)).astype(np.float32)}, atol=1e-6)


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_grid_sample_matches_onnxruntime(mode: str, padding_mode: str,
                                         align_corners: int) -> None:
    node = helper.make_node("GridSample", ["x", "grid"], ["y"], mode=mode,
                            padding_mode=padding_mode, align_corners=align_corners)
    m = _model([node], [_vi("x", [2, 3, 5, 6]), _vi("grid", [2, 4, 7, 2])], [_vi("y", None)],
               opset=20)
    # Points past the edges (some by more than the image) exercise the padding; none on a
    # rounding tie.
    grid = _rng.uniform(-2.8, 2.8, (2, 4, 7, 2)).astype(np.float32)
    # Cubic weights are f32 polynomials evaluated in another order than onnxruntime's.
    tol = 1e-4 if mode == "cubic" else 1e-5
    _check(m, {"x": _rng.standard_normal((2, 3, 5, 6)).astype(np.float32), "grid": grid},
           rtol=tol, atol=tol)


def test_grid_sample_unknown_mode_is_refused_naming_the_node() -> None:
    node = helper.make_node("GridSample", ["x", "grid"], ["y"], mode="lanczos", name="warp")
    m = _model([node], [_vi("x", [1, 1, 4, 4]), _vi("grid", [1, 2, 2, 2])], [_vi("y", None)],
               opset=20)
    with pytest.raises(DiagnosticError, match=r"warp.*mode 'lanczos'.*not an ONNX"):
        import_model(m)


@pytest.mark.parametrize("attrs", [{}, {"strides": [2, 1], "pads": [1, 0, 1, 2],
                                        "dilations": [1, 2]}])
def test_col2im_matches_onnxruntime(attrs: dict) -> None:
    image, block = [5, 6], [2, 3]
    r = 2
    strides = attrs.get("strides", [1, 1])
    pads = attrs.get("pads", [0, 0, 0, 0])
    dil = attrs.get("dilations", [1, 1])
    length = np.prod([(image[k] + pads[k] + pads[k + r] - dil[k] * (block[k] - 1) - 1)
                      // strides[k] + 1 for k in range(r)])
    node = helper.make_node("Col2Im", ["x", "image", "block"], ["y"], **attrs)
    shape = [2, 3 * 6, int(length)]
    m = _model([node], [_vi("x", shape)], [_vi("y", None)],
               [_init("image", image), _init("block", block)])
    _check(m, {"x": _rng.standard_normal(shape).astype(np.float32)}, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ctm", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("ratio", [0, 2])
def test_roi_align_with_constant_regions_matches_onnxruntime(mode: str, ctm: str,
                                                             ratio: int) -> None:
    rois = np.array([[0.5, 1.0, 6.0, 7.5], [2.0, 0.0, 4.0, 3.0], [-1.0, 5.0, 9.5, 9.0]],
                    np.float32)
    node = helper.make_node("RoiAlign", ["x", "rois", "batch"], ["y"], mode=mode,
                            coordinate_transformation_mode=ctm, output_height=3,
                            output_width=2, sampling_ratio=ratio, spatial_scale=0.8)
    m = _model([node], [_vi("x", [2, 3, 8, 9])], [_vi("y", None)],
               [numpy_helper.from_array(rois, "rois"), _init("batch", [1, 0, 1])], opset=16)
    _check(m, {"x": _rng.standard_normal((2, 3, 8, 9)).astype(np.float32)}, rtol=1e-5,
           atol=1e-5)


def test_roi_align_with_runtime_regions_is_refused_naming_the_node() -> None:
    node = helper.make_node("RoiAlign", ["x", "rois", "batch"], ["y"], name="pool_rois")
    m = _model([node], [_vi("x", [1, 1, 4, 4]), _vi("rois", [2, 4])], [_vi("y", None)],
               [_init("batch", [0, 0])], opset=16)
    with pytest.raises(DiagnosticError, match=r"pool_rois.*rois.*must be a constant"):
        import_model(m)


# ---- export --------------------------------------------------------------------------------------


def test_imported_pads_pools_and_samplers_export_to_onnx_that_onnxruntime_runs() -> None:
    from mplower.ir.diagnostics import Location
    from mplower.onnx import exporter

    nodes = [helper.make_node("Pad", ["x", "pads"], ["p"], mode="reflect"),
             helper.make_node("LpPool", ["p"], ["lp"], kernel_shape=[2, 2], p=3),
             helper.make_node("MaxPool", ["p"], ["mx", "mi"], kernel_shape=[2, 2],
                              strides=[2, 2]),
             helper.make_node("GlobalMaxPool", ["lp"], ["g"]),
             helper.make_node("GridSample", ["x", "grid"], ["gs"], mode="cubic",
                              padding_mode="reflection")]
    m = _model(nodes, [_vi("x", [1, 2, 4, 5]), _vi("grid", [1, 3, 3, 2])],
               [_vi("g", None), _vi("mx", None), _vi("mi", None, I64), _vi("gs", None)],
               [_init("pads", [0, 0, 1, 2, 0, 0, 1, 1])], opset=20)
    feeds = {"x": _rng.standard_normal((1, 2, 4, 5)).astype(np.float32),
             "grid": _rng.uniform(-1.5, 1.5, (1, 3, 3, 2)).astype(np.float32)}
    ours = MplowerBackend.prepare(m).run(feeds)
    module = import_model(m, inline_weights=True).module
    data = exporter.check_and_serialize(exporter.export_module(module).model,
                                        Location("m.onnx", 0, 0))
    s = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    theirs = s.run(None, dict(zip([i.name for i in s.get_inputs()], feeds.values())))
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o, t, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter_writes_each_batch_from_its_index(mode: str) -> None:
    node = helper.make_node("TensorScatter", ["cache", "update", "at"], ["y"], mode=mode)
    m = _model([node], [_vi("cache", [2, 3, 6, 4]), _vi("update", [2, 3, 2, 4]),
                        _vi("at", [2], I64)], [_vi("y", None)], opset=24)
    cache = _rng.standard_normal((2, 3, 6, 4)).astype(np.float32)
    update = _rng.standard_normal((2, 3, 2, 4)).astype(np.float32)
    at = np.array([1, 5 if mode == "circular" else 4], np.int64)
    got = MplowerBackend.prepare(m).run({"cache": cache, "update": update, "at": at})[0]
    want = cache.copy()
    for b in range(2):
        for i in range(2):
            want[b, :, (at[b] + i) % 6] = update[b, :, i]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_det_matches_onnxruntime(n: int) -> None:
    m = _model([helper.make_node("Det", ["x"], ["y"])], [_vi("x", [2, 3, n, n])],
               [_vi("y", None)])
    _check(m, {"x": _rng.standard_normal((2, 3, n, n)).astype(np.float32)}, rtol=1e-5,
           atol=1e-5)


def test_det_of_a_large_matrix_is_refused_naming_the_node() -> None:
    m = _model([helper.make_node("Det", ["x"], ["y"], name="big_det")], [_vi("x", [5, 5])],
               [_vi("y", None)])
    with pytest.raises(DiagnosticError, match=r"big_det.*5x5.*up to 4x4"):
        import_model(m)


@pytest.mark.parametrize("attrs,masked", [
    ({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, False),
    ({"kernel_shape": [2, 3], "strides": [2, 1], "dilations": [1, 2], "pads": [0, 1, 1, 0],
      "group": 2, "offset_group": 2}, True),
])
def test_deform_conv_matches_onnxruntime(attrs: dict, masked: bool) -> None:
    kh, kw = attrs["kernel_shape"]
    g, og = attrs.get("group", 1), attrs.get("offset_group", 1)
    sh, sw = attrs.get("strides", [1, 1])
    dh, dw = attrs.get("dilations", [1, 1])
    pt, pl, pb, pr = attrs["pads"]
    oh = (6 + pt + pb - ((kh - 1) * dh + 1)) // sh + 1
    ow = (7 + pl + pr - ((kw - 1) * dw + 1)) // sw + 1
    inputs = ["x", "w", "off", "b"] + (["mask"] if masked else [])
    node = helper.make_node("DeformConv", inputs, ["y"], **attrs)
    vis = [_vi("x", [2, 4, 6, 7]), _vi("w", [6, 4 // g, kh, kw]),
           _vi("off", [2, 2 * og * kh * kw, oh, ow]), _vi("b", [6])]
    if masked:
        vis.append(_vi("mask", [2, og * kh * kw, oh, ow]))
    m = _model([node], vis, [_vi("y", None)], opset=22)
    feeds = {"x": _rng.standard_normal((2, 4, 6, 7)), "w": _rng.standard_normal((6, 4 // g, kh,
                                                                                kw)),
             "off": _rng.uniform(-2.5, 2.5, (2, 2 * og * kh * kw, oh, ow)),
             "b": _rng.standard_normal(6)}
    if masked:
        feeds["mask"] = _rng.uniform(0, 1, (2, og * kh * kw, oh, ow))
    _check(m, {k: v.astype(np.float32) for k, v in feeds.items()}, rtol=1e-4, atol=1e-5)


def test_max_roi_pool_with_constant_regions_matches_onnxruntime() -> None:
    # The last region lies outside the map: its bins are empty, hence 0.
    rois = np.array([[1, 0.5, 1.0, 6.0, 7.5], [0, 2.0, 0.0, 4.0, 3.0], [1, -3, 5, 20, 9],
                     [0, 30, 30, 40, 40]], np.float32)
    node = helper.make_node("MaxRoiPool", ["x", "rois"], ["y"], pooled_shape=[3, 2],
                            spatial_scale=0.8)
    m = _model([node], [_vi("x", [2, 3, 8, 9])], [_vi("y", None)],
               [numpy_helper.from_array(rois, "rois")], opset=16)
    got = _check(m, {"x": _rng.standard_normal((2, 3, 8, 9)).astype(np.float32)})[0]
    assert np.all(got[3] == 0) and np.all(got[:3] != 0)


def test_deform_conv_with_mismatched_strides_is_refused_naming_the_node() -> None:
    node = helper.make_node("DeformConv", ["x", "w", "off"], ["y"], name="dcn",
                            strides=[1, 1, 1])
    m = _model([node], [_vi("x", [1, 1, 4, 4]), _vi("w", [1, 1, 2, 2]),
                        _vi("off", [1, 8, 3, 3])], [_vi("y", [1, 1, 3, 3])], opset=22)
    with pytest.raises(DiagnosticError, match=r"dcn.*strides"):
        import_model(m)


def test_a_model_of_these_ops_runs_in_bf16_close_to_onnxruntime() -> None:
    # The precision sheets see only existing mp ops: a bf16 plan runs, its rounding shows
    # and stays small.
    nodes = [helper.make_node("Pad", ["x", "pads"], ["p"], mode="reflect"),
             helper.make_node("LpPool", ["p"], ["lp"], kernel_shape=[2, 2], p=2),
             helper.make_node("GlobalMaxPool", ["lp"], ["g"]),
             helper.make_node("DFT", ["x3", "", "axis"], ["f"], onesided=1)]
    m = _model([helper.make_node("Reshape", ["x", "shape3"], ["x3"])] + nodes,
               [_vi("x", [1, 2, 4, 8])], [_vi("g", None), _vi("f", None)],
               [_init("pads", [0, 0, 1, 1, 0, 0, 1, 1]), _init("axis", np.array(1)),
                _init("shape3", [8, 8, 1])], opset=20)
    x = _rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    want = s.run(None, {"x": x})
    got = MplowerBackend.prepare(m, precision="bf16").run({"x": x})
    for g, w in zip(got, want):
        rel = np.linalg.norm(np.asarray(g, np.float32) - w) / np.linalg.norm(w)
        assert 1e-5 < rel < 3e-2


@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("with_state", [False, True])
def test_causal_conv_with_state_matches_onnx_reference(activation: str,
                                                       with_state: bool) -> None:
    # onnxruntime has no opset-27 kernel: onnx's reference is the independent one here.
    from onnx.reference import ReferenceEvaluator

    inputs = ["x", "w", "b"] + (["past"] if with_state else [])
    node = helper.make_node("CausalConvWithState", inputs, ["y", "state"],
                            activation=activation)
    vis = [_vi("x", [2, 3, 5]), _vi("w", [3, 1, 4]), _vi("b", [3])]
    if with_state:
        vis.append(_vi("past", [2, 3, 3]))
    m = _model([node], vis, [_vi("y", None), _vi("state", None)], opset=27)
    feeds = {v.name: _rng.standard_normal([d.dim_value for d in
                                           v.type.tensor_type.shape.dim]).astype(np.float32)
             for v in vis}
    want = ReferenceEvaluator(m).run(None, feeds)
    got = MplowerBackend.prepare(m).run(feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
