"""Inputs that used to end in `internal error` (reliability, round two): zero-size tensors,
exports of types or index types ONNX cannot take, ONNX models the importer refused or could not
hold, fp8 plans that lowered to invalid IR; and the export's statement of what it reproduces.
Values are checked against numpy, ml_dtypes and onnxruntime."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mplower.backend.executor import Program
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import Module
from mplower.ir.parser import parse, parse_file
from mplower.ir.verifier import verify
from mplower.pass_manager import Pass, PassContext, PassManager
from mplower.report.run import SCHEMA_PATH


def _strict_json(text: str) -> dict:
    """The report as strict JSON: NaN or Infinity anywhere fails."""
    def refuse(name: str) -> None:
        raise AssertionError(f"report holds {name}")
    return json.loads(text, parse_constant=refuse)


# ---- zero-size tensors (docs/ir.md allows a zero dimension) --------------------------------

ZERO_SIZE = {
    "reshape": ("%x: tensor<0x4xf32>", "tensor<2x0x2xf32>",
                "mp.reshape %x : (tensor<0x4xf32>) -> tensor<2x0x2xf32>",
                lambda x: x.reshape(2, 0, 2)),
    "matmul-empty-k": ("%x: tensor<3x0xf32>, %y: tensor<0x4xf32>", "tensor<3x4xf32>",
                       "mp.matmul %x, %y : (tensor<3x0xf32>, tensor<0x4xf32>) -> tensor<3x4xf32>",
                       np.matmul),
    "matmul-empty-rows": ("%x: tensor<2x0x5xf32>, %y: tensor<5x4xf32>", "tensor<2x0x4xf32>",
                          ("mp.matmul %x, %y : (tensor<2x0x5xf32>, tensor<5x4xf32>) -> "
                          "tensor<2x0x4xf32>"), np.matmul),
    "cumsum": ("%x: tensor<0x4xf32>", "tensor<0x4xf32>",
               "mp.cumsum %x {axis = 0} : (tensor<0x4xf32>) -> tensor<0x4xf32>",
               lambda x: np.cumsum(x, axis=0)),
    "cumsum-exclusive": ("%x: tensor<0x4xf32>", "tensor<0x4xf32>",
                         ("mp.cumsum %x {axis = 0, exclusive = true, reverse = true} : "
                         "(tensor<0x4xf32>) -> tensor<0x4xf32>"), lambda x: np.cumsum(x, axis=0)),
    "trilu": ("%x: tensor<0x4xf32>", "tensor<0x4xf32>",
              "mp.trilu %x : (tensor<0x4xf32>) -> tensor<0x4xf32>", np.triu),
    "trilu-square": ("%x: tensor<3x0x0xf32>", "tensor<3x0x0xf32>",
                     ("mp.trilu %x {upper = false, k = 1} : (tensor<3x0x0xf32>) -> "
                     "tensor<3x0x0xf32>"), lambda x: np.tril(x, 1)),
    "add-broadcast": ("%x: tensor<0x4xf32>, %y: tensor<4xf32>", "tensor<0x4xf32>",
                      "mp.add %x, %y : (tensor<0x4xf32>, tensor<4xf32>) -> tensor<0x4xf32>",
                      np.add),
    "exp": ("%x: tensor<5x0xf32>", "tensor<5x0xf32>",
            "mp.exp %x : (tensor<5x0xf32>) -> tensor<5x0xf32>", np.exp),
}


def _zero_size_module(tmp_path, case: str) -> tuple:
    args, result, op, ref = ZERO_SIZE[case]
    src = tmp_path / "m.ir"
    src.write_text(f"func.func @main({args}) -> {result} {{\n  %0 = {op}\n"
                   f"  return %0 : {result}\n}}\n")
    rng = np.random.default_rng(0)
    shapes = [a.split("tensor<")[1].rstrip(">").split("x")[:-1] for a in args.split(", ")]
    inputs = {a.split(":")[0].lstrip("%"): rng.standard_normal([int(d) for d in s])
              .astype(np.float32) for a, s in zip(args.split(", "), shapes)}
    np.savez(tmp_path / "in.npz", **inputs)
    return src, inputs, ref


@pytest.mark.parametrize("case", list(ZERO_SIZE))
def test_zero_size_ops_run_as_numpy_and_report_strict_json(cli, tmp_path, case):
    src, inputs, ref = _zero_size_module(tmp_path, case)
    out, report = tmp_path / "out.npz", tmp_path / "r.json"
    r = cli("run", src, "--inputs", tmp_path / "in.npz", "--save-outputs", out,
            "--report", report)
    assert r.rc == 0, r.err
    want = ref(*inputs.values())
    got = np.load(out)["output_0"]
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    rep = _strict_json(report.read_text())
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(rep, json.loads(SCHEMA_PATH.read_text()))
    if want.size == 0:  # nothing to compare: undefined figures are null, never NaN or 0
        assert rep["ops"][0]["rel_l2"] is None and rep["summary"]["output_rel_l2"] is None
        assert rep["summary"]["top1_agreement"] is None


@pytest.mark.parametrize("policy", ["bf16", "fp8"])
def test_zero_size_cumsum_exclusive_runs_under_a_lowered_plan(cli, tmp_path, policy):
    src, _, _ = _zero_size_module(tmp_path, "cumsum-exclusive")
    low, out = tmp_path / "low.ir", tmp_path / "out.npz"
    assert cli("opt", src, f"--pass=assign-precision{{policy={policy}}}", "--pass=insert-casts",
               "-o", low).rc == 0
    r = cli("run", low, "--inputs", tmp_path / "in.npz", "--save-outputs", out)
    assert r.rc == 0, r.err
    assert np.load(out)["output_0"].shape == (0, 4)


def test_zero_size_module_exports_and_onnxruntime_runs_it(cli, tmp_path):
    """A 0 in a Reshape target is a zero dimension (allowzero), not ONNX's "copy this one"."""
    src, inputs, _ = _zero_size_module(tmp_path, "reshape")
    out = tmp_path / "m.onnx"
    r = cli("export", src, "--format", "onnx", "-o", out)
    assert r.rc == 0, r.err
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": inputs["x"]})
    assert y.shape == (2, 0, 2)


def test_policy_sheet_report_of_a_zero_size_module_has_no_figure_to_divide(cli, tmp_path):
    src, _, _ = _zero_size_module(tmp_path, "reshape")
    r = cli("report", src, "--target", "h100")
    assert r.rc == 0, r.err
    assert "- inferences/J" in r.out
    j = cli("report", src, "--target", "h100", "--format", "json")
    assert _strict_json(j.out)["summary"]["modeled_inferences_per_joule"] is None


SPARSE_ASKED_IR = """func.func @main(%x: tensor<32x64xf32>) -> tensor<32x64xf32> {
  %w = mp.constant {value = dense<1.0> : tensor<64x64xf32>} : () -> tensor<64x64xf32>
  %0 = mp.matmul %x, %w {mp.kernel = "sparse_2_4"} : (tensor<32x64xf32>, tensor<64x64xf32>) -> tensor<32x64xf32>
  return %0 : tensor<32x64xf32>
}
"""


def test_report_of_a_sparse_kernel_the_target_lacks_says_it_runs_dense(cli, tmp_path):
    # Not legalized for the target: report's sparse section was an internal ValueError.
    src = tmp_path / "s.ir"
    src.write_text(SPARSE_ASKED_IR)
    r = cli("report", src, "--format", "json")
    assert r.rc == 0, r.err
    (op,) = _strict_json(r.out)["sparse"]["ops"]
    assert op["kernel"] == "sparse_2_4" and op["compute"] == "f32"
    assert op["note"].startswith("target 'generic' has no sparse_2_4 f32 kernel: the op runs dense")


# ---- export: what ONNX cannot type, and index types ONNX ops do not take -------------------

@pytest.mark.parametrize(("elem", "why"), [
    ("f8E8M0FNU", "f8E8M0FNU, which has no ONNX type at opset 21 (FLOAT8E8M0 needs opset 24"),
    ("f4E2M1FN", "f4E2M1FN: it would be exported as FLOAT4E2M1 (ONNX opset 23)"),
])
def test_export_of_an_argument_onnx_cannot_type_is_a_located_error(cli, tmp_path, elem, why):
    src, out = tmp_path / "m.ir", tmp_path / "m.onnx"
    src.write_text(f"func.func @main(%x: tensor<4x{elem}>) -> tensor<4xf32> {{\n"
                   f"  %0 = mp.cast %x : (tensor<4x{elem}>) -> tensor<4xf32>\n"
                   f"  return %0 : tensor<4xf32>\n}}\n")
    r = cli("export", src, "--format", "onnx", "-o", out)
    assert r.rc == 1 and not out.exists()
    assert r.err.startswith(f"{src}:1:17: error: argument %x has type tensor<4x{elem}>: {why}")
    assert "internal error" not in r.err


@pytest.mark.parametrize("elem", ["i8", "ui8", "i16", "ui16", "i32", "i64"])
@pytest.mark.parametrize("op", ["gather", "gather_elements"])
def test_gather_indices_of_any_integer_type_export_as_a_valid_model(cli, tmp_path, elem, op):
    idx = np.array([[4, 0, 2], [1, 1, 3]])
    if elem[0] == "i":  # signed: a negative index counts from the end, in ONNX and numpy
        idx[0, 0] = -1
    idx = idx.astype({"i8": np.int8, "ui8": np.uint8, "i16": np.int16, "ui16": np.uint16,
                      "i32": np.int32, "i64": np.int64}[elem])
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    if op == "gather":
        ref, out_shape = np.take(x, idx, axis=0), "2x3x3"
    else:
        ref, out_shape = np.take_along_axis(x, idx.astype(np.int64) % 5, axis=0), "2x3"
    src, out = tmp_path / "m.ir", tmp_path / "m.onnx"
    src.write_text(
        f"func.func @main(%x: tensor<5x3xf32>, %i: tensor<2x3x{elem}>) -> "
        f"tensor<{out_shape}xf32> {{\n"
        f"  %0 = mp.{op} %x, %i {{axis = 0}} : (tensor<5x3xf32>, tensor<2x3x{elem}>) -> "
        f"tensor<{out_shape}xf32>\n  return %0 : tensor<{out_shape}xf32>\n}}\n")
    r = cli("export", src, "--format", "onnx", "-o", out)
    assert r.rc == 0, r.err
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": x, "i": idx})
    np.testing.assert_array_equal(y, ref)
    ours = Program(parse_file(src)).run([x, idx], reference=False).outputs[0]
    np.testing.assert_array_equal(ours, ref)


# ---- import --------------------------------------------------------------------------------

def _save(tmp_path, nodes, inits, inputs, outputs, opset: int, name: str = "m.onnx"):
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    path = tmp_path / name
    onnx.save(model, str(path))
    return path, model


def test_constant_of_shape_beyond_the_fold_limit_is_refused_naming_the_node(cli, tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["c"], name="huge_fill",
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
             helper.make_node("ReduceSum", ["c"], ["r"], keepdims=0),
             helper.make_node("Add", ["x", "r"], ["y"])]
    shape = numpy_helper.from_array(np.array([2 ** 31, 2 ** 31], np.int64), "shape")
    path, _ = _save(tmp_path, nodes, [shape], [x], [y], 13)
    out = tmp_path / "m.ir"
    r = cli("import", path, "-o", out)
    assert r.rc == 1 and not out.exists()
    assert r.err.startswith(
        f"{path}: error: node 'huge_fill' (ConstantOfShape): shape [2147483648, 2147483648] "
        f"has 4611686018427387904 elements, more than the 2147483648 (2^31) that import "
        f"folds into a constant")


def test_opset_13_qdq_model_imports_and_matches_onnxruntime(cli, tmp_path):
    """DequantizeLinear-13 (no block_size, no output_dtype) on int8 weights and an int32 bias,
    as opset-13 QDQ exporters write them; the constant ones are folded."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "xs"),
             numpy_helper.from_array(np.array(3, np.uint8), "xz"),
             numpy_helper.from_array(rng.integers(-100, 100, (4, 3)).astype(np.int8), "wq"),
             numpy_helper.from_array(np.array([0.01, 0.02, 0.03], np.float32), "ws"),
             numpy_helper.from_array(np.zeros(3, np.int8), "wz"),
             numpy_helper.from_array(np.array([10, -20, 30], np.int32), "bq"),
             numpy_helper.from_array(np.array([5e-4, 1e-3, 1.5e-3], np.float32), "bs")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=1),
             helper.make_node("DequantizeLinear", ["bq", "bs"], ["bd"], axis=0),
             helper.make_node("MatMul", ["xd", "wd"], ["mm"]),
             helper.make_node("Add", ["mm", "bd"], ["y"])]
    path, model = _save(tmp_path, nodes, inits, [x], [y], 13)
    onnx.checker.check_model(model, full_check=True)
    out = tmp_path / "m.ir"
    r = cli("import", path, "-o", out)
    assert r.rc == 0, r.err
    xs = rng.uniform(-3, 3, (2, 4)).astype(np.float32)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, {"x": xs})
    got = Program(parse_file(out)).run([xs], reference=False).outputs[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


# ---- fp8 plans lower to verified modules ---------------------------------------------------

FOLLOW = {  # op line on %x, %y (both 2x4x8x8 bf16), its result type, numpy on the fp8 values
    "slice": ("mp.slice %x {starts = [0, 0, 0, 0], ends = [1, 4, 8, 8]}", "1x4x8x8",
              lambda x, y: x[:1]),
    "flatten": ("mp.flatten %x {axis = 1}", "2x256", lambda x, y: x.reshape(2, 256)),
    "reshape": ("mp.reshape %x", "8x64", lambda x, y: x.reshape(8, 64)),
    "transpose": ("mp.transpose %x {perm = [3, 2, 1, 0]}", "8x8x4x2",
                  lambda x, y: x.transpose(3, 2, 1, 0)),
    "concat": ("mp.concat %x, %y {axis = 0}", "4x4x8x8",
               lambda x, y: np.concatenate([x, y])),
    "relu": ("mp.relu %x", "2x4x8x8", lambda x, y: np.maximum(x, 0)),
    "neg": ("mp.neg %x", "2x4x8x8", np.negative),
    "maximum": ("mp.maximum %x, %y", "2x4x8x8", np.maximum),
    "reduce_max": ("mp.reduce_max %x {axes = [3], keepdims = false}", "2x4x8",
                   lambda x, y: x.max(axis=3)),
    "max_pool2d": (("mp.max_pool2d %x {kernel = [2, 2], strides = [2, 2], "
                   "padding = [0, 0, 0, 0]}"), "2x4x4x4",
                   lambda x, y: x.reshape(2, 4, 4, 2, 4, 2).max(axis=(3, 5))),
}


@pytest.mark.parametrize("policy", ["fp8-block", "fp8"])
@pytest.mark.parametrize("case", list(FOLLOW))
def test_fp8_follow_op_on_a_bf16_input_lowers_to_a_verified_module(cli, tmp_path, policy, case):
    """The follow rule lowers an op with bf16 inputs to f8E4M3FN where the op has an fp8
    form (the data movement always does): it moves fp8 values and its result is fp8, as its
    type rule says (only a GEMM writes its accumulator); other ops stay f32."""
    line, shape, ref = FOLLOW[case]
    t = "tensor<2x4x8x8xbf16>"
    operands = ", ".join([t] * line.count("%"))
    src, low, out = tmp_path / "m.ir", tmp_path / "low.ir", tmp_path / "out.npz"
    src.write_text(f"func.func @main(%x: {t}, %y: {t}) -> tensor<{shape}xbf16> {{\n"
                   f"  %0 = {line} : ({operands}) -> tensor<{shape}xbf16>\n"
                   f"  return %0 : tensor<{shape}xbf16>\n}}\n")
    r = cli("opt", src, f"--pass=assign-precision{{policy={policy}}}", "--pass=insert-casts",
            "-o", low)
    assert r.rc == 0, r.err
    lowered = f"tensor<{shape}xf8E4M3FN>" in low.read_text()
    assert lowered or case not in ("slice", "flatten", "reshape", "transpose", "concat")
    rng = np.random.default_rng(2)
    x, y = (rng.standard_normal((2, 4, 8, 8)).astype(ml_dtypes.bfloat16).astype(np.float32)
            for _ in range(2))
    np.savez(tmp_path / "in.npz", x=x, y=y)
    r = cli("run", low, "--inputs", tmp_path / "in.npz", "--save-outputs", out)
    assert r.rc == 0, r.err
    if lowered:
        x, y = (v.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) for v in (x, y))
    np.testing.assert_array_equal(np.load(out)["output_0"], ref(x, y))


@dataclass
class _BreaksTypes(Pass):
    """Gives the first op a result type its type rule refuses (a stand-in for a pass bug)."""

    name: ClassVar[str] = "breaks-types"

    def run(self, module: Module, ctx: PassContext) -> None:
        f = module.function()
        n = next(iter(f.ops()))
        f.set_result_type(n, 0, f.types(n)[0].with_elem("f16"))


def test_verification_failure_after_a_pass_is_an_internal_error_of_that_pass():
    module = parse("func.func @main(%x: tensor<2xf32>) -> tensor<2xf32> {\n"
                   "  %0 = mp.relu %x : (tensor<2xf32>) -> tensor<2xf32>\n"
                   "  return %0 : tensor<2xf32>\n}\n", "m.ir")
    verify(module)
    with pytest.raises(DiagnosticError) as e:
        PassManager([_BreaksTypes()]).run(module, PassContext())
    (d,) = e.value.diagnostics[:1]
    assert d.message.startswith(
        "internal error in pass 'breaks-types' (a bug in mplower, not in the input; please "
        "report it): the module it produced fails verification: 'mp.relu' result type "
        "tensor<2xf16>")
    assert (d.loc.line, d.loc.col) == (2, 3)  # at the op the pass left invalid


# ---- what the export reproduces (export --help, docs/onnx.md) -------------------------------

CHAIN = """module attributes {mp.weights = "w.npz"} {
func.func @main(%x: tensor<32x256xf32>) -> (tensor<32x64xf8E4M3FN>, tensor<32x16xf32>) {
  %w1 = mp.constant {name = "w1"} : () -> tensor<256x64xf32>
  %w2 = mp.constant {name = "w2"} : () -> tensor<64x16xf8E4M3FN>
  %h = mp.matmul %x, %w1 : (tensor<32x256xf32>, tensor<256x64xf32>) -> tensor<32x64xf32>
  %a = mp.scaled_quant %h {recipe = "current"} : (tensor<32x64xf32>) -> tensor<32x64xf8E4M3FN>
  %y = mp.matmul %a, %w2 : (tensor<32x64xf8E4M3FN>, tensor<64x16xf8E4M3FN>) -> tensor<32x16xf32>
  return %a, %y : tensor<32x64xf8E4M3FN>, tensor<32x16xf32>
}
}"""


def test_current_scaled_fp8_after_runtime_sums_is_within_one_fp8_code(cli, tmp_path):
    """The stated tolerance of current scaling: the runtime's f32 MatMul sums in its own order,
    so the values (and their amax) feeding an fp8 rounding differ in the last bit and may round
    to the neighbouring fp8 code; never further, and the output stays within rel-L2 0.02."""
    rng = np.random.default_rng(5)
    w1 = rng.standard_normal((256, 64)).astype(np.float32) / 16
    w2 = rng.standard_normal((64, 16)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    src, out = tmp_path / "m.ir", tmp_path / "m.onnx"
    src.write_text(CHAIN)
    np.savez(tmp_path / "w.npz", w1=w1, w2=w2)
    assert cli("export", src, "--format", "onnx", "-o", out).rc == 0
    x = rng.standard_normal((32, 256)).astype(np.float32)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    a_rt, y_rt = sess.run(None, {"x": x})
    a_mp, y_mp = Program(parse_file(src)).run([x], reference=False).outputs

    def codes(v: np.ndarray) -> np.ndarray:
        """The signed rank among E4M3's codes of each scaled value: the largest magnitude is
        the tensor's amax, which current scaling maps to 448, so v / (max|v| / 448) is the
        E4M3 value the run rounded to (its own scale, whichever amax it saw)."""
        v = np.asarray(v, np.float32)
        q = v / (np.abs(v).max() / np.float32(448))
        e4m3 = q.astype(ml_dtypes.float8_e4m3fn)
        np.testing.assert_array_equal(e4m3.astype(np.float32), q)
        bits = e4m3.view(np.uint8)
        mag = (bits & 0x7F).astype(np.int64)
        return np.where(bits & 0x80, -mag, mag)
    assert np.abs(codes(a_rt) - codes(a_mp)).max() <= 1
    rel = np.linalg.norm(y_rt - y_mp) / np.linalg.norm(y_mp)
    assert rel <= 0.02


def test_exported_rounding_and_moving_without_sums_is_bit_identical(cli, tmp_path):
    """The first statement of export --help: casts, data movement, elementwise ops and
    quantize/dequantize compute exactly what the executor computes."""
    src, out = tmp_path / "m.ir", tmp_path / "m.onnx"
    src.write_text("""func.func @main(%x: tensor<4x6xf32>) -> tensor<3x4xf32> {
  %b = mp.cast %x : (tensor<4x6xf32>) -> tensor<4x6xbf16>
  %t = mp.transpose %b {perm = [1, 0]} : (tensor<4x6xbf16>) -> tensor<6x4xbf16>
  %s = mp.slice %t {starts = [0, 0], ends = [6, 4], steps = [2, 1]} : (tensor<6x4xbf16>) -> tensor<3x4xbf16>
  %m = mp.mul %s, %s : (tensor<3x4xbf16>, tensor<3x4xbf16>) -> tensor<3x4xbf16>
  %e = mp.exp %m : (tensor<3x4xbf16>) -> tensor<3x4xbf16>
  %f = mp.cast %e : (tensor<3x4xbf16>) -> tensor<3x4xf32>
  %q = mp.quantize %f {scale = 0.125, zero_point = -3} : (tensor<3x4xf32>) -> tensor<3x4xi8>
  %y = mp.dequantize %q {scale = 0.125, zero_point = -3} : (tensor<3x4xi8>) -> tensor<3x4xf32>
  return %y : tensor<3x4xf32>
}""")
    assert cli("export", src, "--format", "onnx", "-o", out).rc == 0
    x = np.random.default_rng(6).uniform(-1.5, 1.5, (4, 6)).astype(np.float32)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"x": x})
    want = Program(parse_file(src)).run([x], reference=False).outputs[0]
    np.testing.assert_array_equal(got, want)
    # and both are numpy's: exp of the bf16 square, rounded to bf16, then the int8 QDQ
    s = x.astype(ml_dtypes.bfloat16).T[::2]
    e = np.exp((s * s).astype(np.float32)).astype(ml_dtypes.bfloat16).astype(np.float32)
    q = np.clip(np.round(e / np.float32(0.125)) - 3, -128, 127)
    np.testing.assert_array_equal(want, ((q + 3) * np.float32(0.125)).astype(np.float32))


def test_export_help_states_what_is_reproduced(cli):
    r = cli("export", "--help")
    text = " ".join(r.out.split())
    assert "bit-identical" in text and "within 1 ULP" in text and "one fp8 code" in text
