"""Sharded calibration and evaluation on worker *processes* (issue 35, item 3): what the
in-process clusters of tests/test_sharding.py cannot show, that every task and the state it
shares pickle (a RunResult's compiled steps do not, and are not sent) and that the workers
compute the same bytes. One LocalCluster of two processes serves the module's one test.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("dask.distributed")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.determinism
def test_calibrate_and_run_batch_inputs_on_worker_processes_match_the_serial_bytes(
        tmp_path, capsys, monkeypatch):
    from dask.distributed import LocalCluster

    from mplower.cli.main import main

    monkeypatch.chdir(tmp_path)  # the workers resolve the relative paths from here too
    for name in ("mlp.ir", "mlp.npz"):
        shutil.copy(ROOT / "ir_examples" / name, tmp_path / name)
    rng = np.random.default_rng(9)
    np.savez("calib.npz", x=rng.standard_normal((4, 32, 64)).astype(np.float32))
    np.savez("rows.npz", x=rng.standard_normal((70, 64)).astype(np.float32) * 30)
    calibrate = ["opt", "mlp.ir", "--pass=calibrate{data=calib.npz group=1 method=mse}"]
    run = ["run", "fp16.ir", "--inputs", "rows.npz", "--batch-inputs", "--report", "-"]
    assert main(["opt", "mlp.ir", "--pass=assign-precision{policy=fp16}", "-o", "fp16.ir"]) == 0
    serial = []
    for argv in (calibrate, run):
        capsys.readouterr()
        assert main(argv) == 0
        serial.append(capsys.readouterr().out)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster:
        for argv, expected in zip((calibrate, run), serial):
            capsys.readouterr()
            assert main([*argv, "--scheduler", cluster.scheduler_address]) == 0
            assert capsys.readouterr().out == expected
    assert 'mp.calib = "mse"' in serial[0] and '"underflow"' in serial[1]
