"""One op, one place: a toy op added through its four places only, end to end.

`mp.toy_tile` (numpy.tile, ONNX Tile) is declared here as a dialect would declare it (its
signature, traits, shape rule, reference, FLOPs and precisions), with an exporter emitter and
an importer handler, and nothing else: no policy sheet, range-analysis table, backend kernel
or exporter branch names it. The test sees it parse, verify, follow its bf16 input in the bf16
sheet (through the `@data-movement` group), pass ranges through, run, export to ONNX that
onnxruntime runs, and import back. The fixture removes it again, so that the op tables the
other tests pin stay as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from mplower.dialect.plan import Plan
from mplower.ir.diagnostics import Location
from mplower.ir.opdef import OPS, AttrSpec, OpDef, OpError, Trait, attr_ints, define
from mplower.ir.parser import parse
from mplower.ir.types import TensorType, tensor
from mplower.ir.verifier import verify
from mplower.numerics.formats import COMPUTE_FORMATS
from mplower.onnx import exporter, importer

TOY = "mp.toy_tile"


# ---- place 1: the definition --------------------------------------------------------------

def _toy_infer(ins, attrs, declared) -> list[TensorType]:
    (x,) = ins
    reps = attr_ints(attrs["reps"])
    if len(reps) != x.rank or min(reps, default=1) < 1:
        raise OpError(f"reps must give one count >= 1 per dimension of {x}, got {list(reps)}")
    return [tensor(tuple(d * r for d, r in zip(x.shape, reps)), x.elem)]


def _toy_reference(xs, attrs, result_types=None) -> list[np.ndarray]:
    return [np.tile(np.asarray(xs[0]), attr_ints(attrs["reps"]))]


TOY_DEF = OpDef(
    name=TOY, min_operands=1, max_operands=1, attrs={"reps": AttrSpec("ints", required=True)},
    infer=_toy_infer, reference=_toy_reference, flops=lambda ins, outs, attrs: 0,
    precisions=frozenset(COMPUTE_FORMATS),
    traits=frozenset({Trait.PURE, Trait.DATA_MOVEMENT, Trait.VALUE_PRESERVING}),
    doc="The operand repeated `reps` times along each dimension (ONNX Tile).",
    operand_names=("x",))


# ---- place 2: the exporter emitter ----------------------------------------------------------

def _emit_toy(self, op, a, ins, in_types, out_t, hint) -> str:
    # onnxruntime's CPU Tile has no bf16 kernel: tile the exact FLOAT copy and cast back.
    x = self.as_float(ins[0], in_types[0])
    reps = self.ints(attr_ints(a["reps"]), f"{hint}_reps")
    if x == ins[0]:
        return self.node("Tile", [x, reps], hint)
    y = self.node("Tile", [x, reps], f"{hint}_f32")
    return self.node("Cast", [y], hint, to=exporter.ONNX_TYPE[out_t.elem])


# ---- place 3: the importer handler ----------------------------------------------------------

def _import_toy(imp, node: onnx.NodeProto) -> list:
    x = imp.run_input(0)
    reps = [int(r) for r in imp.const(1, "the repeats").reshape(-1)]
    return [imp.emit(TOY, [x], {"reps": reps}, onnx_type=x.onnx_type)]


@pytest.fixture
def toy_op() -> Iterator[None]:
    assert TOY not in OPS
    tile = importer.HANDLERS["Tile"]  # the real Tile handler steps aside for the toy's
    define(TOY_DEF)
    exporter.emitter(TOY)(_emit_toy)
    importer.handler("Tile")(_import_toy)
    try:
        yield
    finally:
        del OPS[TOY], exporter.EMITTERS[TOY]
        importer.HANDLERS["Tile"] = tile


# ---- place 4: its tests ---------------------------------------------------------------------

IR = """func.func @main(%x: tensor<2x3xbf16>) -> tensor<4x3xbf16> {
  %t = mp.toy_tile %x {reps = [2, 1]} : (tensor<2x3xbf16>) -> tensor<4x3xbf16>
  return %t : tensor<4x3xbf16>
}
"""


def _x() -> np.ndarray:
    """bf16 values (ml_dtypes, independent of mplower's rounding), with one that f32 would
    round differently: what runs must move the bits, not recompute them."""
    return np.array([[1.0, -2.5, 3.140625], [0.0078125, -0.0, 65280.0]], ml_dtypes.bfloat16)


def _lowered(tmp_path: Path):
    from mplower.pass_manager import PassManager, parse_pipeline

    module = parse(IR, str(tmp_path / "toy.ir"))
    verify(module)
    PassManager(parse_pipeline("assign-precision{policy=bf16},insert-casts")).run(module)
    return module


def test_toy_op_parses_verifies_and_rejects_a_wrong_shape(toy_op, tmp_path: Path) -> None:
    from mplower.ir.diagnostics import DiagnosticError

    module = parse(IR, "toy.ir")
    verify(module)
    f = module.function(None)
    (t,) = [n for n in f.ops() if f.op(n) == TOY]
    assert f.types(t) == [tensor((4, 3), "bf16")]
    wrong = IR.replace("reps = [2, 1]", "reps = [2]")
    with pytest.raises(DiagnosticError) as info:
        verify(parse(wrong, "toy.ir"))
    assert "reps must give one count >= 1 per dimension" in info.value.diagnostics[0].message
    assert info.value.diagnostics[0].loc.line == 2


def test_toy_op_follows_its_bf16_input_in_every_sheet_with_the_group(toy_op, tmp_path) -> None:
    from mplower.lowering.policy import builtin_policies, load_policy

    module = _lowered(tmp_path)
    f = module.function(None)
    (t,) = [n for n in f.ops() if f.op(n) == TOY]
    plan = Plan.at(f, t)
    assert (plan.precision, plan.reason) == ("bf16", "follow: inputs bf16")
    assert f.types(t) == [tensor((4, 3), "bf16")]  # no cast: insert-casts had nothing to do
    assert [f.op(n) for n in f.ops()] == [TOY, "return"]
    following = {name for name in builtin_policies() if load_policy(name).listed(TOY) == "follow"}
    assert following == set(builtin_policies()) - {"tf32"}  # tf32 has no follow list


def test_range_analysis_passes_the_toy_ops_range_through(toy_op) -> None:
    from mplower.passes.range_analysis import Interval, propagate

    got = propagate(TOY, [Interval(-2.5, 65280.0)], {"reps": (2, 1)}, [tensor((2, 3), "f32")],
                    tensor((4, 3), "f32"), [None])
    assert (got.lo, got.hi) == (-2.5, 65280.0)


def test_toy_op_runs_exports_and_imports_back(toy_op, tmp_path: Path) -> None:
    from mplower.backend.executor import Program

    module = _lowered(tmp_path)
    x = _x()
    want = np.tile(x, (2, 1))  # numpy's own tile of the bf16 values

    (ran,) = Program(module).run([x.astype(np.float32)], reference=False).outputs
    assert np.array_equal(np.asarray(ran, np.float32).view(np.uint32),
                          want.astype(np.float32).view(np.uint32))

    model = exporter.export_module(module).model
    assert [n.op_type for n in model.graph.node].count("Tile") == 1
    data = exporter.check_and_serialize(model, Location("toy.ir", 0, 0))
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    (theirs,) = session.run(None, {session.get_inputs()[0].name: x.astype(np.float32)})
    assert np.array_equal(theirs, want.astype(np.float32))

    back = importer.import_model(onnx.load_from_string(data), "toy.onnx").module
    g = back.function(None)
    assert [g.op(n) for n in g.ops() if g.op(n) == TOY] == [TOY]
    (again,) = Program(back).run([x.astype(np.float32)], reference=False).outputs
    assert np.array_equal(np.asarray(again, np.float32), want.astype(np.float32))
