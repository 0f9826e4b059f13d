"""What a run holds (issue 32, memory): Program.run drops each value and its fp32 reference
after their last reader, keeps only the outputs and the slots asked for, and its per-op drift
is the same, bit for bit, as drift taken on every value kept (what the executor did before).

No timing or RSS thresholds: the mechanism is pinned with weak references to the tensors.
"""

from __future__ import annotations

import dataclasses
import json
import math
import weakref

import numpy as np
import pytest
from test_backend import EXAMPLES, example_inputs

from mplower.backend import kernels
from mplower.backend.executor import Program
from mplower.ir.parser import parse
from mplower.numerics.metrics import drift
from mplower.pass_manager import PassContext, load_passes
from mplower.passes.insert_casts import materialize

FIGURES = ("rel_l2", "sqnr_db", "max_abs", "nonfinite_mismatch")


def bf16_transformer() -> Program:
    path = EXAMPLES / "transformer.ir"
    module = parse(path.read_text(), str(path))
    module.path = str(path)
    load_passes()["assign-precision"](policy="bf16").run(module, PassContext())
    materialize(module)
    return Program(module)


def same(a: float | None, b: float | None) -> bool:
    return a is None and b is None or a is not None and b is not None and (
        a == b or (math.isnan(a) and math.isnan(b)))


def test_a_run_holds_only_its_outputs_and_the_slots_it_keeps() -> None:
    prog = bf16_transformer()
    x = example_inputs("transformer")
    some = prog.steps[len(prog.steps) // 2].output
    result = prog.run(x, keep={some})
    held = {i for i, v in enumerate(result.values) if v is not None}
    held_refs = {i for i, v in enumerate(result.refs) if v is not None}
    assert held == held_refs == {*prog.outputs, some}
    everything = prog.run(x, keep=True)
    assert all(everything.values[s.output] is not None for s in prog.steps)
    np.testing.assert_array_equal(result.values[some], everything.values[some])


def test_drift_is_bit_for_bit_that_of_every_value_kept() -> None:
    prog = bf16_transformer()
    x = example_inputs("transformer")
    lean, full = prog.run(x), prog.run(x, keep=True)
    checked = 0
    for a, b in zip(lean.ops, full.ops, strict=True):
        assert all(same(getattr(a, k), getattr(b, k)) for k in FIGURES), a.step.name
        if b.rel_l2 is not None:  # and both figures are drift() of the two values themselves
            d = drift(full.values[b.step.output], full.refs[b.step.output])
            assert same(d.rel_l2, a.rel_l2) and same(d.max_abs, a.max_abs)
            checked += 1
    assert checked > 10
    for y, z in zip(lean.outputs + lean.reference, full.outputs + full.reference, strict=True):
        assert np.asarray(y).tobytes() == np.asarray(z).tobytes()


def test_values_are_freed_after_their_last_reader() -> None:
    prog = bf16_transformer()
    last = {i: k for k, s in enumerate(prog.steps) for i in s.inputs}
    outputs = set(prog.outputs)
    # (kind, slot) -> weakref of the value ('run') or its reference; a result that is a view
    # of an operand (a reshape) keeps that operand's memory: they live as one, to the later
    # of their last readers.
    alive: dict[tuple[str, int], weakref.ref] = {}
    root: dict[tuple[str, int], tuple[str, int]] = {}
    until: dict[tuple[str, int], int] = {}
    late: list[str] = []

    def watch(k: int, step, kind: str, fn):
        def run(xs):
            late.extend(f"{kind} {key[1]} (last read by step {until[root[key]]}) at step {k}"
                        for key, r in alive.items() if r() is not None
                        and until[root[key]] < k and key[1] not in outputs)
            out = fn(xs)
            y = out[0] if isinstance(out, tuple) else out
            shared = [i for i, x in zip(step.inputs, xs)
                      if isinstance(x, np.ndarray) and np.shares_memory(x, y)] \
                if isinstance(y, np.ndarray) else []
            # A constant's value (or a view of it: a reference cast is the identity) lives
            # with the program, not the run.
            if isinstance(y, np.ndarray) and step.constant is None \
                    and all((kind, i) in root for i in shared):
                key = (kind, step.output)
                alive[key], root[key] = weakref.ref(y), key
                until[key] = last.get(step.output, -1)
                for i in shared:
                    r = root[(kind, i)]
                    root[key], until[r] = r, max(until[r], until[key])
            return out
        return run

    prog.steps = [dataclasses.replace(s, run=watch(k, s, "run", s.run),
                                      reference=watch(k, s, "reference", s.reference))
                  for k, s in enumerate(prog.steps)]
    prog.run(example_inputs("transformer"))
    assert len(alive) > 20
    assert not late, late[:5]


def test_a_reference_overflow_is_still_located_with_the_values_freed(tmp_path) -> None:
    # 1e30 * 1e30 overflows f32 in the first op; the second op carries the inf on; the run
    # frees the first op's reference, so the diagnosis runs the reference again.
    text = """module {
  func.func @main(%x: tensor<2xf32>) -> tensor<2xf32> {
    %a = "mp.mul"(%x, %x) : (tensor<2xf32>, tensor<2xf32>) -> tensor<2xf32>
    %b = "mp.add"(%a, %x) : (tensor<2xf32>, tensor<2xf32>) -> tensor<2xf32>
    return %b : tensor<2xf32>
  }
}
"""
    from mplower.ir.diagnostics import DiagnosticError
    from mplower.report.run import build_report

    module = parse(text, "<t>")
    result = Program(module).run([np.array([1e30, 1.0], np.float32)])
    assert result.refs[prog_slot(module, "a")] is None
    try:
        build_report(result, {})
    except DiagnosticError as e:
        assert "%a (mp.mul)" in e.diagnostics[0].message
    else:
        raise AssertionError("the overflowing reference was not refused")


def prog_slot(module, name: str) -> int:
    prog = Program(module)
    return next(s.output for s in prog.steps if s.name == f"%{name}")


def test_cli_no_reference_runs_the_plan_alone(cli, tmp_path) -> None:
    ir, inputs = EXAMPLES / "mlp.ir", EXAMPLES / "mlp_inputs.npz"
    full, plain = tmp_path / "full.npz", tmp_path / "plain.npz"
    rc = cli("run", str(ir), "--inputs", str(inputs), "--save-outputs", str(full))
    assert rc.rc == 0, rc.err
    rc = cli("run", str(ir), "--inputs", str(inputs), "--save-outputs", str(plain),
             "--no-reference", "--report", str(tmp_path / "r.json"))
    assert rc.rc == 0, rc.err
    with np.load(full) as a, np.load(plain) as b:
        assert sorted(a) == sorted(b)
        assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["summary"]["output_rel_l2"] is None
    assert all(o["rel_l2"] is None for o in report["ops"])
    rc = cli("run", str(ir), "--inputs", str(inputs), "--no-reference",
             "--guardrail", "max_rel_l2=0.1")
    assert rc.rc == 2 and "--guardrail" in rc.err


@pytest.mark.parametrize("op, elem", [("mp.hard_swish", "f32"), ("mp.hard_swish", "bf16"),
                                      ("mp.gelu", "f16"), ("mp.elu", "bf16")])
def test_elementwise_ops_in_pieces_give_the_same_bits_and_counts(op, elem, monkeypatch) -> None:
    # A one-operand elementwise op runs piece by piece (kernels.PIECE) to bound its float64
    # temporaries: the same values and counts as on the whole tensor at once.
    n = 3 * kernels.PIECE + 17
    t = f"tensor<{n}x{elem}>"
    text = f"""module {{
  func.func @main(%x: tensor<{n}xf32>) -> {t} {{
    %c = "mp.cast"(%x) : (tensor<{n}xf32>) -> {t}
    %y = "{op}"(%c) : ({t}) -> {t}
    return %y : {t}
  }}
}}
"""
    x = np.random.default_rng(4).normal(0, 30, n).astype(np.float32)
    x[:50] = np.float32(1e-41)  # subnormal: underflows in the narrow formats
    pieces = Program(parse(text, "<t>")).run([x])
    monkeypatch.setattr(kernels, "PIECE", 10 * n)
    whole = Program(parse(text, "<t>")).run([x])
    for a, b in ((pieces.outputs[0], whole.outputs[0]), (pieces.reference[0], whole.reference[0])):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert [r.counts for r in pieces.ops] == [r.counts for r in whole.ops]
    assert [r.rel_l2 for r in pieces.ops] == [r.rel_l2 for r in whole.ops]


def test_a_reference_equal_to_the_value_bit_for_bit_is_held_once() -> None:
    # An fp32 module: every reference equals its value, so the full report holds one array
    # per value, as the plain run does (magika's report held a second 135 MiB one-hot).
    path = EXAMPLES / "transformer.ir"
    module = parse(path.read_text(), str(path))
    module.path = str(path)
    prog = Program(module)
    result = prog.run(example_inputs("transformer"), keep=True)
    shared = [s for s in prog.steps if result.refs[s.output] is result.values[s.output]]
    assert len(shared) == len(prog.steps)
    assert all(op.rel_l2 in (0.0, None) for op in result.ops)
    # A bf16 plan rounds: its rounded values keep their own reference, the others share.
    lowered = bf16_transformer()
    result = lowered.run(example_inputs("transformer"), keep=True)
    own = [s for s in lowered.steps if result.refs[s.output] is not result.values[s.output]
           and result.refs[s.output] is not None]
    assert own and all(not np.array_equal(result.values[s.output], result.refs[s.output])
                       or result.values[s.output].dtype != result.refs[s.output].dtype
                       for s in own)
