"""Conformance against suites nobody here wrote: ONNX's backend node tests and light models.

The node tests are regenerated offline from the installed onnx package
(`onnx.backend.test.case.node.collect_testcases()` written out by
`onnx.backend.test.cmd_tools.generate_data`) into a cache folder, once per onnx version, and
read back from disk as any runtime's test runner reads them. Every test whose op types the
importer claims and whose tensor types the IR has runs
through `mplower.onnx.backend` in fp32 and is compared with ONNX's own `assert_similar_outputs`
at the test's tolerances. The nine `light_*` models shipped in the onnx wheel run through
`onnx.backend.test.BackendTest`, exactly as for other runtimes (inputs from its dummy-data
generator, expected outputs from the wheel).

docs/conformance.md holds the generated tables; `python tests/test_onnx_conformance.py` rewrites
them, and the test below fails when they are stale. The cache folder is `$MPLOWER_ONNX_CACHE`,
else `$XDG_CACHE_HOME/mplower` (default `~/.cache/mplower`), in a subfolder per onnx version.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
import unittest
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from mplower.ir.diagnostics import DiagnosticError
from mplower.onnx.backend import MplowerBackend
from mplower.onnx.importer import ELEM_OF_ONNX, HANDLERS, op_key

DOC = Path(__file__).resolve().parent.parent / "docs" / "conformance.md"
BEGIN, END = "<!-- BEGIN GENERATED: conformance -->", "<!-- END GENERATED: conformance -->"
LIGHT_MODELS = ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50",
                "shufflenet", "squeezenet", "vgg19", "zfnet512")
# Tensor types a claimed test may use: the IR's element types (INT64 and the other index
# types included since issue 16).
CLAIMED_TYPES = frozenset(ELEM_OF_ONNX)
MIN_PASS_RATE = 0.95
# ai.onnx ops that onnx ships no node test for, and the test that checks each one against
# onnxruntime instead.
NO_NODE_TEST = {"GlobalLpPool": "tests/test_onnx_more_ops.py",
                "MaxRoiPool": "tests/test_onnx_more_ops.py"}
# Why each known failure fails, for docs/conformance.md (the run supplies the symptom).
EXPLANATIONS = {
    "INT4": "ONNX's Cast leaves a float outside an integer type's range undefined; mp.cast "
            "saturates (-9 -> -8), and the test data holds whatever the numpy and ml_dtypes "
            "that generated it made of such values",
    "training_dropout": "training-mode Dropout draws a random mask; mplower imports inference "
                        "graphs",
    "attention_4d_causal_fp16": "f16 rounding order: onnx's reference rounds each numpy step to "
                                "f16, mplower's f16 ops round elsewhere; 1 ulp (4.9e-4) apart, "
                                "ours nearer the f32 result (3.96e-4 from it, the data 4.9e-4)",
    "scales_cubic_align_corners": "align_corners divides by the integer output length, as the "
                                  "operator's text and onnxruntime do; the test data divides by "
                                  "scale * length (onnxruntime fails this test too)",
    "scales_linear_align_corners": "align_corners divides by the integer output length, as the "
                                   "operator's text and onnxruntime do; the test data divides by "
                                   "scale * length (onnxruntime fails this test too)",
    "test_dft_inverse": "DFT of a runtime signal is an f32 matmul with the transform matrix: "
                        "outputs that the test's float64 FFT makes exactly 0 come out near "
                        "1e-6 (f32 rounding of a 20-term sum), beyond the test's atol 1e-7",
    "convtranspose_3d": "3-D ConvTranspose: mp.conv2d is 2-D (1-D runs as 2-D)",
    "attention_4d_causal_fp16_expanded": "float16 arithmetic: the expected output is onnx's "
                                         "numpy reference, whose Softmax rounds its "
                                         "exponentials and their sum to float16; mplower "
                                         "computes each op in f32 and rounds its result once, "
                                         "and 2 of 192 outputs land one float16 ulp beyond "
                                         "rtol 1e-3 (Mod, which made the test claimed, acts on "
                                         "integer positions)",
}


# ---- the cache ---------------------------------------------------------------------------------


def cache_dir() -> Path:
    root = os.environ.get("MPLOWER_ONNX_CACHE")
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "mplower")
    path = Path(root) / f"onnx-{onnx.__version__}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _quietly(fn, *args):
    """onnx builds its node test cases with numpy overflows on purpose (casts, log(0))."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(*args)


def node_test_data() -> Path:
    """The generated node tests (one folder per test), generated on first use."""
    cache = cache_dir()
    done = cache / "node"
    if (done / "manifest.json").exists():
        return done
    from onnx.backend.test import cmd_tools
    from onnx.backend.test.case import node as node_cases

    cases = _quietly(node_cases.collect_testcases)
    tmp = Path(tempfile.mkdtemp(prefix="node-", dir=cache))
    try:
        # generate_data writes the cases of `model_test.collect_testcases()`; hand it the node
        # cases instead, as the onnx repository's own data generation does.
        with mock.patch.object(cmd_tools, "model_test",
                               SimpleNamespace(collect_testcases=lambda: cases)):
            cmd_tools.generate_data(argparse.Namespace(output=str(tmp)))
        manifest = {c.name: {"rtol": c.rtol, "atol": c.atol} for c in cases}
        (tmp / "node" / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
        with contextlib.suppress(OSError):  # another process may have finished first
            os.replace(tmp / "node", done)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return done


# ---- running the node tests ----------------------------------------------------------------------


@dataclass
class Outcome:
    name: str
    group: str  # the op type, or "expanded: A+B+..." for a function-expanded test
    status: str  # "pass", "fail", or "unclaimed"
    cause: str = ""


def _op_types(graph: onnx.GraphProto) -> set[str]:
    ops = set()
    for n in graph.node:
        ops.add(op_key(n))
        for a in n.attribute:
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                ops |= _op_types(g)
    return ops


def _unclaimed_reason(model: onnx.ModelProto) -> str | None:
    missing = sorted(_op_types(model.graph) - set(HANDLERS))
    if missing:
        return f"op types not claimed: {', '.join(missing)}"
    for v in list(model.graph.input) + list(model.graph.output):
        if not v.type.HasField("tensor_type"):
            return f"'{v.name}' is not a tensor"
        t = v.type.tensor_type.elem_type
        if t not in CLAIMED_TYPES:
            return f"element type {TensorProto.DataType.Name(t)} is not in the IR"
    return None


def _group(model: onnx.ModelProto) -> str:
    ops = sorted(_op_types(model.graph))
    return ops[0] if len(ops) == 1 else "expanded: " + "+".join(ops)


def _read_tensor(path: Path) -> np.ndarray:
    t = TensorProto()
    t.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(t)


def run_node_test(folder: Path, rtol: float, atol: float) -> Outcome:
    from onnx.backend.test.runner import Runner

    model = onnx.load(str(folder / "model.onnx"))
    group = _group(model)
    reason = _unclaimed_reason(model)
    if reason is not None:
        return Outcome(folder.name, group, "unclaimed", reason)
    try:
        rep = MplowerBackend.prepare(model)
        for data in sorted(folder.glob("test_data_set_*")):
            inputs = [_read_tensor(data / f"input_{i}.pb")
                      for i in range(len(list(data.glob("input_*.pb"))))]
            expected = [_read_tensor(data / f"output_{i}.pb")
                        for i in range(len(list(data.glob("output_*.pb"))))]
            with np.errstate(all="ignore"):
                outputs = rep.run(inputs)
            Runner.assert_similar_outputs(expected, outputs, rtol=rtol, atol=atol)
    except DiagnosticError as e:
        return Outcome(folder.name, group, "fail", e.diagnostics[0].message)
    except AssertionError as e:
        # The count of mismatched elements, not their values: where a result is undefined
        # (a float cast out of an integer's range) the expected values depend on the libraries
        # that generated the data, and the doc must not change with them.
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        count = next((ln for ln in lines if ln.startswith("Mismatched elements")), lines[-1])
        return Outcome(folder.name, group, "fail", f"output mismatch: {count}")
    return Outcome(folder.name, group, "pass")


def run_node_suite() -> list[Outcome]:
    root = node_test_data()
    manifest = json.loads((root / "manifest.json").read_text())
    outcomes = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        tol = manifest.get(folder.name, {"rtol": 1e-3, "atol": 1e-7})
        outcomes.append(run_node_test(folder, tol["rtol"], tol["atol"]))
    return outcomes


# ---- the light models, through onnx's BackendTest ---------------------------------------------------


def run_light_model(name: str) -> tuple[bool, str, float]:
    """(passed, cause, seconds) of `test_<name>_cpu` under onnx.backend.test.BackendTest."""
    from onnx.backend.test import BackendTest

    home = cache_dir() / "onnx_home"
    with mock.patch.dict(os.environ, {"ONNX_HOME": str(home)}):
        test = f"test_{name}_cpu"
        cases = _quietly(BackendTest, MplowerBackend, __name__).include(f"^{test}$").test_cases
        suite = unittest.TestSuite([cls(test) for cls in cases.values() if hasattr(cls, test)])
        assert suite.countTestCases() == 1, f"BackendTest has no {test}"
        stream = io.StringIO()
        t0 = time.perf_counter()
        with np.errstate(all="ignore"):
            result = unittest.TextTestRunner(stream=stream, verbosity=0).run(suite)
        seconds = time.perf_counter() - t0
    problems = result.failures + result.errors
    cause = ""
    if problems:
        lines = [ln for ln in problems[0][1].strip().splitlines() if ln.strip()]
        cause = lines[-1].strip()
    return result.wasSuccessful() and not result.skipped, cause, seconds


# ---- the generated tables -----------------------------------------------------------------------


def render(outcomes: list[Outcome], light: dict[str, tuple[bool, str]]) -> str:
    claimed = [o for o in outcomes if o.status != "unclaimed"]
    passed = sum(o.status == "pass" for o in claimed)
    summary = (f"Node tests generated from onnx {onnx.__version__}: {len(outcomes)} in all, "
               f"{len(claimed)} claimed (op types the importer handles, tensor types the IR "
               f"has), **{passed} of {len(claimed)} pass "
               f"({100 * passed / len(claimed):.1f}%)**.")
    out = [BEGIN, "", summary, "",
           "| op | pass | claimed | not claimed (element type) |", "|---|---:|---:|---:|"]
    groups: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        if o.status != "unclaimed" or "element type" in o.cause or "not a tensor" in o.cause:
            groups[o.group][o.status] += 1
    for g in sorted(groups):
        c = groups[g]
        out.append(f"| {g} | {c['pass']} | {c['pass'] + c['fail']} | {c['unclaimed']} |")
    out += ["", "Failures of claimed tests, each with its cause:", "",
            "| test | symptom | cause |", "|---|---|---|"]
    for o in claimed:
        if o.status == "fail":
            why = next((w for k, w in EXPLANATIONS.items() if k in o.name), "")
            out.append(f"| `{o.name}` | {_cell(o.cause)} | {why} |")
    out += ["", *_operator_table(outcomes)]
    npass = sum(ok for ok, _ in light.values())
    light_summary = (f"Light models (onnx.backend.test.BackendTest, fp32): **{npass} of "
                     f"{len(light)} match** their expected outputs within ONNX's tolerances.")
    out += ["", light_summary, "", "| model | result |", "|---|---|"]
    for name in sorted(light):
        ok, cause = light[name]
        out.append(f"| {name} | {'pass' if ok else 'fail: ' + _cell(cause)} |")
    out += ["", END]
    return "\n".join(out)


def _operator_table(outcomes: list[Outcome]) -> list[str]:
    """The ai.onnx operators of the installed onnx against the importer's rules, each imported
    one with the pass count of the claimed node tests that use it (alone or expanded)."""
    ops = sorted({s.name for s in onnx.defs.get_all_schemas() if s.domain in ("", "ai.onnx")
                  and not s.deprecated})
    tests: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        if o.status != "unclaimed":
            for op in o.group.removeprefix("expanded: ").split("+"):
                tests[op][o.status] += 1
    imported = [op for op in ops if op in HANDLERS]
    head = (f"ONNX operators (ai.onnx, onnx {onnx.__version__}): **{len(imported)} of "
            f"{len(ops)} imported**; node tests that use each (alone or in an expanded graph), "
            f"passed of claimed:")
    out = [head, ""]
    out.append(", ".join(f"{op} {tests[op]['pass']}/{tests[op]['pass'] + tests[op]['fail']}"
                         for op in imported))
    out += ["", "Not imported: " + ", ".join(op for op in ops if op not in HANDLERS) + "."]
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:240]


def generated_section(text: str) -> str:
    if BEGIN not in text or END not in text:
        return ""
    return text[text.index(BEGIN):text.index(END) + len(END)]


# ---- the tests -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node_outcomes() -> list[Outcome]:
    return run_node_suite()


def test_node_tests_of_claimed_ops_pass(node_outcomes: list[Outcome]) -> None:
    claimed = [o for o in node_outcomes if o.status != "unclaimed"]
    failed = [o for o in claimed if o.status == "fail"]
    rate = 1 - len(failed) / len(claimed)
    assert len(claimed) > 400, f"only {len(claimed)} node tests are claimed"
    assert rate >= MIN_PASS_RATE, "\n".join(f"{o.name}: {o.cause}" for o in failed)


def test_every_handler_is_exercised_by_a_claimed_node_test(node_outcomes) -> None:
    seen = set()
    for o in node_outcomes:
        if o.status != "unclaimed":
            seen.update(o.group.removeprefix("expanded: ").split("+"))
    # Other domains' ops (com.microsoft) have no ONNX node tests: tests/test_onnx_msft.py.
    onnx_ops = {k for k in HANDLERS if "::" not in k} - set(NO_NODE_TEST)
    assert not onnx_ops - seen, f"no claimed node test uses {sorted(onnx_ops - seen)}"
    assert not seen & set(NO_NODE_TEST), "a node test now exists: drop the exemption"


@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_light_model_matches_expected_output(name: str) -> None:
    ok, cause, _ = run_light_model(name)
    assert ok, cause


def _run_backend_tests(pattern: str) -> unittest.TestResult:
    from onnx.backend.test import BackendTest

    bt = _quietly(BackendTest, MplowerBackend, __name__).include(pattern)
    with np.errstate(all="ignore"):
        return unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(bt.test_suite)


def test_backend_test_runs_node_tests_as_for_other_runtimes() -> None:
    pattern = (r"^test_(gemm_all_attributes|conv_with_strides_padding|maxpool_2d_ceil|"
               r"reshape_negative_dim|slice_neg_steps|layer_normalization_4d_axis1|"
               r"quantizelinear_axis|cast_FLOAT_to_BFLOAT16)_cpu$")
    result = _run_backend_tests(pattern)
    ran = result.testsRun - len(result.skipped)
    assert ran == 8 and result.wasSuccessful(), result.failures + result.errors


def test_run_node_and_device_support() -> None:
    node = onnx.helper.make_node("Gemm", ["a", "b"], ["y"], transB=1, alpha=2.0)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.ones((4, 3), np.float32)
    (y,) = MplowerBackend.run_node(node, [a, b])
    np.testing.assert_allclose(y, 2 * a @ b.T)
    assert MplowerBackend.supports_device("CPU") and not MplowerBackend.supports_device("CUDA")


def test_precision_plan_option_runs_the_lowered_model() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.5, (16, 8)).astype(np.float32)
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["h"]),
         onnx.helper.make_node("Tanh", ["h"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [onnx.helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        [numpy_helper.from_array(w, "w")])
    model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)])
    x = rng.normal(size=(4, 16)).astype(np.float32)
    fp32 = MplowerBackend.prepare(model).run([x])[0]
    rep = MplowerBackend.prepare(model, precision="bf16")
    bf16 = rep.run([x])[0]
    module = next(iter(rep._programs.values()))[0].module
    f = module.function()
    assert any(t.elem == "bf16" for n in f.ops() for t in f.types(n))
    assert bf16.dtype == np.float32 and not np.array_equal(bf16, fp32)
    np.testing.assert_allclose(bf16, fp32, rtol=0.05, atol=0.02)


def test_is_compatible_names_models_with_unclaimed_ops() -> None:
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("Bernoulli", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [onnx.helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    assert not MplowerBackend.is_compatible(onnx.helper.make_model(g))


def test_conformance_doc_is_current(node_outcomes: list[Outcome]) -> None:
    """docs/conformance.md lists exactly this run's node results; the light models are checked
    by their own tests above, and the doc's light table is compared with those results."""
    light = {n: (True, "") for n in LIGHT_MODELS}
    doc = generated_section(DOC.read_text(encoding="utf-8"))
    if f"generated from onnx {onnx.__version__}:" not in doc:
        pytest.skip(f"docs/conformance.md was generated with another onnx than "
                    f"{onnx.__version__}, whose node tests differ")
    stale = "docs/conformance.md is stale; run `python tests/test_onnx_conformance.py`"
    assert doc == render(node_outcomes, light), stale


def main() -> int:
    t0 = time.perf_counter()
    outcomes = run_node_suite()
    node_seconds = time.perf_counter() - t0
    light = {}
    for name in LIGHT_MODELS:
        ok, cause, seconds = run_light_model(name)
        light[name] = (ok, cause)
        print(f"{name}: {'pass' if ok else 'FAIL ' + cause} ({seconds:.1f} s)")
    section = render(outcomes, light)
    text = DOC.read_text(encoding="utf-8") if DOC.exists() else f"{BEGIN}\n{END}\n"
    old = generated_section(text) or f"{BEGIN}\n{END}"
    DOC.write_text(text.replace(old, section), encoding="utf-8")
    claimed = [o for o in outcomes if o.status != "unclaimed"]
    print(f"node tests: {sum(o.status == 'pass' for o in claimed)}/{len(claimed)} claimed pass "
          f"({node_seconds:.1f} s); wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
