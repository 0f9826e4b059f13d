"""set-batch: the digits MLP at other batch sizes verifies and computes every sample's output
with the same bits as the model as written (batch grouping never changes bits); the values are
also checked against the MLP in numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits

from mplower.backend.executor import Program
from mplower.ir.parser import parse_file
from mplower.ir.verifier import verify
from mplower.pass_manager import PassManager, parse_pipeline
from mplower.train.trainer import predict

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "ir_examples" / "mlp.ir"


def numpy_mlp(x: np.ndarray) -> np.ndarray:
    with np.load(ROOT / "ir_examples" / "mlp.npz") as w:
        h = np.maximum(x @ w["fc1.weight"] + w["fc1.bias"], 0)
        z = h @ w["fc2.weight"] + w["fc2.bias"]
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_set_batch_mlp_gives_every_sample_the_bits_of_the_model_as_written(policy):
    x = load_digits().data[:96].astype(np.float32)  # 3 batches of 32, 6 of 16, 1.5 of 64
    lower = [] if policy == "fp32" else [f"assign-precision{{policy={policy}}}", "insert-casts"]
    written = parse_file(MLP)
    PassManager(parse_pipeline(",".join(lower))).run(written)
    expected = predict(Program(written), x)
    np.testing.assert_allclose(expected, numpy_mlp(x), rtol=0, atol=1e-5 if policy == "fp32"
                               else 3e-2)
    for size in (16, 64, 1):
        module = parse_file(MLP)
        PassManager(parse_pipeline(",".join([f"set-batch{{size={size}}}", *lower]))).run(module)
        verify(module)
        f = module.function()
        assert [f.type_of((a, 0)).shape for a in f.args] == [(size, 64)]
        assert [t.shape for t in f.result_types] == [(size, 10)]
        got = predict(Program(module), x)
        assert got.view(np.uint32).tolist() == expected.view(np.uint32).tolist(), size
