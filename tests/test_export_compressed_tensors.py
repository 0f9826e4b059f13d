"""`mplower export --format compressed-tensors`: a checkpoint vLLM and transformers load.

The check that matters runs the `compressed-tensors` package itself (a dev/bench extra, never a
runtime dependency; skipped where no Python has it): it parses config.json's
quantization_config with its own QuantizationConfig, picks each layer's compressor from its
registry by the format named there, loads the safetensors file with `safetensors.torch`, and
decompresses every quantized weight. Each one must equal, bit for bit, the weight mplower's
executor multiplies with (the dequantized f32 of the lowered module), and every tensor left in
float must equal the source checkpoint's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_export_matmulnbits import LLAMA, write_llama

from mplower.backend.executor import reference_runner
from mplower.ir.parser import parse_file
from mplower.ir.types import DenseAttr, tensor
from mplower.lowering.calibration import ConstantValues
from mplower.lowering.weight_only import weight_only_matmuls
from mplower.pass_manager import PassContext, PassManager, parse_pipeline

# A Python with compressed-tensors and torch: this one, or the one MPLOWER_CT_PYTHON names.
_CANDIDATES = [os.environ.get("MPLOWER_CT_PYTHON"), sys.executable, "/tmp/tvenv/bin/python"]

DECOMPRESS = r"""
import json, sys
import numpy as np
from safetensors.torch import load_file
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig

infos = {}
for folder in sys.argv[1:]:
    qc = QuantizationConfig.model_validate(
        json.load(open(f"{folder}/config.json"))["quantization_config"])
    state = load_file(f"{folder}/model.safetensors")
    layers = sorted(k[:-len(".weight_scale")] for k in state if k.endswith(".weight_scale"))
    result = {}
    for name in layers:
        (scheme,) = [g for g in qc.config_groups.values()
                     if "Linear" in g.targets or name in g.targets]
        assert name not in qc.ignore
        compressor = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
        params = {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}
        result[name] = compressor.decompress(params, scheme)["weight"].float().numpy()
    np.savez(f"{folder}/decompressed.npz", **result)
    infos[folder] = {"layers": len(layers), "format": qc.format, "ignore": qc.ignore,
                     "dtypes": sorted({str(state[n + ".weight_scale"].dtype) for n in layers})}
print(json.dumps(infos))
"""


def _ct_python() -> str | None:
    for py in _CANDIDATES:
        if py and Path(py).exists() and subprocess.run(
                [py, "-c", "import compressed_tensors, safetensors.torch"],
                check=False, capture_output=True).returncode == 0:
            return py
    return None


CT_PYTHON = _ct_python()
needs_ct = pytest.mark.skipif(CT_PYTHON is None, reason="compressed-tensors is not installed")


CASES = {  # name -> (pipeline, edit of the lowered module)
    "w4g32": ("quantize{scheme=w4a16 group=32}", None),
    "w8g128": ("quantize{scheme=w8a16 group=128}", None),
    "w4g64asym": ("quantize{scheme=w4a16 group=64}", "asym"),
    "w4channel": ("quantize{scheme=w4a16 group=0}", None),
    "w4g32head": ("quantize{scheme=w4a16 group=32}", "head"),
    "fp8": ("assign-precision{policy=fp8},insert-casts", None),
    # w8a8 needs calibrated ranges: @prefill alone (calibration data is its input_ids).
    "w8a8sym": ("calibrate{data=CALIB},quantize{scheme=w8a8 symmetric=true}", "prefill"),
    "w8a8asym": ("calibrate{data=CALIB},quantize{scheme=w8a8}", "prefill"),
    "fp8static": (("assign-precision{policy=fp8},calibrate{data=CALIB},insert-casts,"
                   "scale-recipes{recipe=static}"), "prefill"),
    # A bf16 checkpoint with tied embeddings (its own import): lm_head quantized, the
    # embedding table not.
    "tiedbf16": ("quantize{scheme=w4a16 group=32}", "tied"),
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Every case exported from one imported checkpoint, and decompressed by one run of the
    compressed-tensors package: {name: (module, its folder, decompressed, info)}, the source."""
    from mplower.cli.main import main
    from mplower.ir.printer import print_module

    tmp = tmp_path_factory.mktemp("ct")
    source = tmp / "llama"
    tensors = write_llama(source)
    assert main(["import", str(source), "-o", str(tmp / "m.ir"), "--seq", "4"]) == 0
    edits = {"asym": make_asymmetric, "head": keep_head_in_float}
    calib = tmp / "calib.npz"
    np.savez(calib, input_ids=np.random.default_rng(0).integers(0, 64, (8, 1, 4)))
    tied = tmp / "tied"
    tied_tensors = write_llama(tied, {**LLAMA, "tie_word_embeddings": True}, bf16=True)
    assert main(["import", str(tied), "-o", str(tmp / "t.ir"), "--seq", "4"]) == 0
    built = {}
    for name, (pipeline, edit) in CASES.items():
        module = parse_file(tmp / ("t.ir" if edit == "tied" else "m.ir"))
        if edit == "prefill":
            del module.functions["decode"]
        PassManager(parse_pipeline(pipeline.replace("CALIB", str(calib)))).run(
            module, PassContext(runner=reference_runner))
        if edit in edits:
            edits[edit](module)
        ir = tmp / f"{name}.ir"
        ir.write_text(print_module(module))
        out = tmp / name
        assert main(["export", str(ir), "--format", "compressed-tensors", "--checkpoint",
                     str(tied if edit == "tied" else source), "-o", str(out)]) == 0
        built[name] = (module, out)
    results = decompressed([out for _, out in built.values()]) if CT_PYTHON else {}
    return {name: (module, out, *results.get(str(out), ({}, {})))
            for name, (module, out) in built.items()}, {**tensors, "tied": tied_tensors}


def decompressed(folders: list[Path]) -> dict[str, tuple[dict, dict]]:
    r = subprocess.run([CT_PYTHON, "-c", DECOMPRESS, *map(str, folders)], check=False,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    infos = json.loads(r.stdout.strip().splitlines()[-1])
    return {f: (dict(np.load(Path(f) / "decompressed.npz")), infos[f]) for f in infos}


def mplower_weights(module) -> dict[str, np.ndarray]:
    """Layer name -> the [out, in] f32 weight the executor multiplies with: a weight-only
    layer's dequantized grid, an fp8 layer's scaled values (mp.scaled_quant's result)."""
    out = {}
    for f in module.functions.values():
        for wo in weight_only_matmuls(module, f):
            out[wo.source.removesuffix(".weight")] = wo.dequantized().T
        consts = ConstantValues(module, f)
        for n in f.walk("mp.matmul"):
            w = f.operands(n)[1]
            named = f.op(w[0]) == "mp.quantize" and "name" in f.attrs_of(f.operands(w[0])[0][0])
            if f.type_of(w).elem == "i8" and named:  # w8a8: codes * per-channel scale
                a = f.attrs_of(w[0])
                scale = np.asarray(a["scale"].array, np.float32).reshape(-1, 1)
                name = f.attrs_of(f.operands(w[0])[0][0])["name"]
                out[name.removesuffix(".weight")] = consts.get(w).T.astype(np.float32) * scale
                continue
            src = f.operands(w[0])[0][0] if f.op(w[0]) == "mp.scaled_quant" else None
            if src is not None and "name" in f.attrs_of(src):
                name = f.attrs_of(src)["name"]
                out[name.removesuffix(".weight")] = consts.get(w).T
    return out


def read_safetensors(path: Path) -> dict[str, tuple[str, list, bytes]]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0]:
                                             8 + n + v["data_offsets"][1]])
            for k, v in header.items()}


def make_asymmetric(module) -> None:
    """Give every weight-only grid zero points (quantize has no asymmetric weight option): the
    same zero points on each mp.quantize and the mp.dequantize of its codes."""
    for f in module.functions.values():
        rng = np.random.default_rng(1)  # @prefill and @decode quantize each weight alike
        for n in f.walk("mp.quantize"):
            a = f.attrs_of(n)
            t = f.types(n)[0]
            size = np.asarray(a["scale"].array).size
            zp = DenseAttr(rng.integers(-3, 4, size).astype(np.int64), tensor((size,), t.elem))
            for m in [n] + [u for u, _ in f.uses((n, 0))]:
                f.set_attr(m, "zero_point", zp)


def keep_head_in_float(module) -> None:
    """What a plan that keeps lm_head in f32 leaves: its matmul reads the float weight."""
    for f in module.functions.values():
        for wo in weight_only_matmuls(module, f):
            if wo.source == "lm_head.weight":
                const = next(n for n in f.walk("mp.constant")
                             if f.attrs_of(n).get("name") == "lm_head.weight")
                f.set_operand(wo.matmul, 1, (const, 0))


@needs_ct
@pytest.mark.parametrize("case,bits,group,asym", [
    ("w4g32", 4, 32, False), ("w8g128", 8, 128, False), ("w4g64asym", 4, 64, True),
    ("w4channel", 4, None, False)])
def test_compressed_tensors_decompresses_to_mplowers_weights(exports, case, bits, group, asym):
    cases, source = exports
    module, folder, theirs, info = cases[case]
    ours = mplower_weights(module)
    assert sorted(theirs) == sorted(ours) and len(ours) == 8  # 7 per layer + lm_head
    for name, w in ours.items():
        np.testing.assert_array_equal(theirs[name], w, err_msg=name)
    q = json.loads((folder / "config.json").read_text())["quantization_config"]
    (args,) = [g["weights"] for g in q["config_groups"].values()]
    assert q["format"] == info["format"] == "pack-quantized" and q["ignore"] == []
    assert (args["num_bits"], args["group_size"], args["symmetric"]) == (bits, group, not asym)
    assert args["strategy"] == ("channel" if group is None else "group")
    # Tensors kept in float are the source's, byte for byte, in its dtype.
    written = read_safetensors(folder / "model.safetensors")
    for name in ("model.embed_tokens.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight"):
        dtype, _, data = written[name]
        assert dtype == "F32" and data == source[name].tobytes()
    assert ("model.layers.0.mlp.down_proj.weight_zero_point" in written) == asym


@needs_ct
def test_layers_the_plan_keeps_in_float_are_ignored(exports):
    cases, source = exports
    _, folder, theirs, info = cases["w4g32head"]
    assert "lm_head" not in theirs and len(theirs) == 7 and info["ignore"] == ["lm_head"]
    dtype, _, data = read_safetensors(folder / "model.safetensors")["lm_head.weight"]
    assert dtype == "F32" and data == source["lm_head.weight"].tobytes()


def test_packing_is_the_documented_layout(exports):
    """Without the package: weight_packed unpacked here (8 codes a word, lowest bits first,
    offset 8) gives the codes whose (code - zero point) * scale is mplower's weight."""
    cases, _ = exports
    module, folder, _, _ = cases["w4g32"]
    written = read_safetensors(folder / "model.safetensors")
    name = "model.layers.0.mlp.down_proj"
    _, shape, raw = written[name + ".weight_packed"]
    words = np.frombuffer(raw, np.int32).reshape(shape).view(np.uint32)
    codes = np.stack([(words >> (4 * i)) & 15 for i in range(8)], -1).reshape(shape[0], -1)
    _, sshape, sraw = written[name + ".weight_scale"]
    scale = np.frombuffer(sraw, np.float32).reshape(sshape)
    w = (codes.astype(np.float32) - 8) * np.repeat(scale, 32, axis=1)
    np.testing.assert_array_equal(w, mplower_weights(module)[name])


@needs_ct
def test_fp8_plan_is_float_quantized_with_mplowers_scaled_weights(exports):
    """The fp8 sheet: per-channel scaled fp8 weights, activations scaled by their current amax
    (dynamic per tensor); the first layer and lm_head kept in f32 are ignored."""
    cases, _ = exports
    module, folder, theirs, info = cases["fp8"]
    ours = mplower_weights(module)
    assert sorted(theirs) == sorted(ours) and len(ours) == 6
    for name, w in ours.items():
        np.testing.assert_array_equal(theirs[name], w, err_msg=name)
    q = json.loads((folder / "config.json").read_text())["quantization_config"]
    (group,) = q["config_groups"].values()
    assert q["format"] == info["format"] == "float-quantized"
    assert group["weights"]["strategy"] == "channel" and group["weights"]["type"] == "float"
    assert group["input_activations"]["dynamic"] is True
    assert info["ignore"] == ["lm_head", "model.layers.0.self_attn.q_proj"]
    dtype, shape, _ = read_safetensors(folder / "model.safetensors")[
        "model.layers.0.mlp.up_proj.weight"]
    assert dtype == "F8_E4M3" and shape == [256, 128]


@needs_ct
@pytest.mark.parametrize("case", ["w8a8sym", "w8a8asym"])
def test_w8a8_is_int_quantized_with_the_calibrated_activation_grid(exports, case):
    cases, _ = exports
    module, folder, theirs, info = cases[case]
    ours = mplower_weights(module)
    assert sorted(theirs) == sorted(ours) and len(ours) == 8
    for name, w in ours.items():
        np.testing.assert_array_equal(theirs[name], w, err_msg=name)
    (group,) = json.loads((folder / "config.json").read_text())[
        "quantization_config"]["config_groups"].values()
    assert info["format"] == "int-quantized" and group["weights"]["strategy"] == "channel"
    acts = group["input_activations"]
    assert (acts["dynamic"], acts["strategy"]) == (False, "tensor")
    assert acts["symmetric"] == (case == "w8a8sym")
    # The activation grid of q_proj: the scale of its mp.quantize, and (asymmetric) the zero
    # point whose shift c = -z * scale the pass subtracted.
    layer = "model.layers.0.self_attn.q_proj"
    f = module.function("prefill")
    n = next(n for n in f.walk("mp.matmul") if f.type_of(f.operands(n)[1]).elem == "i8")
    assert f.attrs_of(f.operands(f.operands(n)[1][0])[0][0])["name"] == layer + ".weight"
    xq = f.operands(n)[0][0]
    s = np.float32(f.attrs_of(xq)["scale"])
    written = read_safetensors(folder / "model.safetensors")
    assert np.frombuffer(written[layer + ".input_scale"][2], np.float32)[0] == s
    if case == "w8a8asym":
        z = int(np.frombuffer(written[layer + ".input_zero_point"][2], np.int8)[0])
        sub = f.operands(xq)[0][0]
        c = ConstantValues(module, f).get(f.operands(sub)[1])
        assert f.op(sub) == "mp.sub" and np.float32(-z * np.float64(s)) == np.float32(c)
    else:
        assert layer + ".input_zero_point" not in written


@needs_ct
def test_tied_bf16_checkpoint_keeps_its_embedding_and_unties_a_quantized_head(exports):
    cases, sources = exports
    module, folder, theirs, _ = cases["tiedbf16"]
    ours = mplower_weights(module)
    assert "lm_head" in ours and sorted(theirs) == sorted(ours)
    for name, w in ours.items():
        np.testing.assert_array_equal(theirs[name], w, err_msg=name)
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    written = read_safetensors(folder / "model.safetensors")
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        dtype, _, data = written[name]
        assert dtype == "BF16" and data == sources["tied"][name].tobytes()
    assert "lm_head.weight" not in written and "lm_head.weight_packed" in written


@needs_ct
def test_fp8_static_activations_keep_their_calibrated_scale(exports):
    cases, _ = exports
    module, folder, theirs, _ = cases["fp8static"]
    ours = mplower_weights(module)
    assert sorted(theirs) == sorted(ours) and len(ours) == 6
    for name, w in ours.items():
        np.testing.assert_array_equal(theirs[name], w, err_msg=name)
    (group,) = json.loads((folder / "config.json").read_text())[
        "quantization_config"]["config_groups"].values()
    assert group["input_activations"]["dynamic"] is False
    # gate_proj reads the second norm's output, scaled from its calibrated amax: scale =
    # amax / 448 (E4M3's largest value).
    f = module.function("prefill")
    amax = next(f.attrs_of(n)["amax"] for n in f.walk("mp.scaled_quant")
                if f.data(n)["name"] == "rms_norm_1_f8E4M3FN")
    written = read_safetensors(folder / "model.safetensors")
    scale = np.frombuffer(written["model.layers.0.mlp.gate_proj.input_scale"][2], np.float32)
    np.testing.assert_allclose(scale, [amax / 448], rtol=1e-6)


def test_a_layer_the_format_cannot_hold_is_refused_naming_the_op(cli, tmp_path):
    """fp8 weights scaled per tensor by the current recipe (scale-recipes) have no
    compressed-tensors description here: refused at the op, nothing written."""
    source = tmp_path / "llama"
    write_llama(source)
    assert cli("import", source, "-o", tmp_path / "m.ir", "--seq", "4").rc == 0
    r = cli("opt", tmp_path / "m.ir", "--pass-pipeline=assign-precision{policy=fp8},"
            "insert-casts,scale-recipes{recipe=current weights=current}", "-o", tmp_path / "q.ir")
    assert r.rc == 0, r.err
    r = cli("export", tmp_path / "q.ir", "--format", "compressed-tensors", "--checkpoint",
            source, "-o", tmp_path / "out")
    assert r.rc == 1 and "fp8 weight has recipe" in r.err, r.err
    assert "q.ir:" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "out").exists()


def test_usage_errors_write_nothing(cli, tmp_path):
    source = tmp_path / "llama"
    write_llama(source)
    assert cli("import", source, "-o", tmp_path / "m.ir", "--seq", "4").rc == 0
    r = cli("export", tmp_path / "m.ir", "--format", "compressed-tensors", "-o", tmp_path / "o")
    assert r.rc == 2 and "--checkpoint" in r.err
    r = cli("export", tmp_path / "m.ir", "--format", "compressed-tensors", "--checkpoint",
            source, "-o", source / "sub")
    assert r.rc == 2 and "inside the checkpoint" in r.err
    r = cli("export", tmp_path / "m.ir", "--checkpoint", source, "-o", tmp_path / "m.onnx")
    assert r.rc == 2 and "--format compressed-tensors" in r.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "m.ir", "m.npz"]
