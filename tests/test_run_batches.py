"""`mplower run --batch-inputs` (issue 33, section 3): --inputs with more rows than the batch runs
batch by batch, the last partial batch at its own size, and the outputs, the report (drift,
counts, per-op figures, top-1) and the guardrail verdict are those of one run over all rows: the
same module retyped by set-batch to every row is the independent reference, and the outputs are
also checked against numpy. Without the flag, the refusal names the flags that help; a model
that mixes the batch axis is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def lowered(cli, tmp_path) -> Path:
    for name in ("mlp.ir", "mlp.npz"):
        shutil.copy(ROOT / "ir_examples" / name, tmp_path / name)
    out = tmp_path / "low.ir"
    r = cli("opt", tmp_path / "mlp.ir", "--pass-pipeline=assign-precision{policy=bf16},"
            "insert-casts", "-o", out)
    assert r.rc == 0, r.err
    return out


def _rows(tmp_path: Path, n: int) -> Path:
    x = np.random.default_rng(5).uniform(0, 16, (n, 64)).astype(np.float32)
    path = tmp_path / f"rows{n}.npz"
    np.savez(path, x=x)
    return path


def test_batch_inputs_equal_one_run_over_all_rows(cli, tmp_path, lowered):
    rows = _rows(tmp_path, 42)  # one batch of 32 and one of 10
    big = tmp_path / "big.ir"
    assert cli("opt", lowered, "--pass=set-batch{size=42}", "-o", big).rc == 0
    a = cli("run", lowered, "--inputs", rows, "--batch-inputs", "--save-outputs",
            tmp_path / "a.npz", "--report", tmp_path / "a.json", "--guardrail",
            "max_rel_l2=0.01", "--check")
    b = cli("run", big, "--inputs", rows, "--save-outputs", tmp_path / "b.npz", "--report",
            tmp_path / "b.json", "--guardrail", "max_rel_l2=0.01", "--check")
    assert a.rc == b.rc == 0, a.err + b.err
    ya, yb = np.load(tmp_path / "a.npz")["output_0"], np.load(tmp_path / "b.npz")["output_0"]
    assert ya.shape == (42, 10) and np.array_equal(ya, yb)
    ra, rb = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    for key in ("output_rel_l2", "output_max_abs", "sqnr_db", "top1_agreement", "overflow",
                "underflow", "nan", "overflow_rate", "verdict"):
        assert ra["summary"][key] == rb["summary"][key], key
    assert ra["summary"]["guardrails"] == rb["summary"]["guardrails"]
    ops_b = {o["name"]: o for o in rb["ops"]}
    for o in ra["ops"]:
        for key in ("rel_l2", "max_abs", "overflow", "underflow", "nan"):
            assert o[key] == ops_b[o["name"]][key], (o["name"], key)
    # numpy over all 42 rows: bf16 compute stays close to the float64 MLP.
    w = np.load(tmp_path / "mlp.npz")
    x = np.load(rows)["x"].astype(np.float64)
    z = np.maximum(x @ w["fc1.weight"] + w["fc1.bias"], 0) @ w["fc2.weight"] + w["fc2.bias"]
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    assert np.abs(ya - p).max() < 0.02


def test_without_the_flag_the_refusal_names_the_flags_that_help(cli, tmp_path, lowered):
    r = cli("run", lowered, "--inputs", _rows(tmp_path, 42))
    assert r.rc == 1
    assert "has shape [42, 64] but the function takes [32, 64]; `mplower run " \
           "--batch-inputs` runs its rows batch by batch, or retype the model with " \
           "set-batch{size=42}" in r.err


def test_batch_inputs_refuses_a_model_that_mixes_the_batch_axis(cli, tmp_path):
    (tmp_path / "mix.ir").write_text("""func.func @main(%x: tensor<4x3xf32>) -> tensor<1x3xf32> {
  %0 = mp.reduce_mean %x {axes = [0], keepdims = true} : (tensor<4x3xf32>) -> tensor<1x3xf32>
  return %0 : tensor<1x3xf32>
}
""")
    np.savez(tmp_path / "x.npz", x=np.ones((6, 3), np.float32))
    r = cli("run", tmp_path / "mix.ir", "--inputs", tmp_path / "x.npz", "--batch-inputs")
    assert r.rc == 1
    first = r.err.splitlines()[0]
    assert first.startswith(f"{tmp_path / 'mix.ir'}:1:")
    assert "--batch-inputs: @main mixes the rows of a batch" in first
    assert "Traceback" not in r.err


def test_batch_inputs_usage_errors(cli, tmp_path, lowered):
    r = cli("run", lowered, "--batch-inputs")
    assert r.rc == 2 and "--batch-inputs needs --inputs" in r.err
    r = cli("run", lowered, "--inputs", _rows(tmp_path, 40), "--batch-inputs", "--bisect",
            "--guardrail", "max_rel_l2=0.01")
    assert r.rc == 2 and "--bisect runs one batch" in r.err
