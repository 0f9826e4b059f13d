"""Work over samples sharded on dask.distributed (issue 35, item 3): calibration and a
Hessian-like float64 sum give the same bits with 0, 1 and 2 workers.

The clusters are in-process (LocalCluster with processes=False: worker threads, no start-up of
interpreters), made once for the module; `mplower opt --workers N` starts real worker
processes, which the CLI test below does not wait for (it uses `--scheduler`).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("dask.distributed")

from mplower.backend.executor import reference_runner
from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.ir.parser import parse
from mplower.ir.printer import print_module
from mplower.lowering.sharding import (
    SERIAL,
    DaskShards,
    reduce_shards,
    shard_ranges,
    sum_over_shards,
)
from mplower.pass_manager import PassContext, PassManager, load_passes, parse_pipeline

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def executors():
    """0, 1 and 2 workers: this process, and two in-process clusters (started once)."""
    from dask.distributed import Client, LocalCluster

    clusters = [LocalCluster(n_workers=n, threads_per_worker=1, processes=False,
                             dashboard_address=":0") for n in (1, 2)]
    clients = [Client(c) for c in clusters]
    yield {0: SERIAL, 1: DaskShards(client=clients[0]), 2: DaskShards(client=clients[1])}
    for client, cluster in zip(clients, clusters):
        client.close()
        cluster.close()


# ---- the reduction --------------------------------------------------------------------------

def _label(_shared: None, i: int) -> str:
    return str(i)


def _join(a: str, b: str) -> str:
    return f"({a}+{b})"


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_partials_meet_in_a_tree_the_shard_count_alone_fixes(executors, workers):
    ex = executors[workers]
    assert reduce_shards(ex, _label, None, range(5), _join) == "(((0+1)+(2+3))+4)"
    assert reduce_shards(ex, _label, None, range(7), _join) == "(((0+1)+(2+3))+((4+5)+6))"
    assert reduce_shards(ex, _label, None, range(1), _join) == "0"
    assert reduce_shards(ex, _label, None, range(4), _join, tree=False) == "(((0+1)+2)+3)"


def test_shard_ranges_cut_the_items_whatever_runs_them():
    assert shard_ranges(10, 4) == [range(4), range(4, 8), range(8, 10)]
    assert shard_ranges(0, 4) == []
    with pytest.raises(ValueError):
        shard_ranges(3, 0)


def _fails_on_3_and_5(_shared: None, i: int) -> int:
    if i in (3, 5):
        raise DiagnosticError.at(Location("calib.npz", i, 1), f"shard {i} is bad")
    return i


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("tree", [True, False])
def test_a_failing_shard_raises_its_diagnostic_the_first_one(executors, workers, tree):
    with pytest.raises(DiagnosticError) as e:
        reduce_shards(executors[workers], _fails_on_3_and_5, None, range(8),
                      lambda a, b: a + b, tree=tree)
    d = e.value.diagnostics[0]
    assert (d.message, d.loc.file, d.loc.line) == ("shard 3 is bad", "calib.npz", 3)


# ---- a Hessian-like sum ---------------------------------------------------------------------

def _gram(samples: np.ndarray, rows: range) -> np.ndarray:
    """2 x^T x over the shard's samples, one outer product at a time (no BLAS reduction whose
    order a library picks): the fixed order within a shard."""
    h = np.zeros((samples.shape[1], samples.shape[1]))
    for i in rows:
        x = samples[i].astype(np.float64)
        h += 2.0 * np.multiply.outer(x, x)
    return h


@pytest.mark.determinism
def test_sum_over_shards_gives_the_same_float64_bits_with_0_1_and_2_workers(executors):
    # Heavy-tailed activations, so the float64 sum's rounding depends on its order.
    rng = np.random.default_rng(35)
    samples = (rng.standard_normal((96, 12)) * np.exp(3 * rng.standard_normal(12))).astype(
        np.float32)
    shards = shard_ranges(len(samples), 8)
    done: list[int] = []
    sums = {w: sum_over_shards(executors[w], _gram, samples, shards,
                               done=done.append if w == 2 else None) for w in (0, 1, 2)}
    assert sums[0].dtype == np.float64
    assert sums[0].tobytes() == sums[1].tobytes() == sums[2].tobytes()
    assert sorted(done) == list(range(len(shards)))
    # The tree is what makes it so: the same partials added left to right round otherwise,
    # and the sum is the Gram matrix (to rounding).
    fold = reduce_shards(SERIAL, _gram, samples, shards, np.add, tree=False)
    assert fold.tobytes() != sums[0].tobytes()
    x = samples.astype(np.float64)
    np.testing.assert_allclose(sums[0], 2.0 * x.T @ x, rtol=1e-12)


# ---- calibration ----------------------------------------------------------------------------

def test_merged_shard_statistics_equal_one_pass_over_all_the_samples():
    """What makes calibration exact on workers: statistics of shards, merged, are those of one
    pass, although the shards' histogram grids differ (each widens to its own largest value)."""
    from mplower.lowering.calibration import TensorStats

    rng = np.random.default_rng(8)
    shards = [rng.standard_normal((16, 8)).astype(np.float32) * scale
              for scale in (0.01, 3.0, 0.2, 900.0, 1.0)]
    shards[2][0, 0] = -0.0
    one = TensorStats(256)
    one.add(np.concatenate(shards), channel_axis=1)
    parts = []
    for x in shards:
        parts.append(TensorStats(256))
        parts[-1].add(x, channel_axis=1)
    merged = parts[0]
    for p in parts[1:]:
        merged.merge(p)
    assert (merged.count, merged.min, merged.max, merged.side_exp) == \
        (one.count, one.min, one.max, one.side_exp)
    for field in ("hist", "side_exponents", "channel_max", "channel_min", "nonfinite"):
        assert getattr(merged, field).tobytes() == getattr(one, field).tobytes(), field


_THREADS: list[str] = []


def _recording_runner(module, func, weights):
    """The backend's reference, noting the thread that built it (a worker's, or this one)."""
    _THREADS.append(threading.current_thread().name)
    return reference_runner(module, func, weights)


def _lower(folder: Path, executor, method: str) -> str:
    """The digits MLP calibrated on 6 batches of 32 (one shard each) and lowered to int8,
    printed."""
    load_passes()
    module = parse((folder / "mlp.ir").read_text(), str(folder / "mlp.ir"))
    module.path = str(folder / "mlp.ir")
    out = folder / "lowered.ir"
    sheet = folder / "int8-all.toml"  # the built-in int8 sheet, first and last layer too
    sheet.write_text((ROOT / "mplower/policies/int8.toml").read_text().replace(
        "keep_first_last = true", "keep_first_last = false"))
    pipeline = (f"calibrate{{data={folder / 'calib.npz'} method={method} group=1 bins=256}},"
                f"assign-precision{{policy={sheet}}},legalize{{target=generic}},quantize,"
                "insert-casts")
    PassManager(parse_pipeline(pipeline)).run(
        module, PassContext(output_path=str(out), runner=_recording_runner, executor=executor))
    return print_module(module)


@pytest.mark.determinism
@pytest.mark.parametrize("method", ["minmax", "entropy"])
def test_lowered_module_is_byte_identical_with_0_1_and_2_workers(executors, tmp_path, method):
    for name in ("mlp.ir", "mlp.npz"):
        shutil.copy(ROOT / "ir_examples" / name, tmp_path / name)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 32, 64)).astype(np.float32) * rng.uniform(0.1, 8, 64)
    x[4, 7, 3] = 60.0  # one outlier, in one shard: every merge must keep it
    np.savez(tmp_path / "calib.npz", x=x)
    outs, threads = {}, {}
    for w in (0, 1, 2):
        _THREADS.clear()
        outs[w] = _lower(tmp_path, executors[w], method)
        threads[w] = set(_THREADS)
    assert outs[0] == outs[1] == outs[2]
    assert "mp.range" in outs[0] and "mp.quantize" in outs[0]
    # x and the relu at the scales their calibrated ranges give, and both weights
    assert outs[0].count("mp.quantize") == 4
    # Serially the reference ran here; with workers, only in the workers' threads.
    assert threads[0] == {threading.current_thread().name}
    assert threading.current_thread().name not in threads[1] | threads[2]


@pytest.mark.parametrize("workers", [0, 2])
def test_nan_in_one_calibration_batch_is_the_same_located_error_on_workers(executors, tmp_path,
                                                                         workers):
    for name in ("mlp.ir", "mlp.npz"):
        shutil.copy(ROOT / "ir_examples" / name, tmp_path / name)
    x = np.random.default_rng(5).standard_normal((5, 32, 64)).astype(np.float32)
    x[3, 2, 1] = np.nan
    np.savez(tmp_path / "calib.npz", x=x)
    with pytest.raises(DiagnosticError) as e:
        _lower(tmp_path, executors[workers], "minmax")
    d = e.value.diagnostics[0]
    assert d.message == ("calibration: argument %x: 1 values are NaN (an infinity, such as an "
                         "attention mask's -inf, is taken as it is)")
    assert (Path(d.loc.file).name, d.loc.line) == ("mlp.ir", 5)


def test_opt_scheduler_flag_calibrates_on_the_cluster_and_prints_the_serial_module(
        executors, tmp_path, capsys):
    from mplower.cli.main import main

    for name in ("mlp.ir", "mlp.npz"):
        shutil.copy(ROOT / "ir_examples" / name, tmp_path / name)
    x = np.random.default_rng(4).standard_normal((4, 32, 64)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    ir = str(tmp_path / "mlp.ir")
    pipeline = f"--pass=calibrate{{data={tmp_path / 'calib.npz'} group=1 method=percentile}}"
    assert main(["opt", ir, pipeline]) == 0
    serial = capsys.readouterr().out
    address = executors[2].client.scheduler.address
    assert main(["opt", ir, pipeline, "--scheduler", address]) == 0
    assert capsys.readouterr().out == serial
    assert "mp.calib = \"percentile\"" in serial


def test_opt_workers_flag_is_checked_and_starts_no_cluster_for_passes_that_need_none(
        monkeypatch, capsys):
    from mplower.cli.main import main
    from mplower.lowering import sharding

    assert main(["opt", str(ROOT / "ir_examples/mlp.ir"), "--workers", "-1"]) == 2
    assert "--workers must be 0" in capsys.readouterr().err

    def no_cluster(workers, scheduler):  # dask is imported here, and only here
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(sharding, "connect", no_cluster)
    assert main(["opt", str(ROOT / "ir_examples/mlp.ir"), "--pass=cse", "--workers", "2",
                 "-o", os.devnull]) == 0


def test_opt_scheduler_that_is_no_address_is_a_located_error_before_any_pass(tmp_path, capsys):
    from mplower.cli.main import main

    out = tmp_path / "out.ir"
    assert main(["opt", str(ROOT / "ir_examples/mlp.ir"), "--pass=cse", "--scheduler",
                 "nonsense", "-o", str(out)]) == 1
    assert capsys.readouterr().err == ("nonsense: error: cannot connect to the dask scheduler: "
                                       "missing port number in address 'nonsense'\n")
    assert not out.exists()


# ---- evaluation -----------------------------------------------------------------------------

def test_run_batch_inputs_reports_the_same_bytes_on_a_cluster(executors, tmp_path, capsys):
    """`run --batch-inputs`: 3 whole batches of 32 on the workers, the partial last one of 4
    here; the report (per-op counts and drift over all 100 rows) and the outputs match."""
    from mplower.cli.main import main

    for name in ("mlp.ir", "mlp.npz"):
        shutil.copy(ROOT / "ir_examples" / name, tmp_path / name)
    assert main(["opt", str(tmp_path / "mlp.ir"), "--pass=assign-precision{policy=fp16}",
                 "-o", str(tmp_path / "fp16.ir")]) == 0
    rows = np.random.default_rng(6).standard_normal((100, 64)).astype(np.float32) * 40
    np.savez(tmp_path / "rows.npz", x=rows)
    outs = {}
    for where in ([], ["--scheduler", executors[2].client.scheduler.address]):
        save = tmp_path / f"out{len(where)}.npz"
        capsys.readouterr()
        assert main(["run", str(tmp_path / "fp16.ir"), "--inputs", str(tmp_path / "rows.npz"),
                     "--batch-inputs", "--report", "-", "--save-outputs", str(save),
                     *where]) == 0
        outs[len(where)] = (capsys.readouterr().out, np.load(save)["output_0"])
    assert outs[0][0] == outs[2][0]
    assert outs[0][1].tobytes() == outs[2][1].tobytes() and outs[0][1].shape == (100, 10)
    report = json.loads(outs[0][0])
    assert report["summary"]["output_rel_l2"] > 0 and report["summary"]["underflow"] > 0


def test_run_workers_without_batch_inputs_is_a_usage_error(capsys):
    from mplower.cli.main import main

    assert main(["run", str(ROOT / "ir_examples/mlp.ir"), "--workers", "2"]) == 2
    assert "give --batch-inputs" in capsys.readouterr().err
