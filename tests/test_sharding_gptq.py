"""GPTQ's and AWQ's layer statistics sharded over calibration batches on dask.distributed
(issue 35, item 3): the lowered module is byte-identical with 0, 1 and 2 workers.

The clusters are in-process (LocalCluster with processes=False: worker threads), as in
tests/test_sharding.py, made once for the module.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("dask.distributed")

from mplower.backend.executor import reference_runner
from mplower.ir.parser import parse_file
from mplower.ir.printer import print_module
from mplower.lowering.layer_stats import collect_layer_stats
from mplower.lowering.sharding import SERIAL, DaskShards
from mplower.numerics.weight_only import LayerStats
from mplower.pass_manager import PassContext, PassManager, load_passes, parse_pipeline

K, N, BATCH = 32, 24, 16


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


def _model(folder: Path) -> Path:
    """A layer norm read by two layers (AWQ gives them one scale) and a third layer after a
    relu; 5 whole batches of samples and a partial sixth, heavy-tailed per channel so that the
    float64 sums' rounding depends on the order they are added in."""
    rng = np.random.default_rng(35)
    x = (rng.standard_normal((5 * BATCH + 7, K)) * np.exp(2 * rng.standard_normal(K)))
    np.savez(folder / "calib.npz", x=x.astype(np.float32))
    w = {"w1": rng.standard_normal((K, N)) * 0.1, "w2": rng.standard_normal((K, 8)) * 0.1,
         "w3": rng.standard_normal((N, 8)) * 0.1, "g": 1 + rng.random(K), "b": rng.random(K)}
    np.savez(folder / "w.npz", **{k: v.astype(np.float32) for k, v in w.items()})
    t, tn = f"tensor<{BATCH}x{K}xf32>", f"tensor<{BATCH}x{N}xf32>"
    t8 = f"tensor<{BATCH}x8xf32>"
    path = folder / "m.ir"
    path.write_text(
        'module attributes {mp.weights = "w.npz"} {\n'
        f"  func.func @main(%x: {t}) -> ({t8}, {t8}) {{\n"
        f'    %g = mp.constant {{name = "g"}} : () -> tensor<{K}xf32>\n'
        f'    %b = mp.constant {{name = "b"}} : () -> tensor<{K}xf32>\n'
        f'    %w1 = mp.constant {{name = "w1"}} : () -> tensor<{K}x{N}xf32>\n'
        f'    %w2 = mp.constant {{name = "w2"}} : () -> tensor<{K}x8xf32>\n'
        f'    %w3 = mp.constant {{name = "w3"}} : () -> tensor<{N}x8xf32>\n'
        f"    %n = mp.layer_norm %x, %g, %b {{axis = -1, epsilon = 1.0e-05}} : "
        f"({t}, tensor<{K}xf32>, tensor<{K}xf32>) -> {t}\n"
        f"    %0 = mp.matmul %n, %w1 : ({t}, tensor<{K}x{N}xf32>) -> {tn}\n"
        f"    %1 = mp.matmul %n, %w2 : ({t}, tensor<{K}x8xf32>) -> {t8}\n"
        f"    %2 = mp.relu %0 : ({tn}) -> {tn}\n"
        f"    %3 = mp.matmul %2, %w3 : ({tn}, tensor<{N}x8xf32>) -> {t8}\n"
        f"    return %1, %3 : {t8}, {t8}\n  }}\n}}\n")
    return path


_THREADS: list[str] = []


def _recording_runner(module, func, weights):
    """The backend's reference, noting the thread that built it (a worker's, or this one)."""
    _THREADS.append(threading.current_thread().name)
    return reference_runner(module, func, weights)


def _lower(path: Path, executor, options: str) -> str:
    load_passes()
    module = parse_file(path)
    PassManager(parse_pipeline(
        f"quantize{{scheme=w4a16 group=8 data={path.parent / 'calib.npz'} {options}}}")).run(
        module, PassContext(runner=_recording_runner, executor=executor))
    return print_module(module)


@pytest.mark.determinism
@pytest.mark.parametrize("options", ["method=gptq sym=false act_order=true",
                                     "method=awq sym=false"])
def test_weight_only_module_is_byte_identical_with_0_1_and_2_workers(executors, tmp_path,
                                                                     options):
    path = _model(tmp_path)
    outs, threads = {}, {}
    for w in (0, 1, 2):
        _THREADS.clear()
        outs[w] = _lower(path, executors[w], options)
        threads[w] = set(_THREADS)
    assert outs[0] == outs[1] == outs[2]
    method = options.split()[0].split("=")[1]
    assert outs[0].count(method) >= 3  # every layer took the algorithm, with its error
    assert outs[0].count("mp.weight_error") == 3
    # Serially the reference ran here; with workers, only in the workers' threads.
    assert threads[0] == {threading.current_thread().name}
    assert threads[1] and threading.current_thread().name not in threads[1] | threads[2]


@pytest.mark.determinism
def test_sharded_sums_are_the_serial_loops_to_the_bit(executors, tmp_path):
    """One shard per batch, merged in batch order, adds each batch's sums into the total as
    one LayerStats does batch by batch: the bits of the serial run, with the padded last
    batch's samples alone."""
    path = _model(tmp_path)
    module = parse_file(path)
    f = module.function(None)
    x = np.load(tmp_path / "calib.npz")["x"]
    padded = np.concatenate([x, np.repeat(x[-1:], 6 * BATCH - len(x), 0)])
    batches = [[b] for b in padded.reshape(6, BATCH, K)]
    ln = next(n for n in f.ops() if f.op(n) == "mp.layer_norm")
    got = {w: collect_layer_stats(module, None, [(ln, 0)], batches, len(x) - 5 * BATCH,
                                  reference_runner, str(tmp_path / "w.npz"),
                                  executors[w])[(ln, 0)] for w in (0, 2)}
    # The serial loop: each batch's layer-norm output, as the fp32 reference computes it,
    # added to one LayerStats in batch order (the last batch's 7 samples alone).
    reference = reference_runner(module, None, str(tmp_path / "w.npz"))
    outs: list[np.ndarray] = []
    for b in batches:
        reference(b, lambda v, y: outs.append(y.copy()) if v == (ln, 0) else None)
    want = LayerStats.zeros(K)
    for i, y in enumerate(outs):
        want.add(y if i < 5 else y[:len(x) - 5 * BATCH])
    for s in got.values():
        assert s.rows == want.rows == len(x)
        assert s.hessian.tobytes() == want.hessian.tobytes()
        assert s.abs_sum.tobytes() == want.abs_sum.tobytes()
    # ... and the order matters: all rows added at once round otherwise.
    one = LayerStats.zeros(K)
    one.add(np.concatenate([outs[0], *outs[1:5], outs[5][:len(x) - 5 * BATCH]]))
    assert one.hessian.tobytes() != want.hessian.tobytes()
