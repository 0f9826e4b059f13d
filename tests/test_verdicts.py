"""Verdicts that must not pass, and runs that must stop (issue items 3 and 5): a non-finite
output the reference lacks fails; an fp32 reference that overflows from finite inputs is an
error at the op; `[scaling] margin` takes only the values that work; `train` stops at a
non-finite loss or update and saves nothing; `--scheduler` fails within seconds, naming the
address.

Expected figures come from numpy on the same inputs (the reference's overflow, f16's range),
never from mplower's own code.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

# x + x overflows f32 for |x| above half its largest value (3.4e38); the softmax turns the
# infs into NaNs.
DOUBLE_IR = """func.func @main(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %y = mp.add %x, %x : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %z = mp.softmax %y {axis = 1} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  return %z : tensor<4x8xf32>
}
"""

# An f16 round trip: finite in the f32 reference, inf in the plan above 65504.
F16_IR = """func.func @main(%x: tensor<2x2xf32>) -> tensor<2x2xf32> {
  %h = mp.cast %x : (tensor<2x2xf32>) -> tensor<2x2xf16>
  %y = mp.cast %h : (tensor<2x2xf16>) -> tensor<2x2xf32>
  return %y : tensor<2x2xf32>
}
"""

# One GEMM large enough that the cost model gains from lowering it.
MATMUL_IR = """module @m attributes {mp.weights = "w.npz"} {
  func.func @main(%x: tensor<64x256xf32>) -> tensor<64x256xf32> {
    %w = mp.constant {name = "w"} : () -> tensor<256x256xf32>
    %h = mp.matmul %x, %w : (tensor<64x256xf32>, tensor<256x256xf32>) -> tensor<64x256xf32>
    return %h : tensor<64x256xf32>
  }
}
"""


def _near_f32_max(tmp_path: Path) -> tuple[Path, Path, np.ndarray]:
    """DOUBLE_IR and inputs whose odd columns are 3e38 (finite; doubled, beyond f32)."""
    x = np.ones((4, 8), np.float32)
    x[:, 1::2] = 3e38
    (tmp_path / "m.ir").write_text(DOUBLE_IR)
    np.savez(tmp_path / "in.npz", x=x)
    return tmp_path / "m.ir", tmp_path / "in.npz", x


def _clean_error(res, *fragments: str) -> None:
    assert res.rc == 1, (res.rc, res.out, res.err)
    assert "Traceback" not in res.err and "internal error" not in res.err
    for f in fragments:
        assert f in res.err, res.err


# ---- a non-finite output the reference lacks is never a pass ------------------------------


def test_plan_output_inf_where_the_reference_is_finite_fails_the_check(cli, tmp_path) -> None:
    x = np.array([[1.0, 1e5], [-1e6, 2.0]], np.float32)
    (tmp_path / "m.ir").write_text(F16_IR)
    np.savez(tmp_path / "in.npz", x=x)
    # An overflow-rate limit of 1 holds whatever overflows: before, this passed with 2 infs.
    res = cli("run", tmp_path / "m.ir", "--inputs", tmp_path / "in.npz", "--check",
              "--guardrail", "max_overflow_rate=1", "--report", tmp_path / "r.json")
    assert res.rc == 3, res.err
    expected = int(np.count_nonzero(np.abs(x) > 65504))  # f16's largest finite, by numpy
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(x)).sum() == expected == 2
    s = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert s["nonfinite_mismatch"] == expected
    assert s["guardrails"]["max_nonfinite_mismatch"] == {"limit": 0, "value": expected,
                                                          "ok": False}
    assert s["guardrails"]["max_overflow_rate"]["ok"] is True
    assert s["verdict"] == "fail"
    assert res.out.startswith("verdict: fail (")
    assert "max_nonfinite_mismatch 2 <= 0 FAILED" in res.out.splitlines()[0]


def test_report_validates_with_the_nonfinite_check(cli, tmp_path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from mplower.report.run import SCHEMA_PATH

    (tmp_path / "m.ir").write_text(F16_IR)
    np.savez(tmp_path / "in.npz", x=np.array([[1.0, 1e5], [-1.0, 2.0]], np.float32))
    res = cli("run", tmp_path / "m.ir", "--inputs", tmp_path / "in.npz", "--format", "json")
    assert res.rc == 0, res.err  # no --check: the report says fail, the exit code does not
    report = json.loads(res.out)
    jsonschema.validate(report, json.loads(SCHEMA_PATH.read_text()))
    assert report["summary"]["verdict"] == "fail"  # not `unchecked`: a NaN is never a pass


def test_tune_never_releases_a_plan_whose_outputs_overflow(cli, tmp_path) -> None:
    rng = np.random.default_rng(0)
    w = rng.uniform(100, 300, (256, 256)).astype(np.float32)
    x = rng.uniform(100, 300, (64, 256)).astype(np.float32)
    (tmp_path / "m.ir").write_text(MATMUL_IR)
    np.savez(tmp_path / "w.npz", w=w)
    np.savez(tmp_path / "d.npz", x=x)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert np.isfinite(ref).all() and ref.min() > 65504  # every f16 output is inf, by numpy
    res = cli("tune", tmp_path / "m.ir", "--target", "h100", "--data", tmp_path / "d.npz",
              "--formats", "f16", "--guardrail", "max_overflow_rate=1", "-o", tmp_path / "out")
    assert res.rc == 3, res.err
    assert not (tmp_path / "out" / "policy.toml").exists()
    packet = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert packet["chosen"] is None
    lowered = [c for c in packet["candidates"] if c["lowered_ops"]]
    assert lowered  # the f16 plans were evaluated, and each failed on the infs
    for c in lowered:
        assert c["verdict"] == "fail" and "max_nonfinite_mismatch" in c["failed"]
        assert c["guardrails"]["max_nonfinite_mismatch"]["value"] == ref.size


# ---- a reference that overflows from finite inputs is an error -----------------------------


def test_run_refuses_a_reference_that_overflows_from_finite_inputs(cli, tmp_path) -> None:
    model, inputs, x = _near_f32_max(tmp_path)
    with np.errstate(over="ignore"):
        doubled = x + x  # numpy's f32 reference of %y
    assert np.isfinite(x).all() and np.isinf(doubled).sum() == 16
    res = cli("run", model, "--inputs", inputs, "--check", "--guardrail", "max_rel_l2=0.01",
              "--report", tmp_path / "r.json")
    _clean_error(res, f"{model}:2:3: error: the fp32 reference is not finite: %y (mp.add) "
                      f"makes 16 inf or NaN values from finite operands, and the outputs "
                      f"hold 32")
    assert res.out == "" and not (tmp_path / "r.json").exists()


def test_a_minus_inf_mask_input_is_no_reference_overflow(cli, tmp_path) -> None:
    x = np.ones((4, 8), np.float32)
    x[0, 1] = -np.inf  # the user's own -inf reaches the output as the reference's NaN
    (tmp_path / "m.ir").write_text(DOUBLE_IR)
    np.savez(tmp_path / "in.npz", x=x)
    res = cli("run", tmp_path / "m.ir", "--inputs", tmp_path / "in.npz", "--format", "json")
    assert res.rc == 0, res.err
    s = json.loads(res.out)["summary"]
    assert s["nonfinite_mismatch"] == 0 and s["verdict"] == "unchecked"


def test_tune_refuses_a_baseline_that_overflows_from_finite_inputs(cli, tmp_path) -> None:
    model, inputs, _ = _near_f32_max(tmp_path)
    res = cli("tune", model, "--target", "h100", "--data", inputs, "-o", tmp_path / "out")
    _clean_error(res, "m.ir:2:3: error: the fp32 reference is not finite: %y (mp.add)")
    assert not (tmp_path / "out").exists()


# ---- [scaling] margin: the documented range is the range that works -------------------------


SHEET = """[policy]
compute = "f8E4M3FN"
allow = ["mp.matmul"]

[scaling]
recipe = "current"
margin = {margin}
"""


@pytest.mark.parametrize("margin", [32, 128, 100000])
def test_scaling_margin_beyond_31_is_refused_at_its_line(cli, tmp_path, margin) -> None:
    (tmp_path / "m.ir").write_text(MATMUL_IR)
    sheet = tmp_path / "s.toml"
    sheet.write_text(SHEET.format(margin=margin))
    out = tmp_path / "lo.ir"
    res = cli("opt", tmp_path / "m.ir",
              f"--pass-pipeline=assign-precision{{policy={sheet}}},insert-casts", "-o", out)
    _clean_error(res, f"{sheet}:7:1: error: 'scaling.margin' must be between 0 and 31, "
                      f"not {margin}")
    assert not out.exists()


def test_scale_recipes_margin_beyond_31_is_a_located_error(cli, tmp_path) -> None:
    (tmp_path / "m.ir").write_text(MATMUL_IR)
    res = cli("opt", tmp_path / "m.ir", "--pass-pipeline=assign-precision{policy=fp8},"
              "insert-casts,scale-recipes{margin=128}", "-o", tmp_path / "lo.ir")
    _clean_error(res, "error: scale-recipes: margin must be in 0..31, got 128")


SCALED_QUANT_IR = """func.func @main(%x: tensor<4xf32>) -> tensor<4xf8E4M3FN> {{
  %0 = mp.scaled_quant %x {{recipe = "current", margin = {margin}}} : (tensor<4xf32>) -> tensor<4xf8E4M3FN>
  return %0 : tensor<4xf8E4M3FN>
}}
"""


@pytest.mark.parametrize("margin", [32, 128, 100000, -1])
def test_scaled_quant_margin_outside_0_to_31_is_a_located_error(cli, tmp_path, margin) -> None:
    # Written on the op, not through a sheet: 100000 was an internal OverflowError, 128 NaN.
    (tmp_path / "m.ir").write_text(SCALED_QUANT_IR.format(margin=margin))
    res = cli("run", tmp_path / "m.ir", "--random-inputs", "--seed", "0")
    _clean_error(res, f"m.ir:2:3: error: 'mp.scaled_quant' attribute 'margin' must be between 0 "
                      f"and 31, not {margin}")


def test_largest_margin_gives_finite_outputs(cli, tmp_path) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 256)).astype(np.float32)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    (tmp_path / "m.ir").write_text(MATMUL_IR)
    np.savez(tmp_path / "w.npz", w=w)
    np.savez(tmp_path / "in.npz", x=x)
    sheet = tmp_path / "s.toml"
    sheet.write_text(SHEET.format(margin=31))
    lowered = tmp_path / "lo.ir"
    assert cli("opt", tmp_path / "m.ir",
               f"--pass-pipeline=assign-precision{{policy={sheet}}},insert-casts",
               "-o", lowered).rc == 0
    assert "mp.scaled_quant" in lowered.read_text()
    res = cli("run", lowered, "--inputs", tmp_path / "in.npz", "--format", "json",
              "--save-outputs", tmp_path / "y.npz")
    assert res.rc == 0, res.err
    y = np.load(tmp_path / "y.npz")["output_0"]
    # 448 / amax / 2^31 puts every |x| * scale below f8E4M3FN's smallest subnormal (2^-9):
    # every value flushes to zero, counted as underflow, and nothing is NaN.
    assert np.isfinite(y).all() and not y.any()
    s = json.loads(res.out)["summary"]
    assert s["nan"] == 0 and s["underflow"] >= x.size


# ---- train stops at what is not finite, and saves nothing ---------------------------------


LINEAR_IR = """module @m attributes {mp.weights = "w.npz"} {
  func.func @main(%x: tensor<4x3xf32>) -> tensor<4x2xf32> {
    %w = mp.constant {name = "w"} : () -> tensor<3x2xf32>
    %h = mp.matmul %x, %w : (tensor<4x3xf32>, tensor<3x2xf32>) -> tensor<4x2xf32>
    return %h : tensor<4x2xf32>
  }
}
"""


@pytest.fixture
def linear(tmp_path: Path) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """A linear model (batch 4), its weights and 16 samples of mse data in tmp_path."""
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((3, 2)).astype(np.float32),
              "x": rng.standard_normal((16, 3)).astype(np.float32),
              "y": rng.standard_normal((16, 2)).astype(np.float32)}
    (tmp_path / "m.ir").write_text(LINEAR_IR)
    np.savez(tmp_path / "w.npz", w=arrays["w"])
    np.savez(tmp_path / "d.npz", x=arrays["x"], y=arrays["y"])
    return tmp_path / "m.ir", tmp_path / "d.npz", arrays


def _train(cli, model: Path, data: Path, *flags: object):
    out = model.parent / "trained.ir"
    res = cli("train", model, "--data", data, "--loss", "mse", "--steps", 8, "-o", out,
              "--report", model.parent / "train.json", *flags)
    return res, out


def _nothing_written(folder: Path) -> None:
    assert not {"trained.ir", "trained.npz", "train.json"} & {p.name for p in folder.iterdir()}


def test_train_refuses_nan_in_the_data_before_any_step(cli, linear) -> None:
    model, _, arrays = linear
    x = arrays["x"].copy()
    x[5, 1] = np.nan
    np.savez(model.parent / "nan.npz", x=x, y=arrays["y"])
    res, _ = _train(cli, model, model.parent / "nan.npz")
    _clean_error(res, f"{model.parent / 'nan.npz'}: error: 'x' holds 1 inf or NaN value "
                      f"(in sample 5); training needs finite data")
    _nothing_written(model.parent)


def test_train_stops_at_the_step_whose_loss_overflows(cli, linear) -> None:
    model, data, a = linear
    # Step 0's SGD update with lr 1e30 (numpy, float64): the weights become ~1e30, so the next
    # batch's squared error is ~1e60, beyond f32 (its loss is inf), whichever samples it holds.
    x, y, w = (a[k].astype(np.float64) for k in ("x", "y", "w"))
    first = np.random.default_rng(0).permutation(16)[:4]  # the seeded batch order of step 0
    grad = 2 * x[first].T @ (x[first] @ w - y[first]) / y[first].size
    w1 = w - 1e30 * grad
    assert np.isfinite(np.float32(w1)).all()  # the update itself stays finite in f32
    with np.errstate(over="ignore"):
        assert all(np.isinf(np.float32(np.mean((x[i:i + 4] @ w1 - y[i:i + 4]) ** 2)))
                   for i in range(0, 16, 4))
    res, _ = _train(cli, model, data, "--optimizer", "sgd{lr=1e30}")
    _clean_error(res, "error: step 1 (of 8, counted from 0): the loss is inf: the forward "
                      "pass overflowed", "stopped there, nothing is written")
    _nothing_written(model.parent)


def test_train_without_dynamic_scaling_stops_at_inf_gradients(cli, linear) -> None:
    model, data, _ = linear
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(1e30))  # the scaled seed, cast to f16 for the backward
    res, _ = _train(cli, model, data, "--policy", "fp16", "--loss-scale", "static=1e30")
    _clean_error(res, "error: step 0 (of 8, counted from 0): the gradients hold inf or NaN "
                      "(w: 6 values) and there is no dynamic loss scaling to skip the step")
    _nothing_written(model.parent)


def test_train_with_dynamic_scaling_skips_inf_gradients_and_backs_off(cli, linear) -> None:
    model, data, _ = linear
    res, out = _train(cli, model, data, "--policy", "fp16", "--loss-scale", "dynamic",
                      "--loss-scale-init", "1e30")
    assert res.rc == 0, res.err
    rows = json.loads((model.parent / "train.json").read_text())["steps"]
    # GradScaler: every step is skipped while 1e30 * 0.5^k stays beyond f16 (65504).
    expected = [float(np.float32(1e30) * np.float32(0.5) ** k) for k in range(8)]
    assert [r["loss_scale"] for r in rows] == expected
    assert all(r["skipped"] and not r["grads_finite"] for r in rows)
    trained = np.load(out.with_suffix(".npz"))["w"]
    assert np.array_equal(trained, np.load(model.parent / "w.npz")["w"])  # no step applied


@pytest.mark.parametrize(("flags", "message"), [
    (("--loss-scale-init", "inf"), "dynamic loss scaling needs a finite f32 init > 0"),
    (("--loss-scale-init", "1e39"), "dynamic loss scaling needs a finite f32 init > 0"),
    (("--loss-scale-init", "nan", "--loss-scale", "none"),
     "dynamic loss scaling needs a finite f32 init > 0"),
    (("--loss-scale-growth", "inf"), "a finite growth > 1"),
    (("--optimizer", "sgd{lr=nan}"), "optimizer 'sgd': lr must be a finite f32 number, got nan"),
    (("--optimizer", "adam{lr=inf}"), "optimizer 'adam': lr must be a finite f32 number"),
    (("--optimizer", "sgd{momentum=nan}"), "optimizer 'sgd': momentum must be a finite"),
])
def test_train_non_finite_options_are_usage_errors(cli, linear, flags, message) -> None:
    model, data, _ = linear
    res, _ = _train(cli, model, data, *flags)
    assert res.rc == 2, res.err
    last = res.err.splitlines()[-1]
    assert last.startswith("mplower: error: ") and message in last, last
    _nothing_written(model.parent)


# ---- tune --scheduler fails within seconds, naming the address ----------------------------


@pytest.fixture
def not_dask() -> Iterator[str]:
    """The address of a TCP service on 127.0.0.1 that answers in HTTP, not dask."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" * 4)
                time.sleep(0.5)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"tcp://127.0.0.1:{server.getsockname()[1]}"
    done.set()
    thread.join()
    server.close()


def _unused_port() -> str:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("where", ["unused", "not_dask"])
def test_tune_scheduler_that_is_not_there_fails_fast_naming_it(cli, tmp_path, request,
                                                               where) -> None:
    address = _unused_port() if where == "unused" else request.getfixturevalue("not_dask")
    (tmp_path / "m.ir").write_text(DOUBLE_IR)
    np.savez(tmp_path / "in.npz", x=np.ones((4, 8), np.float32))
    start = time.monotonic()
    res = cli("tune", tmp_path / "m.ir", "--target", "h100", "--data", tmp_path / "in.npz",
              "--scheduler", address, "-o", tmp_path / "out")
    assert time.monotonic() - start < 10
    _clean_error(res, f"{address}: error: cannot connect to the dask scheduler: ")
    assert len(res.err.strip().splitlines()) == 1
    assert "MemoryError" not in res.err and "too large" not in res.err
    assert not (tmp_path / "out").exists()
