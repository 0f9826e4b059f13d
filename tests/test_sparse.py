"""Sparsity end to end: pruning, the sparsify and lower-sparse passes, the CPU kernels, the
executor's sparse runner and the sparse reality check of `mplower report`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from mplower.passes.insert_casts import materialize
from mplower.passes.lower_sparse import Thresholds, choose_kernel

from mplower.backend.executor import Program
from mplower.backend.sparse import (
    compress_2_4,
    matmul_2_4,
    sparse_runner,
    spmm_csr,
    spmm_csr_t,
    to_csr,
)
from mplower.ir.parser import parse, parse_file
from mplower.ir.printer import print_module
from mplower.ir.types import DenseAttr, dense_to_str, tensor
from mplower.ir.verifier import verify
from mplower.lowering.sparsity import (
    has_pattern,
    other_bytes,
    patterns_of,
    prune_magnitude,
    prune_structured,
    storage,
)
from mplower.lowering.target import (
    CSR,
    DENSE,
    DTYPE_UNSUPPORTED,
    NO_CONSTANT_WEIGHT,
    NO_SPARSE_KERNEL,
    NOT_PROFITABLE,
    PATTERN_INVALID,
    SPARSE_1_2,
    SPARSE_2_4,
    TOO_SMALL,
    load_target,
)
from mplower.pass_manager import PassContext, PassManager, PipelineError, parse_pipeline
from mplower.report.sparse import reality_check

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "ir_examples"
WEIGHT_MATMULS = ("%q_proj", "%k_proj", "%v_proj", "%o_proj", "%ff1_proj", "%ff2_proj")
LIMITS = Thresholds(min_size=1024, min_dim=16, min_speedup=1.0, csr_min_sparsity=0.8)


def run_pipeline(module, pipeline: str, **ctx) -> dict:
    pm = PassManager(parse_pipeline(pipeline))
    pm.run(module, PassContext(**ctx))
    return pm.statistics


@pytest.fixture
def transformer(tmp_path: Path) -> Path:
    """A copy of the transformer example (IR and weights) in a scratch folder."""
    for suffix in (".ir", ".npz", "_inputs.npz"):
        shutil.copy(EXAMPLES / f"transformer{suffix}", tmp_path / f"transformer{suffix}")
    return tmp_path / "transformer.ir"


def lowered(transformer: Path, pipeline: str) -> Path:
    module = parse_file(transformer)
    out = transformer.with_name("lowered.ir")
    run_pipeline(module, pipeline, output_path=str(out))
    out.write_text(print_module(module))
    return out


def ops_by_name(module) -> dict:
    f = module.function()
    return {f.value_name((n, 0)): f.data(n) for n in f.ops() if f.types(n)}


# ---- pruning ---------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(w=hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, max_side=11),
                    elements=st.floats(-4, 4, width=32)),
       axis=st.sampled_from([0, 1]), pattern=st.sampled_from(["2:4", "1:2"]))
def test_structured_pruning_keeps_the_largest_of_each_group(w, axis, pattern):
    pruned = prune_structured(w, pattern, axis)
    m = 4 if pattern == "2:4" else 2
    assert has_pattern(pruned, pattern, axis)
    assert np.all((pruned == w) | (pruned == 0))  # values are kept or zeroed, never changed
    a, p = np.moveaxis(w, axis, -1), np.moveaxis(pruned, axis, -1)
    for idx in np.ndindex(a.shape[:-1]):
        for g0 in range(0, a.shape[-1], m):
            group, kept = np.abs(a[idx][g0:g0 + m]), p[idx][g0:g0 + m] != 0
            dropped = group[~kept & (group != 0)]
            assert not dropped.size or dropped.max() <= group[kept].min(initial=np.inf)


def test_structured_pruning_keeps_the_lower_index_on_ties():
    w = np.array([[1.5, -1.5, 1.5, 1.5, 2.0, 0.0, 1.0]]).T  # K = 7: groups [0:4], [4:7]
    assert prune_structured(w, "2:4", 0)[:, 0].tolist() == [1.5, -1.5, 0, 0, 2.0, 0, 1.0]
    assert prune_structured(w, "1:2", 0)[:, 0].tolist() == [1.5, 0, 1.5, 0, 2.0, 0, 1.0]


def test_magnitude_pruning_zeros_the_fraction_and_keeps_the_lower_index_on_ties():
    w = np.array([3.0, -1.0, 1.0, 0.5, 1.0, 2.0])
    assert prune_magnitude(w, 0.5).tolist() == [3.0, -1.0, 0, 0, 0, 2.0]
    assert prune_magnitude(w, 0.0).tolist() == w.tolist()
    assert np.count_nonzero(prune_magnitude(np.arange(1.0, 101.0), 0.95)) == 5


def test_a_1_2_weight_is_also_2_4_but_not_the_reverse():
    w = prune_structured(np.arange(1.0, 33.0).reshape(8, 4), "1:2", 0)
    assert patterns_of(w, 0) == {"1:2", "2:4"}
    # Increasing along K: each group of four keeps its last two, one pair, so no 1:2.
    assert patterns_of(prune_structured(np.arange(1.0, 33.0).reshape(8, 4), "2:4", 0), 0) \
        == {"2:4"}
    assert not has_pattern(np.ones((4, 4)), "2:4", 0)


def test_storage_of_each_format():
    # 2:4 bf16: half the values, 2 bits of position per kept value = 1/8 of the value bytes.
    assert storage(SPARSE_2_4, 64, 64, "bf16") == storage(SPARSE_1_2, 64, 64, "bf16")
    s = storage(SPARSE_2_4, 64, 64, "bf16")
    assert (s.values, s.metadata, s.overhead) == (4096, 512, 0.125)
    assert storage(SPARSE_2_4, 6, 1, "f32").values == 16  # K padded to 8: 4 kept values
    c = storage(CSR, 100, 10, "f32", nnz=50)
    assert (c.values, c.metadata) == (200, 4 * (50 + 101))
    assert storage(DENSE, 64, 64, "tf32").total == 64 * 64 * 4  # tf32 travels in 32 bits


# ---- sparsify ---------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=hnp.arrays(np.float32, st.tuples(st.integers(1, 9), st.integers(1, 5)),
                    elements=st.floats(-8, 8, width=32)))
def test_sparsify_output_always_has_the_2_4_pattern(w):
    k, n = w.shape
    weight = dense_to_str(DenseAttr(w, tensor((k, n), "f32")))
    module = parse(f"""func.func @main(%x: tensor<2x{k}xf32>) -> tensor<2x{n}xf32> {{
      %w = mp.constant {{value = {weight}}} : () -> tensor<{k}x{n}xf32>
      %0 = mp.matmul %x, %w : (tensor<2x{k}xf32>, tensor<{k}x{n}xf32>) -> tensor<2x{n}xf32>
      return %0 : tensor<2x{n}xf32>
    }}""")
    run_pipeline(module, "sparsify{pattern=2:4 min_size=0}")
    verify(module)
    f = parse(print_module(module)).function()  # through the printer and back
    value = next(f.attrs_of(n)["value"] for n in f.ops() if f.op(n) == "mp.constant")
    assert has_pattern(value.array, "2:4", 0)
    assert np.array_equal(value.array, prune_structured(w, "2:4", 0))


def test_sparsify_writes_all_weights_beside_the_output(transformer):
    module = parse_file(transformer)
    out = transformer.with_name("pruned.ir")
    stats = run_pipeline(module, "sparsify", output_path=str(out))["sparsify"]
    assert module.attrs["mp.weights"] == "pruned.npz"
    before = dict(np.load(transformer.with_suffix(".npz")))
    after = dict(np.load(out.with_suffix(".npz")))
    assert after.keys() == before.keys()
    for name, w in after.items():
        if name.endswith(".weight") and w.ndim == 2:
            assert has_pattern(w, "2:4", 0) and np.count_nonzero(w) == w.size // 2, name
        else:
            assert np.array_equal(w, before[name]), name  # copied as they were
    assert stats["weights-pruned"] == 6
    assert stats["values-pruned"] == stats["values-kept"] == 24576
    # The input's weights are untouched.
    assert np.array_equal(np.load(transformer.with_suffix(".npz"))["attn.q.weight"],
                          before["attn.q.weight"])


def test_sparsify_without_output_says_to_pass_o(transformer, cli):
    r = cli("opt", transformer, "--pass=sparsify")
    assert r.rc == 1 and r.out == ""
    assert "transformer.ir:6:5: error: sparsify prunes weights stored in transformer.npz " \
           "('attn.q.weight' and others); pass -o FILE" in r.err


def test_sparsify_leaves_constants_with_other_uses_alone():
    module = parse("""func.func @main(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
      %w = mp.constant {value = dense<1.0> : tensor<8x8xf32>} : () -> tensor<8x8xf32>
      %0 = mp.matmul %x, %w : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
      %1 = mp.add %w, %w : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
      %2 = mp.matmul %0, %1 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
      return %2 : tensor<4x8xf32>
    }""")
    stats = run_pipeline(module, "sparsify{min_size=0}")["sparsify"]
    assert stats["weights-skipped-shared"] == 1 and stats["weights-pruned"] == 0
    assert "dense<1.0>" in print_module(module)


def test_sparsify_prunes_convolutions_along_input_channels():
    w = np.arange(1.0, 1.0 + 2 * 8 * 3 * 3, dtype=np.float32).reshape(2, 8, 3, 3)
    module = parse(f"""func.func @main(%x: tensor<1x8x5x5xf32>) -> tensor<1x2x3x3xf32> {{
      %w = mp.constant {{value = {dense_to_str(DenseAttr(w, tensor(w.shape, "f32")))}}}
        : () -> tensor<2x8x3x3xf32>
      %0 = mp.conv2d %x, %w : (tensor<1x8x5x5xf32>, tensor<2x8x3x3xf32>) -> tensor<1x2x3x3xf32>
      return %0 : tensor<1x2x3x3xf32>
    }}""")
    run_pipeline(module, "sparsify{min_size=0}")
    f = module.function()
    pruned = next(f.attrs_of(n)["value"].array for n in f.ops() if f.op(n) == "mp.constant")
    assert has_pattern(pruned, "2:4", 1) and not has_pattern(w, "2:4", 1)


def test_sparsify_rejects_unknown_patterns():
    with pytest.raises(PipelineError, match="unknown pattern '2:8'"):
        parse_pipeline("sparsify{pattern=2:8}")
    with pytest.raises(PipelineError, match="'mp.add' has no weight operand"):
        parse_pipeline("sparsify{ops=mp.add}")


# ---- lower-sparse ----------------------------------------------------------------------------

def test_choose_kernel_gives_each_reason_code():
    h100, generic = load_target("h100"), load_target("generic")
    rng = np.random.default_rng(0)
    dense_w = rng.standard_normal((64, 64)).astype(np.float32)
    w24 = prune_structured(dense_w, "2:4", 0)
    flops, moved = 2 * 16 * 64 * 64, 2 * 16 * 64 * 2

    def pick(w, compute="bf16", target=h100, limits=LIMITS, rows=16):
        k, n = w.shape
        return choose_kernel(target, "mp.matmul", compute, w, 0, 2 * rows * k * n,
                             rows * (k + n) * 2, limits)

    assert pick(w24, target=generic).reason == NO_SPARSE_KERNEL
    assert pick(dense_w).reason == PATTERN_INVALID
    assert pick(w24, compute="f32").reason == DTYPE_UNSUPPORTED
    assert pick(w24, compute="tf32").reason == DTYPE_UNSUPPORTED  # h100's tf32 kernel is 1:2
    assert pick(prune_structured(dense_w, "1:2", 0), compute="tf32").kernel == SPARSE_1_2
    assert pick(w24[:8]).reason == TOO_SMALL
    strict = Thresholds(1024, 16, 1.5, 0.8)
    assert pick(w24, limits=strict).reason == NOT_PROFITABLE
    chosen = choose_kernel(h100, "mp.matmul", "bf16", w24, 0, flops, moved, LIMITS)
    assert chosen.kernel == SPARSE_2_4 and chosen.reason is None and chosen.speedup > 1
    # 90% zeros: CSR's smaller weight wins a memory-bound product; a compute-bound one runs
    # on CSR at the CUDA-core rate (67 TFLOP/s) for 10% of the work: slower than dense.
    sparse90 = prune_magnitude(rng.standard_normal((1024, 1024)).astype(np.float32), 0.9)
    assert pick(sparse90).kernel == CSR
    assert pick(sparse90, rows=8192).reason == NOT_PROFITABLE


def test_transformer_takes_the_2_4_path_in_bf16(transformer):
    out = lowered(transformer, "sparsify{pattern=2:4},assign-precision,lower-sparse{target=h100}")
    module = parse_file(out)
    verify(module)
    ops = ops_by_name(module)
    for name in WEIGHT_MATMULS:
        attrs = ops[name]["attrs"]
        assert attrs["mp.kernel"] == SPARSE_2_4, name
        assert "mp.sparse_reason" not in attrs
    f = module.function()
    encodes = [n for n in f.ops() if f.op(n) == "mp.sparse_encode"]
    assert len(encodes) == 6 and all(f.types(n)[0].encoding == "2:4" for n in encodes)
    # The attention matmuls multiply activations: dense, with the reason (before: no decision).
    for name, operand in (("%scores", "%k_t"), ("%ctx_heads", "%v_heads")):
        attrs = ops[name]["attrs"]
        assert (attrs["mp.kernel"], attrs["mp.sparse_reason"]) == (DENSE, NO_CONSTANT_WEIGHT)
        assert attrs["mp.reason"] == (f"allow-list; dense: no-constant-weight (operand #1 "
                                      f"{operand} is computed by mp.transpose, not a constant "
                                      f"weight)")
    assert module.attrs["mp.target"] == "h100"


def test_transformer_falls_back_under_the_fp32_plan(transformer):
    out = lowered(transformer,
                  "sparsify{pattern=2:4},assign-precision{policy=fp32},lower-sparse{target=h100}")
    ops = ops_by_name(parse_file(out))
    for name in WEIGHT_MATMULS:
        assert ops[name]["attrs"]["mp.kernel"] == DENSE
        assert ops[name]["attrs"]["mp.sparse_reason"] == DTYPE_UNSUPPORTED


def test_transformer_takes_1_2_under_tf32_when_pruned_1_2(transformer):
    out = lowered(transformer,
                  "sparsify{pattern=1:2},assign-precision{policy=tf32},lower-sparse{target=h100}")
    ops = ops_by_name(parse_file(out))
    assert {ops[n]["attrs"]["mp.kernel"] for n in WEIGHT_MATMULS} == {SPARSE_1_2}


def test_sparse_plan_survives_legalize_and_insert_casts_and_is_idempotent(transformer):
    out = lowered(transformer, "sparsify,assign-precision,lower-sparse{target=h100}")
    module = parse_file(out)
    text = print_module(module)
    run_pipeline(module, "lower-sparse{target=h100}")
    assert print_module(module) == text
    run_pipeline(module, "legalize{target=h100},insert-casts,canonicalize")
    verify(module)
    f = module.function()
    casts = [n for n in f.ops() if f.op(n) == "mp.cast" and f.types(n)[0].encoding == "2:4"]
    assert len(casts) == 6 and all(f.types(n)[0].elem == "bf16" for n in casts)
    assert all(ops_by_name(module)[n]["attrs"]["mp.kernel"] == SPARSE_2_4
               for n in WEIGHT_MATMULS)


def test_lowered_outputs_equal_dense_execution_of_the_pruned_weights(transformer):
    """The lowered module runs its six weight matmuls on the 2:4 kernel and equals the same
    bf16 plan run densely on the pruned weights, up to fp32 reassociation inside each product
    (which can flip a bf16 rounding or two downstream)."""
    out = lowered(transformer, "sparsify,assign-precision,lower-sparse{target=h100}")
    x = np.load(transformer.with_name("transformer_inputs.npz"))["x"]
    dense = parse(transformer.read_text().replace('"transformer.npz"', '"lowered.npz"'),
                  str(out))
    run_pipeline(dense, "assign-precision,insert-casts")
    want = Program(dense).run([x]).outputs[0]
    lowered_module = parse_file(out)
    materialize(lowered_module)  # the plan's casts, as `mplower run` adds them
    program = Program(lowered_module)
    sparse_steps = [s for s in program.steps if s.executed["kernel"] == SPARSE_2_4]
    assert len(sparse_steps) == 6
    assert all(s.reason is None for s in sparse_steps)
    got = program.run([x]).outputs[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=0.02)
    assert np.mean(got == want) > 0.9  # most outputs are bit-identical


# ---- kernels ---------------------------------------------------------------------------------

def test_compress_2_4_layout():
    # W (K=8, N=2); column 0 keeps K positions 1, 3 and 4, 6; column 1 keeps 0 only, then 7.
    w = np.zeros((8, 2), np.float32)
    w[[1, 3, 4, 6], 0] = [1, 2, 3, 4]
    w[[0, 7], 1] = [5, 6]
    values, indices = compress_2_4(w)
    assert values.tolist() == [[1, 2, 3, 4], [5, 0, 0, 6]]
    # Two 2-bit positions per group, group 0 in the low nibble: (1, 3) -> 0b1101, (0, 2) ->
    # 0b1000 for column 0; (0, 1) -> 0b0100 and (0, 3) -> 0b1100 for column 1 (zeros fill the
    # lowest free positions).
    assert indices.tolist() == [[0b1000_1101], [0b1100_0100]]
    with pytest.raises(ValueError, match="output 0 has a group of four with more than two"):
        compress_2_4(np.ones((4, 1), np.float32))


@pytest.mark.parametrize("x_shape,k,n", [((16, 64), 64, 64), ((3, 7), 7, 5), ((2, 3, 12), 12, 33),
                                         ((10,), 10, 4), ((70, 130), 130, 70)])
def test_kernels_equal_the_dense_matmul(x_shape, k, n):
    rng = np.random.default_rng(k * n)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w24 = prune_structured(w, "2:4", 0)
    got = matmul_2_4(x, *compress_2_4(w24), shape=(k, n))
    np.testing.assert_allclose(got, x @ w24, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    ws = prune_magnitude(w, 0.9)
    got = spmm_csr(x, *to_csr(ws), n=n)
    np.testing.assert_allclose(got, x @ ws, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_parallel_kernels_equal_the_serial_ones(monkeypatch):
    from mplower.backend import sparse

    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 36)).astype(np.float32)
    w = prune_structured(rng.standard_normal((36, 21)).astype(np.float32), "2:4", 0)
    parts_24, parts_csr = compress_2_4(w), to_csr(w)
    serial = matmul_2_4(x, *parts_24, shape=w.shape), spmm_csr(x, *parts_csr, n=21)
    monkeypatch.setattr(sparse, "PARALLEL_MIN_WORK", 0)
    assert np.array_equal(matmul_2_4(x, *parts_24, shape=w.shape), serial[0])
    assert np.array_equal(spmm_csr(x, *parts_csr, n=21), serial[1])
    assert np.array_equal(spmm_csr_t(*parts_csr, np.ascontiguousarray(x.T)), serial[1].T)


def test_csr_is_scipys_csr_of_the_transposed_weight():
    scipy_sparse = pytest.importorskip("scipy.sparse")
    w = prune_magnitude(np.random.default_rng(1).standard_normal((50, 30)), 0.8)
    data, indices, indptr = to_csr(w)
    a = scipy_sparse.csr_matrix(w.T)
    assert np.array_equal(a.indptr, indptr) and np.array_equal(a.indices, indices)
    assert np.array_equal(a.data.astype(np.float32), data)
    xt = np.random.default_rng(2).standard_normal((50, 9)).astype(np.float32)
    np.testing.assert_allclose(spmm_csr_t(data, indices, indptr, xt), a @ xt, rtol=1e-5,
                               atol=1e-5)


def test_sparse_runner_compresses_once_and_declines_what_it_cannot_run():
    x_t, w_t, out_t = tensor((4, 8), "bf16"), tensor((8, 8), "bf16", "2:4"), tensor((4, 8), "bf16")
    runner = sparse_runner(SPARSE_2_4, x_t, w_t, out_t)
    w = prune_structured(np.arange(64, dtype=np.float32).reshape(8, 8), "2:4", 0)
    x = np.ones((4, 8), np.float32)
    assert np.array_equal(runner([x, w]), x @ w)
    parts = runner.parts
    runner([2 * x, w])
    assert runner.parts is parts  # the same weight array: no second compression
    with pytest.raises(ValueError, match="1:2 pattern"):
        sparse_runner(SPARSE_1_2, x_t, w_t, out_t)([x, w])
    assert sparse_runner(DENSE, x_t, w_t, out_t) is None
    assert sparse_runner(CSR, tensor((4, 8), "i8"), tensor((8, 8), "i8"), tensor((4, 8), "i32")) \
        is None


# ---- the reality check -----------------------------------------------------------------------

def test_reality_check_numbers_for_a_2_4_bf16_weight():
    w = prune_structured(np.random.default_rng(0).standard_normal((64, 64)), "2:4", 0)
    ins, outs = [tensor((16, 64), "bf16"), tensor((64, 64), "bf16")], [tensor((16, 64), "bf16")]
    moved = other_bytes("mp.matmul", ins, outs, "bf16", "f32")
    assert moved == 2 * 16 * 64 * 2
    check = reality_check(SPARSE_2_4, w, 16, "bf16", load_target("h100"), 2 * 16 * 64 * 64,
                          moved)
    assert check.nominal_sparsity == 0.5
    assert (check.value_bytes, check.metadata_bytes, check.dense_bytes) == (4096, 512, 8192)
    assert check.metadata_overhead == 0.125
    assert 1.0 < check.modeled_speedup < 1.001  # launch-bound: the 5 us overhead dominates
    assert check.measured_dense_s > 0 and check.measured_sparse_s > 0
    assert check.measured_speedup == check.measured_dense_s / check.measured_sparse_s
    assert check.conversion_s > 0


def test_report_has_a_sparse_section(transformer, cli):
    out = lowered(transformer, "sparsify,assign-precision,lower-sparse{target=h100}")
    r = cli("report", out, "--format", "json")
    assert r.rc == 0, r.err
    sheet = json.loads(r.out)
    sparse = sheet["sparse"]
    # The two attention matmuls count as dense too (before: 6 considered, 0 dense).
    assert (sparse["considered"], sparse["sparse_ops"], sparse["dense_fallbacks"]) == (8, 6, 2)
    assert sparse["kernels"] == {SPARSE_2_4: 6} and sparse["fallback_rate"] == 0.25
    assert sparse["reasons"] == {NO_CONSTANT_WEIGHT: 2}
    q = next(e for e in sparse["ops"] if e["name"] == "%q_proj")
    assert q["metadata_bytes"] == 512 and q["nominal_sparsity"] == 0.5
    assert q["measured_speedup"] > 0 and q["modeled_speedup"] > 1
    # The row carries the time of the fused kernel it anchors (issue 13: the fused cost model
    # prices the plan; the reality check's per-op roofline stays in the sparse section).
    row = next(r for r in sheet["ops"] if r["name"] == "%q_proj")
    group = sheet["groups"][row["group"]]
    assert group["anchor"] == "%q_proj" and row["modeled_time_s"] == group["time_s"]
    table = cli("report", out).out
    assert ("sparse: 8 matmul/conv ops, 6 on sparse kernels (sparse_2_4: 6), 2 dense (25.0%) - "
            "no-constant-weight: 2") in table
    assert "%ff2_proj  sparse_2_4  50.0%     2048 B (12.5% of values)" in table


def test_report_counts_dense_fallbacks_by_reason(transformer, cli):
    out = lowered(transformer,
                  "sparsify,assign-precision{policy=fp32},lower-sparse{target=h100}")
    sparse = json.loads(cli("report", out, "--format", "json").out)["sparse"]
    assert sparse["dense_fallbacks"] == 8 and sparse["fallback_rate"] == 1.0
    assert sparse["reasons"] == {NO_CONSTANT_WEIGHT: 2, DTYPE_UNSUPPORTED: 6}
    md = cli("report", out, "--format", "markdown").out
    assert "8 dense (100.0%) - dtype-unsupported: 6, no-constant-weight: 2" in md


def test_report_without_sparse_decisions_has_no_sparse_section(cli):
    sheet = json.loads(cli("report", EXAMPLES / "mlp.ir", "--format", "json").out)
    assert "sparse" not in sheet


def test_1_2_encoding_parses_and_casts_keep_encodings():
    module = parse("""func.func @main(%x: tensor<2x4xbf16>, %w: tensor<4x4xf32>)
        -> tensor<2x4xbf16> {
      %e = mp.sparse_encode %w : (tensor<4x4xf32>) -> tensor<4x4xf32, "1:2">
      %c = mp.cast %e : (tensor<4x4xf32, "1:2">) -> tensor<4x4xbf16, "1:2">
      %0 = mp.matmul %x, %c : (tensor<2x4xbf16>, tensor<4x4xbf16, "1:2">) -> tensor<2x4xbf16>
      return %0 : tensor<2x4xbf16>
    }""")
    verify(module)
    assert 'tensor<4x4xbf16, "1:2">' in print_module(module)
