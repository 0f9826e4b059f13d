"""A lowered module of an HF checkpoint, written back as a compressed-tensors checkpoint.

compressed-tensors (vllm-project/compressed-tensors) is the format llm-compressor writes and
vLLM and transformers load: the checkpoint folder as before, each quantized nn.Linear's `weight`
replaced by its compressed parameters, and `config.json` given a `quantization_config` that
says how (config_groups of targets and QuantizationArgs, the compression `format`, an `ignore`
list). What this module writes, from the module's own grid (never re-quantized):

- weight-only layers (quantize{scheme=w4a16|w8a16}, or imported MatMulNBits): format
  "pack-quantized". `weight_packed` int32 [N, ceil(K * bits / 32)]: the codes of the
  [out, in] weight, offset by 2^(bits - 1) to unsigned and packed 32 / bits to a word along the
  input dimension, lowest bits first, the row padded with zeros to a multiple of 32 codes
  (compressed_tensors/compressors/pack_quantized/helpers.py, pack_to_int32);
  `weight_scale` [N, groups] (strategy "group" with group_size, or "channel": [N, 1]);
  `weight_zero_point` for asymmetric grids, the signed zero points packed the same way along
  the *output* dimension (pack_to_int32(..., packed_dim=0)): int32 [ceil(N * bits / 32),
  groups]; `weight_shape` int64 [N, K] (pack_quantized/base.py, compress). Decompression is
  (code - zero_point) * scale (quantization/lifecycle/forward.py, dequantize), so the weight a
  server rebuilds is the f32 weight mplower's executor multiplies with, exactly: scales are
  written in f32.
- fp8 plans (scaled fp8 weights): "float-quantized", `weight` F8_E4M3 and `weight_scale`;
  static w8a8 (quantize{scheme=w8a8}): "int-quantized", `weight` I8, `weight_scale` and the
  calibrated activation grid (`input_scale`, `input_zero_point`). Decompression is weight *
  weight_scale (compressors/naive_quantized/base.py).
- every other tensor of the source checkpoint in its own dtype (the module's value where a pass
  changed it), the remaining files of the folder copied.

Each layer's group is read from its values (mplower.lowering.weight_only); layers with one grid
description share one config group targeting "Linear", and matmul weights left in float go to
`ignore`. What the format cannot say (a layer quantized another way, a Conv1D checkpoint, two
functions that quantize one weight differently) is refused with a located diagnostic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mplower.hf.config import Config
from mplower.hf.llama import ARCHITECTURES as LLAMA_FAMILY
from mplower.hf.safetensors import INDEX, Checkpoint, inside
from mplower.hf.safetensors_writer import Pending
from mplower.io.npz import WeightStore
from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.ir.graph import Function, Module, Value
from mplower.ir.types import TensorType
from mplower.lowering.calibration import CALIB, ConstantValues, constant_nodes
from mplower.lowering.weight_only import WeightOnly, weight_only_matmuls

FORMAT = "compressed-tensors"  # `mplower export --format`
PACK_QUANTIZED = "pack-quantized"
FLOAT_QUANTIZED = "float-quantized"
INT_QUANTIZED = "int-quantized"


@dataclass(frozen=True)
class Scaled:
    """How an fp8 or int8 (w8a8) layer's scales and activation are described (QuantizationArgs
    fields); its weight is stored unpacked (float-quantized, int-quantized)."""

    strategy: str  # "channel", "tensor" or "block"
    block: tuple[int, int] | None  # [rows, cols] of the [out, in] weight, for "block"
    inputs: str | None  # None (weight-only), "dynamic", or "static"
    input_scale: float | None = None  # static: the calibrated per-tensor decode scale
    type: str = "float"  # "float" (fp8 E4M3) or "int" (int8)
    input_zero_point: int = 0  # static int8 activations: the grid's zero point


@dataclass(frozen=True)
class Layer:
    """One quantized nn.Linear: its module name and the grid of its [out, in] weight."""

    name: str  # e.g. model.layers.0.mlp.up_proj
    bits: int
    codes: np.ndarray  # int64 [N, K], signed; fp8: the f8E4M3FN codes as f32
    scale: np.ndarray  # f32 [N, K]; fp8: the scales as written ([N, 1], [1] or per block)
    zero_point: np.ndarray  # int64 [N, K], signed
    period: int = 0  # weight-only: inputs per run of one scale (WeightOnly.period)
    scaled: Scaled | None = None

    @property
    def symmetric(self) -> bool:
        return not np.any(self.zero_point)


@dataclass
class Exported:
    config: dict
    tensors: dict[str, Pending]
    files: list[Path]  # other files of the source folder, copied as they are
    notes: list[str] = field(default_factory=list)


def export_checkpoint(module: Module, source: str | Path, weights: str | None = None
                      ) -> Exported:
    """The compressed-tensors checkpoint of `module`, imported from the HF folder `source`."""
    source = Path(source)
    cfg = Config(inside(source, "config.json", "file", source))
    arch = cfg.architecture()
    if arch not in LLAMA_FAMILY:
        raise cfg.error(f"architecture '{arch}': the compressed-tensors export writes "
                        f"{', '.join(LLAMA_FAMILY)} checkpoints (nn.Linear weights); "
                        f"GPT-2's Conv1D layers are not what its config groups target")
    ckpt = Checkpoint(source)
    layers, linear = _layers(module, weights)
    store = WeightStore(module, weights)
    constants = _named_constants(module)
    notes: list[str] = []
    config = dict(cfg.data)
    tensors: dict[str, Pending] = {}
    for name in sorted(ckpt.where):
        layer_name = name.removesuffix(".weight")
        if layer_name in layers:
            continue
        tensors[name] = _float_tensor(ckpt, name, constants.get(name), store, name in linear,
                                      notes)
    if "lm_head" in layers and "lm_head.weight" not in ckpt:
        # Tied embeddings: the head is quantized, the embedding table is not.
        config["tie_word_embeddings"] = False
        notes.append("lm_head is quantized and its embedding table is not: written as its "
                     "own tensor with tie_word_embeddings = false")
    ignore = sorted(n.removesuffix(".weight") for n in linear
                    if n.removesuffix(".weight") not in layers)
    if layers:
        quant, groups = _quantization_config(list(layers.values()), ignore)
        config["quantization_config"] = quant
        for layer in layers.values():
            tensors.update(_pack_quantized(layer, groups[layer.name])
                           if layer.scaled is None else _float_quantized(layer))
    files = [p for p in sorted(source.iterdir())
             if p.is_file() and not p.is_symlink() and p.suffix != ".safetensors"
             and p.name not in ("config.json", INDEX)]
    return Exported(config, tensors, files, notes)


def _layers(module: Module, weights: str | None) -> tuple[dict[str, Layer], set[str]]:
    """The quantized layers by module name, and the npz keys of every matmul weight."""
    layers: dict[str, Layer] = {}
    linear: set[str] = set()

    for f in module.functions.values():
        found = {wo.matmul: wo for wo in weight_only_matmuls(module, f, weights)}
        consts = constant_nodes(f)
        values = ConstantValues(module, f, weights)
        for n in f.walk("mp.matmul"):
            w = f.operands(n)[1]
            if f.operands(n)[0][0] in consts:
                continue  # (a constant times a constant: not a layer)
            fp8 = _fp8_layer(f, n, values) or _int8_layer(f, n, values)
            if fp8 is not None:
                linear.add(fp8.name + ".weight")
                _add(layers, fp8, f.data(n)["loc"])
            elif n in found:
                wo = found[n]
                if wo.source is None:
                    raise DiagnosticError.at(f.data(n)["loc"], "the weight-only matmul's codes "
                                             "come from no single named weight")
                linear.add(wo.source)
                _add(layers, _layer_of(wo), f.data(n)["loc"])
            elif w[0] in consts:
                source = _float_weight(f, w)
                elem = f.type_of(w).elem
                if source is None or elem not in _FLOAT_WEIGHTS:
                    raise DiagnosticError.at(f.data(n)["loc"], (
                        f"%{f.data(n)['name']} multiplies by a weight in {elem}"
                        f"{'' if source is None else f' ({source})'}: the compressed-tensors "
                        f"export writes weight-only int4/int8, scaled fp8 and static w8a8 "
                        f"layers, and float ones ({', '.join(_FLOAT_WEIGHTS)}); export this "
                        f"plan as ONNX"))
                linear.add(source)
    return layers, linear


def _fp8_layer(f: Function, n: int, consts: ConstantValues) -> Layer | None:
    """An fp8 layer: the named float weight as mp.scaled_quant to f8E4M3FN with f32 block
    scales (the fp8 sheets' per-channel weights), times an activation that is float
    (weight-only fp8) or scaled fp8 with the current (dynamic) or static recipe. None when the
    weight is not such a scaled fp8 constant; an error when its activation is one the format
    has no description for."""
    from mplower.ir.opdef import OPS, check_attrs
    from mplower.numerics import mx

    x, w = f.operands(n)[:2]
    w_t = f.type_of(w)
    if f.op(w[0]) != "mp.scaled_quant" or w_t.rank != 2 or w_t.elem != "f8E4M3FN":
        return None
    a = check_attrs(OPS["mp.scaled_quant"], f.attrs_of(w[0]))
    src = f.operands(w[0])[0]
    source = _float_weight(f, src)
    loc = f.data(n)["loc"]
    if source is None or a["recipe"] != "block" or a["scale_format"] != "f32":
        raise DiagnosticError.at(loc, (
            f"%{f.data(n)['name']}'s fp8 weight has recipe \"{a['recipe']}\" with "
            f"{a['scale_format']} scales; the compressed-tensors export writes fp8 weights "
            f"with f32 block scales (recipe \"block\", the fp8 sheets' per-channel weights)"))
    k, n_out = w_t.shape
    bk, bn = a["block"]
    r = mx.quantize_blocked(np.asarray(consts.get(src), np.float32), "f8E4M3FN", (bk, bn), "f32")
    scales = np.ascontiguousarray(r.scales.T, np.float32)  # [N / bn, K / bk]
    if (bk, bn) == (k, 1):
        strategy, block = "channel", None
    elif bk >= k and bn >= n_out:
        strategy, block, scales = "tensor", None, scales.reshape(1)
    else:
        strategy, block = "block", (bn, bk)
    x_t = f.type_of(x)
    inputs, input_scale = None, None
    if x_t.elem == "f8E4M3FN" and f.op(x[0]) == "mp.scaled_quant":
        xa = check_attrs(OPS["mp.scaled_quant"], f.attrs_of(x[0]))
        if xa["recipe"] == "current" and not xa["margin"] and not xa["pow2"]:
            inputs = "dynamic"
        elif xa["recipe"] == "static" and not xa["pow2"]:
            inputs = "static"
            input_scale = float(np.float32(1) / np.float32(
                mx.encode_factor(xa["amax"], "f8E4M3FN", xa["margin"], pow2=False)))
        else:
            inputs = "unsupported"
    elif x_t.elem not in _FLOAT_WEIGHTS:
        inputs = "unsupported"
    if inputs == "unsupported":
        raise DiagnosticError.at(loc, (
            f"%{f.data(n)['name']}'s activation is {x_t.elem} from "
            f"{f.op(x[0])}; the compressed-tensors export describes fp8 activations scaled "
            f"per tensor by the current recipe (dynamic) or the static one, without margin "
            f"or pow2, or float activations (weight-only fp8)"))
    return Layer(source.removesuffix(".weight"), 8, np.ascontiguousarray(r.codes.T), scales,
                 np.zeros((), np.int64), scaled=Scaled(strategy, block, inputs, input_scale))


def _int8_layer(f: Function, n: int, consts: ConstantValues) -> Layer | None:
    """A w8a8 layer (quantize{scheme=w8a8}): the integer kernel of an activation quantized per
    tensor (i8, or ui8: the int8 grid with zero point -128; or x - c, the shift the pass
    writes for a zero point z, c = -z * scale) and the named weight quantized to i8 per
    channel or per tensor. None for any other matmul."""
    from mplower.ir.opdef import OPS, check_attrs

    x, w = f.operands(n)[:2]
    x_t, w_t = f.type_of(x), f.type_of(w)
    if w_t.elem != "i8" or x_t.elem not in ("i8", "ui8") or w_t.rank != 2:
        return None
    loc = f.data(n)["loc"]
    source = _float_weight(f, f.operands(w[0])[0]) if f.op(w[0]) == "mp.quantize" else None
    if source is None or f.op(x[0]) != "mp.quantize":
        raise DiagnosticError.at(loc, f"%{f.data(n)['name']} is an integer kernel whose "
                                      f"operands are not a quantized activation and a "
                                      f"quantized named weight")
    wa = check_attrs(OPS["mp.quantize"], f.attrs_of(w[0]))
    xa = check_attrs(OPS["mp.quantize"], f.attrs_of(x[0]))
    w_scale = np.asarray(wa["scale"], np.float32).reshape(-1)
    x_scale = np.asarray(xa["scale"], np.float32).reshape(-1)
    if np.any(np.asarray(wa["zero_point"])) or x_scale.size != 1 or (
            w_scale.size > 1 and wa["axis"] % 2 != 1):
        raise DiagnosticError.at(loc, f"%{f.data(n)['name']}: int-quantized describes "
                                      f"symmetric weights per output channel or per tensor and "
                                      f"activations per tensor")
    zero = int(np.asarray(xa["zero_point"]).reshape(-1)[0]) - (128 if x_t.elem == "ui8" else 0)
    src = f.operands(x[0])[0]
    if f.op(src[0]) == "mp.sub" and f.attrs_of(src[0]).get(CALIB) == "shifted":
        c = float(consts.get(f.operands(src[0])[1]))
        zero = int(np.rint(-c / float(x_scale[0])))
    codes = np.asarray(consts.get(w)).astype(np.int64).T
    scale = np.broadcast_to(w_scale.reshape(-1, 1), (codes.shape[0], 1)) if w_scale.size > 1 \
        else w_scale
    return Layer(source.removesuffix(".weight"), 8, np.ascontiguousarray(codes),
                 np.ascontiguousarray(scale, np.float32), np.zeros((), np.int64),
                 scaled=Scaled("channel" if w_scale.size > 1 else "tensor", None, "static",
                               float(x_scale[0]), "int", zero))


# Weights a server reads as the checkpoint's floats (a cast to bf16/f16 is its own load).
_FLOAT_WEIGHTS = ("f32", "bf16", "f16")


def _float_weight(f: Function, w: Value) -> str | None:
    """The name of the named constant a float weight operand is (through float casts)."""
    while f.op(w[0]) == "mp.cast" and f.type_of(w).elem in _FLOAT_WEIGHTS:
        w = f.operands(w[0])[0]
    a = f.attrs_of(w[0])
    return a.get("name") if f.op(w[0]) == "mp.constant" else None


def _layer_of(wo: WeightOnly) -> Layer:
    offset = 128 if wo.elem == "ui8" else 0  # unsigned codes: the same grid, signed
    return Layer(wo.source.removesuffix(".weight"), wo.bits, (wo.codes - offset).T,
                 wo.scale.T, (wo.zero_point - offset).T, wo.period())


def _add(layers: dict[str, Layer], layer: Layer, loc: Location) -> None:
    """One grid per layer: @prefill and @decode must have quantized a weight alike."""
    seen = layers.get(layer.name)
    if seen is None:
        layers[layer.name] = layer
        return
    if seen.bits != layer.bits or any(not np.array_equal(a, b) for a, b in (
            (seen.codes, layer.codes), (seen.scale, layer.scale),
            (seen.zero_point, layer.zero_point))):
        raise DiagnosticError.at(loc, f"{layer.name} is quantized differently in two "
                                      f"functions; a checkpoint holds one weight per layer")


def _named_constants(module: Module) -> dict[str, tuple[TensorType, Location]]:
    out = {}
    for f in module.functions.values():
        for n in f.walk("mp.constant"):
            name = f.attrs_of(n).get("name")
            if name is not None:
                out[name] = (f.types(n)[0], f.data(n)["loc"])
    return out


def _float_tensor(ckpt: Checkpoint, name: str, constant, store: WeightStore, linear: bool,
                  notes: list[str]) -> Pending:
    """A tensor the plan keeps in float: the module's value (transposed back for a Linear
    weight, which import turned to [in, out]) in the source's dtype where it holds it exactly;
    the source's bytes where the module does not read it."""
    info = ckpt.info(name)
    def stored() -> np.ndarray:
        return ckpt.where[name].array(info)

    if constant is None:
        return Pending(info.dtype, info.shape, stored)
    t, loc = constant

    def value() -> np.ndarray:
        v = np.asarray(store.get(name, t.shape, loc), np.float32)
        return v.T if linear else v

    original = ckpt.float32(name)
    mine = value()
    if mine.shape == info.shape and np.array_equal(mine, original):
        return Pending(info.dtype, info.shape, stored)
    if mine.shape != info.shape:
        raise DiagnosticError.at(loc, f"weight '{name}' has shape {list(mine.shape)} in the "
                                      f"module and {list(info.shape)} in the checkpoint")
    notes.append(f"{name}: the module's value differs from the checkpoint's (a pass changed "
                 f"it); written as F32")
    return Pending("F32", info.shape, value)


def _pack_quantized(layer: Layer, group: int) -> dict[str, Pending]:
    """The parameters of one layer with one scale per `group` inputs (K: per channel)."""
    n, k = layer.codes.shape
    starts = np.arange(0, k, group)
    scale = np.ascontiguousarray(layer.scale[:, starts])
    out = {
        f"{layer.name}.weight_packed": _lazy(_pack_int32(layer.codes, layer.bits)),
        f"{layer.name}.weight_scale": _lazy(scale),
        f"{layer.name}.weight_shape": _lazy(np.array([n, k], np.int64)),
    }
    if not layer.symmetric:
        zp = layer.zero_point[:, starts]
        out[f"{layer.name}.weight_zero_point"] = _lazy(_pack_int32(zp.T, layer.bits).T)
    return out


def _float_quantized(layer: Layer) -> dict[str, Pending]:
    """An fp8 or int8 layer as float-quantized / int-quantized write it: `weight` in F8_E4M3 or
    I8 and `weight_scale` (and a static `input_scale`, `input_zero_point`); decompression is
    weight * weight_scale (compressors/naive_quantized/base.py, quantization/lifecycle/
    forward.py), the values mplower's GEMM reads."""
    import ml_dtypes

    if layer.scaled.type == "float":
        bits = layer.codes.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        weight = Pending("F8_E4M3", bits.shape, _const(bits))
    else:
        codes = np.ascontiguousarray(layer.codes, np.int8)
        weight = Pending("I8", codes.shape, _const(codes))
    scale = layer.scale if layer.scaled.strategy != "channel" else layer.scale.reshape(-1, 1)
    out = {f"{layer.name}.weight": weight,
           f"{layer.name}.weight_scale": _lazy(np.ascontiguousarray(scale, np.float32))}
    if layer.scaled.inputs == "static":
        out[f"{layer.name}.input_scale"] = _lazy(np.array([layer.scaled.input_scale], np.float32))
    if layer.scaled.input_zero_point:
        zp = np.array([layer.scaled.input_zero_point], np.int8)
        out[f"{layer.name}.input_zero_point"] = Pending("I8", (1,), _const(zp))
    return out


def _lazy(arr: np.ndarray) -> Pending:
    tags = {np.dtype(np.int32): "I32", np.dtype(np.int64): "I64", np.dtype(np.float32): "F32"}
    return Pending(tags[arr.dtype], arr.shape, _const(arr))


def _const(arr: np.ndarray) -> Callable[[], np.ndarray]:
    return lambda: arr


def _pack_int32(values: np.ndarray, bits: int) -> np.ndarray:
    """Signed `bits`-bit values [rows, cols] as int32 words along cols: each value offset by
    2^(bits - 1), 32 / bits to a word, the first in the lowest bits; cols padded with zeros to
    a multiple of 32 values, then the words cut to ceil(cols * bits / 32)."""
    rows, cols = values.shape
    per = 32 // bits
    u = (values + (1 << (bits - 1))).astype(np.uint64)
    padded = np.zeros((rows, -(-cols // 32) * 32), np.uint64)
    padded[:, :cols] = u
    words = padded.reshape(rows, -1, per) << (np.arange(per, dtype=np.uint64) * bits)
    packed = np.bitwise_or.reduce(words, axis=-1).astype(np.uint32).view(np.int32)
    return np.ascontiguousarray(packed[:, :math.ceil(cols * bits / 32)])


def _quantization_config(layers: list[Layer], ignore: list[str]
                         ) -> tuple[dict, dict[str, int]]:
    """config.json's quantization_config as llm-compressor writes it (QuantizationConfig's
    fields, quant_method "compressed-tensors", status "compressed"), and the group of each
    layer: layers of one bit width and symmetry share a config group, whose group_size divides
    every one of their periods (a finer group repeats a scale, which is exact)."""
    group_of: dict[str, int] = {}
    schemes: dict[tuple, list[Layer]] = {}
    for layer in layers:
        sc = layer.scaled
        key = (layer.bits, layer.symmetric) if sc is None else (
            8, sc.type, sc.strategy, sc.block or (), sc.inputs or "", sc.input_zero_point != 0)
        schemes.setdefault(key, []).append(layer)
    groups = {}
    for i, (key, members) in enumerate(sorted(schemes.items())):
        targets = ["Linear"] if len(schemes) == 1 else sorted(m.name for m in members)
        if len(key) > 2:  # fp8 or int8 w8a8, stored unpacked
            _, kind, strategy, block, inputs, zero_points = key
            args = {"num_bits": 8, "type": kind, "symmetric": True, "group_size": None,
                    "strategy": strategy, "block_structure": list(block) or None,
                    "dynamic": False}
            acts = None if not inputs else {
                "num_bits": 8, "type": kind, "symmetric": not zero_points, "group_size": None,
                "strategy": "tensor", "dynamic": inputs == "dynamic"}
            groups[f"group_{i}"] = {"targets": targets, "weights": args,
                                    "input_activations": acts, "output_activations": None,
                                    "format": FLOAT_QUANTIZED if kind == "float" else
                                    INT_QUANTIZED}
            continue
        bits, symmetric = key
        periods = [m.period for m in members]
        channel = all(p == m.codes.shape[1] for p, m in zip(periods, members))
        size = math.gcd(*periods)
        args = {"num_bits": bits, "type": "int", "symmetric": symmetric,
                "group_size": None if channel else size,
                "strategy": "channel" if channel else "group", "dynamic": False,
                "actorder": None, "block_structure": None, "observer": "minmax",
                "observer_kwargs": {}}
        group_of.update({m.name: m.codes.shape[1] if channel else size for m in members})
        groups[f"group_{i}"] = {"targets": targets, "weights": args,
                                "input_activations": None, "output_activations": None,
                                "format": PACK_QUANTIZED}
    formats = {g["format"] for g in groups.values()}
    return {"quant_method": "compressed-tensors",
            "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "quantization_status": "compressed", "config_groups": groups,
            "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None,
            "sparsity_config": {}, "transform_config": {}}, group_of
