"""The com.microsoft operators of onnxruntime's transformer optimizer and quantization tools, and
the opset-23 transformer ops, imported and compared with onnxruntime's CPU kernels (fp32).

Every model is built here with onnx.helper, one node at a time (plus the real optimizer's output
on a small BERT-like graph at the end); every expected value comes from onnxruntime.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mplower.backend.executor import Program
from mplower.ir.diagnostics import DiagnosticError
from mplower.onnx.importer import import_model

ort = pytest.importorskip("onnxruntime")

F32, I32, I64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64
RTOL, ATOL = 1e-5, 1e-5
MS = "com.microsoft"


def build(op: str, inputs: list, n_out: int = 1, *, domain: str = MS, opset: int = 17,
          out_types: tuple[int, ...] = (), **attrs) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One node: `inputs` are (name, array, is_weight) or None (an absent optional input);
    weights become initializers, the rest graph inputs fed with their arrays."""
    names, args, inits, feeds = [], [], [], {}
    for item in inputs:
        if item is None:
            names.append("")
            continue
        name, arr, weight = item
        names.append(name)
        if weight:
            inits.append(numpy_helper.from_array(arr, name))
        else:
            args.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape))
            feeds[name] = arr
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, names, outs, domain=domain, **attrs)
    graph = helper.make_graph([node], "g", args,
                              [helper.make_tensor_value_info(o, t, None) for o, t in
                               zip(outs, out_types or (F32,) * n_out)], inits)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(MS, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=10), feeds


def onnxruntime(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def ours(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    shapes = {i.name: feeds[i.name].shape for i in model.graph.input}
    imp = import_model(model, "m.onnx", input_shapes=shapes, inline_weights=True)
    return Program(imp.module).run([feeds[n] for n in imp.inputs], reference=False).outputs


def declare(model: onnx.ModelProto, *shapes: tuple[int, ...]) -> onnx.ModelProto:
    """Output shapes declared, as a shared model declares them (onnx cannot infer a
    com.microsoft op's, and its checker wants them)."""
    for out, shape in zip(model.graph.output, shapes):
        out.type.tensor_type.shape.Clear()
        for d in shape:
            out.type.tensor_type.shape.dim.add().dim_value = d
    return model


def check(model: onnx.ModelProto, feeds: dict, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Our fp32 outputs against onnxruntime's: within rtol, or atol of the output's scale
    (sums that cancel keep only the absolute error of their largest terms)."""
    want = onnxruntime(model, feeds)
    declare(model, *(w.shape for w in want))
    got = ours(model, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        scale = max(1.0, float(np.max(np.abs(w)))) if w.size else 1.0
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * scale)


def rnd(*shape: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed + len(shape)).standard_normal(shape) * scale).astype(
        np.float32)


# ---- matrix products ---------------------------------------------------------------------------


@pytest.mark.parametrize(("ta", "tb", "tba", "tbb", "alpha"), [
    (0, 0, 0, 0, 1.0), (1, 0, 0, 0, 0.5), (0, 1, 0, 0, 2.0), (1, 1, 0, 0, 1.0),
    (0, 0, 1, 0, 1.0), (0, 1, 0, 1, 0.25), (1, 0, 1, 1, 1.0)])
def test_fused_matmul_transposes_and_scales_as_onnxruntime(ta, tb, tba, tbb, alpha):
    # Logical A (2, 3, 4, 5) and B (2, 3, 5, 6), stored as each flag says.
    a, b = rnd(2, 3, 4, 5, seed=1), rnd(2, 3, 5, 6, seed=2)
    if ta:
        a = a.swapaxes(-1, -2)
    if tba:
        a = np.moveaxis(a, -2, 0)
    if tb:
        b = b.swapaxes(-1, -2)
    if tbb:
        b = np.moveaxis(b, -2, 0)
    model, feeds = build("FusedMatMul", [("a", np.ascontiguousarray(a), False),
                                         ("b", np.ascontiguousarray(b), tb == 1)],
                         transA=ta, transB=tb, transBatchA=tba, transBatchB=tbb, alpha=alpha)
    check(model, feeds)


def _nbits_weights(n: int, k: int, block: int, bits: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    codes = rng.integers(0, 1 << bits, (n, blocks * block), dtype=np.uint8)
    per = 8 // bits
    grouped = codes.reshape(n, blocks, block // per, per).astype(np.uint16)
    packed = sum(grouped[..., i] << (bits * i) for i in range(per)).astype(np.uint8)
    scales = (rng.random((n, blocks)) * 0.1 + 0.01).astype(np.float32)
    zp_codes = rng.integers(0, 1 << bits, (n, blocks), dtype=np.uint8)
    zcols = -(-blocks * bits // 8)
    padded = np.zeros((n, zcols * per), np.uint16)
    padded[:, :blocks] = zp_codes
    zp = sum(padded.reshape(n, zcols, per)[..., i] << (bits * i) for i in range(per)).astype(
        np.uint8)
    return packed, scales, zp, codes[:, :k], zp_codes


@pytest.mark.parametrize(("bits", "k", "block", "with_zp", "with_bias"), [
    (4, 64, 32, True, False), (4, 48, 32, False, True), (4, 96, 16, True, True),
    (8, 64, 32, True, False), (8, 40, 16, False, True), (2, 64, 32, True, False),
    (2, 80, 16, False, True)])
def test_matmul_nbits_dequantizes_blocks_exactly(bits, k, block, with_zp, with_bias):
    n = 24
    packed, scales, zp, codes, zp_codes = _nbits_weights(n, k, block, bits)
    x = rnd(2, 3, k, seed=5)
    bias = rnd(n, seed=6)
    inputs = [("a", x, False), ("b", packed, True), ("scales", scales.reshape(-1), True),
              ("zp", zp.reshape(-1), True) if with_zp else None, None,
              ("bias", bias, True) if with_bias else None]
    while inputs[-1] is None:
        inputs.pop()
    model, feeds = build("MatMulNBits", inputs, K=k, N=n, bits=bits, block_size=block)
    check(model, feeds, rtol=1e-5, atol=1e-5)
    # The weight stays quantized in the module: one blocked mp.dequantize of 4-/8-bit codes.
    imp = import_model(model, "m.onnx", input_shapes={"a": x.shape}, inline_weights=True)
    f = imp.module.function()
    dq = [o for o in f.ops() if f.op(o) == "mp.dequantize"]
    assert len(dq) == 1
    (code_type,) = f.types(f.operands(dq[0])[0][0])
    assert code_type.elem == ("ui8" if bits == 8 else "i4") and code_type.shape == (k, n)
    assert f.attrs_of(dq[0])["block_size"] == block
    # Its values are (code - zero point) * scale: the product matches numpy's in f64.
    zp_full = zp_codes if with_zp else np.full_like(zp_codes, 1 << (bits - 1))
    w = (codes.astype(np.float64) - np.repeat(zp_full, block, 1)[:, :k]) * np.repeat(
        scales, block, 1)[:, :k]
    want = x.astype(np.float64) @ w.T + (bias if with_bias else 0)
    got = Program(imp.module).run([x], reference=False).outputs[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_matmul_nbits_refuses_bit_widths_onnxruntime_does_not_take():
    packed, scales, _, _, _ = _nbits_weights(8, 32, 16, 4)
    model, _ = build("MatMulNBits", [("a", rnd(1, 32), False), ("b", packed, True),
                                     ("scales", scales.reshape(-1), True)],
                     K=32, N=8, bits=3, block_size=16)
    declare(model, (1, 8))
    with pytest.raises(DiagnosticError, match="bits = 3"):
        import_model(model, "m.onnx")


# ---- normalizations and activations -----------------------------------------------------------


@pytest.mark.parametrize("with_beta", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_skip_layer_norm_and_its_sum_output(with_beta, with_bias):
    h = 16
    inputs = [("x", rnd(2, 5, h, seed=1), False), ("skip", rnd(2, 5, h, seed=2), False),
              ("gamma", rnd(h, seed=3), True),
              ("beta", rnd(h, seed=4), True) if with_beta else None,
              ("bias", rnd(h, seed=5), True) if with_bias else None]
    while inputs[-1] is None:
        inputs.pop()
    model, feeds = build("SkipLayerNormalization", inputs, n_out=4, epsilon=1e-5)
    node = model.graph.node[0]
    node.output[1], node.output[2] = "", ""  # the training outputs, unused
    del model.graph.output[1:3]
    check(model, feeds)


def test_skip_simplified_layer_norm_with_a_broadcast_skip():
    h = 8
    model, feeds = build("SkipSimplifiedLayerNormalization",
                         [("x", rnd(3, 4, h, seed=1), False), ("skip", rnd(4, h, seed=2), False),
                          ("gamma", rnd(h, seed=3), True), ("bias", rnd(h, seed=4), True)],
                         epsilon=1e-6)
    check(model, feeds)


def test_simplified_layer_norm_in_the_default_domain():
    """onnxruntime registers SimplifiedLayerNormalization in the default domain (its optimizer
    writes it there), where onnx's checker knows no such op: the importer takes it anyway."""
    model, feeds = build("SimplifiedLayerNormalization", [("x", rnd(2, 3, 8), False),
                                                          ("scale", rnd(8, seed=7), True)],
                         domain="", axis=-1, epsilon=1e-5)
    check(model, feeds)


def test_rms_normalization_opset_23_matches_onnxruntime():
    model, feeds = build("RMSNormalization", [("x", rnd(2, 3, 8), False),
                                              ("scale", rnd(3, 8, seed=7), True)],
                         domain="", opset=23, axis=1, epsilon=1e-4)
    check(model, feeds)


@pytest.mark.parametrize(("op", "extra", "attrs"), [
    ("Gelu", False, {}), ("BiasGelu", True, {}), ("FastGelu", False, {}), ("FastGelu", True, {}),
    ("QuickGelu", False, {}), ("QuickGelu", False, {"alpha": 1.2})])
def test_gelu_family(op, extra, attrs):
    inputs = [("x", rnd(2, 6, 16, scale=2.0), False)]
    if extra:
        inputs.append(("bias", rnd(16, seed=3), True))
    model, feeds = build(op, inputs, **attrs)
    check(model, feeds, rtol=1e-5, atol=2e-6)


def test_bias_add_and_bias_split_gelu_as_their_schemas_define():
    """onnxruntime runs these two on CUDA only: checked against their schema's formulas."""
    x, bias, skip = rnd(2, 4, 8), rnd(8, seed=1), rnd(2, 4, 8, seed=2)
    model, feeds = build("BiasAdd", [("x", x, False), ("bias", bias, True),
                                     ("skip", skip, False)])
    declare(model, x.shape)
    np.testing.assert_array_equal(ours(model, feeds)[0], (x + bias) + skip)
    x, bias = rnd(2, 4, 16), rnd(16, seed=1)
    model, feeds = build("BiasSplitGelu", [("x", x, False), ("bias", bias, True)])
    declare(model, (2, 4, 8))
    t = (x + bias).astype(np.float64)
    right = t[..., 8:]
    gelu = 0.5 * right * (1 + np.vectorize(math.erf)(right / math.sqrt(2)))
    np.testing.assert_allclose(ours(model, feeds)[0], t[..., :8] * gelu, rtol=1e-6, atol=1e-6)


def test_embed_layer_norm_with_segments_and_mask_index():
    b, s, h, vocab = 2, 6, 8, 20
    rng = np.random.default_rng(3)
    ids = rng.integers(0, vocab, (b, s)).astype(np.int32)
    seg = (np.arange(s) >= 3).astype(np.int32)[None].repeat(b, 0)
    mask = np.ones((b, s), np.int32)
    mask[1, 4:] = 0
    model, feeds = build("EmbedLayerNormalization", [
        ("ids", ids, False), ("seg", seg, False), ("word", rnd(vocab, h, seed=1), True),
        ("pos", rnd(s, h, seed=2), True), ("segemb", rnd(2, h, seed=3), True),
        ("gamma", rnd(h, seed=4), True), ("beta", rnd(h, seed=5), True),
        ("mask", mask, False)], n_out=3, out_types=(F32, I32, F32), epsilon=1e-5)
    check(model, feeds)


# ---- rotary embeddings ------------------------------------------------------------------------


def _caches(max_pos: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    freqs = np.outer(np.arange(max_pos), 1.0 / 10000 ** (np.arange(half) / half))
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rot", [0, 4])
def test_rotary_embedding_com_microsoft(rank, interleaved, rot):
    b, s, n, d = 2, 5, 2, 8
    x = rnd(b, s, n * d) if rank == 3 else rnd(b, n, s, d)
    cos, sin = _caches(16, (rot or d) // 2)
    pos = np.array([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]], np.int64)
    attrs = {"interleaved": interleaved}
    if rot:
        attrs.update(rotary_embedding_dim=rot, num_heads=n)
    elif rank == 3:
        attrs["num_heads"] = n
    model, feeds = build("RotaryEmbedding", [("x", x, False), ("pos", pos, False),
                                             ("cos", cos, True), ("sin", sin, True)], **attrs)
    check(model, feeds)


def test_rotary_embedding_com_microsoft_position_offset():
    x = rnd(2, 4, 16)
    cos, sin = _caches(12, 4)
    model, feeds = build("RotaryEmbedding", [("x", x, False),
                                             ("pos", np.array([3], np.int64), True),
                                             ("cos", cos, True), ("sin", sin, True)], num_heads=2)
    check(model, feeds)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding_opset_23_partial_with_position_ids(interleaved):
    b, n, s, d = 2, 2, 5, 8
    cos, sin = _caches(16, 2)
    pos = np.array([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]], np.int64)
    model, feeds = build("RotaryEmbedding", [("x", rnd(b, n, s, d), False),
                                             ("cos", cos, True), ("sin", sin, True),
                                             ("pos", pos, False)],
                         domain="", opset=23, interleaved=interleaved, rotary_embedding_dim=4)
    check(model, feeds)


# ---- attention ----------------------------------------------------------------------------------


@pytest.mark.parametrize("unidirectional", [0, 1])
@pytest.mark.parametrize("mask", [None, "2d", "1d", "3d_with_bias"])
def test_com_microsoft_attention(unidirectional, mask):
    b, s, hin, heads, hidden = 2, 5, 12, 2, 8
    inputs = [("x", rnd(b, s, hin), False), ("w", rnd(hin, 3 * hidden, seed=1, scale=0.3), True),
              ("bias", rnd(3 * hidden, seed=2, scale=0.1), True)]
    if mask == "2d":
        m = np.ones((b, s), np.int32)
        m[1, 3:] = 0
        inputs.append(("mask", m, False))
    elif mask == "1d":
        inputs.append(("mask", np.array([5, 3], np.int32), False))
    elif mask == "3d_with_bias":
        m = (np.random.default_rng(4).random((b, s, s)) > 0.3).astype(np.int32)
        m[..., 0] = 1
        inputs += [("mask", m, False), None, ("attn_bias", rnd(1, heads, s, s, seed=5), False)]
    model, feeds = build("Attention", inputs, num_heads=heads, unidirectional=unidirectional)
    check(model, feeds)


def test_com_microsoft_attention_with_past_and_present():
    b, s, past, hin, heads, hidden = 1, 1, 4, 8, 2, 8
    inputs = [("x", rnd(b, s, hin), False), ("w", rnd(hin, 3 * hidden, seed=1, scale=0.3), True),
              ("bias", rnd(3 * hidden, seed=2, scale=0.1), True), None,
              ("past", rnd(2, b, heads, past, hidden // heads, seed=3), False)]
    model, feeds = build("Attention", inputs, n_out=2, num_heads=heads, unidirectional=1)
    check(model, feeds)


@pytest.mark.parametrize("form", ["separate", "bnsh_kv"])
def test_multi_head_attention_forms(form):
    b, s, l, heads, d = 2, 4, 6, 2, 4
    h = heads * d
    if form == "bnsh_kv":
        inputs = [("q", rnd(b, s, h), False), ("k", rnd(b, heads, l, d, seed=1), False),
                  ("v", rnd(b, heads, l, d, seed=2), False)]
    else:
        m = np.ones((b, l), np.int32)
        m[0, 4:] = 0
        inputs = [("q", rnd(b, s, h), False), ("k", rnd(b, l, h, seed=1), False),
                  ("v", rnd(b, l, h, seed=2), False), ("bias", rnd(3 * h, seed=3), True),
                  ("mask", m, False), ("attn_bias", rnd(1, heads, s, l, seed=4), False)]
    model, feeds = build("MultiHeadAttention", inputs, num_heads=heads)
    check(model, feeds)


def test_multi_head_attention_packed_forms_equal_the_separate_one():
    """onnxruntime's CPU kernel has no packed QKV or KV: ours against its separate form."""
    b, s, heads, d = 2, 4, 2, 4
    packed = rnd(b, s, heads, 3, d)
    q, k, v = (np.ascontiguousarray(packed[:, :, :, i]).reshape(b, s, heads * d)
               for i in range(3))
    separate, feeds = build("MultiHeadAttention", [("q", q, False), ("k", k, False),
                                                   ("v", v, False)], num_heads=heads)
    want = onnxruntime(separate, feeds)[0]
    model, pfeeds = build("MultiHeadAttention", [("q", packed, False)], num_heads=heads)
    np.testing.assert_allclose(ours(declare(model, want.shape), pfeeds)[0], want, rtol=1e-5,
                               atol=1e-6)
    kv = np.ascontiguousarray(packed[:, :, :, 1:])
    model, pfeeds = build("MultiHeadAttention", [("q", q, False), ("kv", kv, False)],
                          num_heads=heads)
    np.testing.assert_allclose(ours(declare(model, want.shape), pfeeds)[0], want, rtol=1e-5,
                               atol=1e-6)


def test_multi_head_attention_decode_step_with_cache():
    b, heads, d, past = 2, 2, 4, 3
    h = heads * d
    inputs = [("q", rnd(b, 1, h), False), ("k", rnd(b, 1, h, seed=1), False),
              ("v", rnd(b, 1, h, seed=2), False), None, None, None,
              ("pk", rnd(b, heads, past, d, seed=3), False),
              ("pv", rnd(b, heads, past, d, seed=4), False)]
    model, feeds = build("MultiHeadAttention", inputs, n_out=3, num_heads=heads,
                         unidirectional=1)
    check(model, feeds)


def _gqa(b, s, past, heads, kv_heads, d, *, rotary=False, window=-1, softcap=0.0, packed=False,
         bias=False, sink=False, smooth=False):
    q = rnd(b, s, heads * d)
    k, v = rnd(b, s, kv_heads * d, seed=1), rnd(b, s, kv_heads * d, seed=2)
    inputs = [("q", np.concatenate([q, k, v], -1), False), None, None] if packed else \
        [("q", q, False), ("k", k, False), ("v", v, False)]
    if past:
        inputs += [("pk", rnd(b, kv_heads, past, d, seed=3), False),
                   ("pv", rnd(b, kv_heads, past, d, seed=4), False)]
    else:
        inputs += [None, None]
    inputs += [("seqlens", np.full(b, past + s - 1, np.int32), True),
               ("total", np.array(past + s, np.int32), True)]
    attrs = {"num_heads": heads, "kv_num_heads": kv_heads, "local_window_size": window}
    if softcap:
        attrs["softcap"] = softcap
    if rotary:
        cos, sin = _caches(32, d // 2)
        inputs += [("cos", cos, True), ("sin", sin, True)]
        attrs.update(do_rotary=1)
    if bias:
        inputs += [None] * (10 - len(inputs)) + [("attn_bias", rnd(b, 1, s, past + s, seed=9),
                                                  False)]
    if sink:
        inputs += [None] * (11 - len(inputs)) + [("sink", rnd(heads, seed=10), True)]
    if smooth:
        attrs["smooth_softmax"] = 1
    return build("GroupQueryAttention", inputs, n_out=3, **attrs)


@pytest.mark.parametrize(("s", "past"), [(5, 0), (1, 6), (3, 4)])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_group_query_attention_prompt_and_decode(s, past, kv_heads):
    if past and s > 1:
        model, feeds = _gqa(1, s, past, 4, kv_heads, 8)  # onnxruntime: S > 1 with past, B = 1
    else:
        model, feeds = _gqa(2, s, past, 4, kv_heads, 8)
    check(model, feeds)


@pytest.mark.parametrize("option", ["rotary", "window", "softcap", "packed", "bias", "sink",
                                    "smooth"])
def test_group_query_attention_options(option):
    kwargs = {"rotary": {"rotary": True}, "window": {"window": 3}, "softcap": {"softcap": 2.0},
              "packed": {"packed": True}, "bias": {"bias": True}, "sink": {"sink": True},
              "smooth": {"smooth": True}}[option]
    d = 16 if option == "rotary" else 8  # onnxruntime rotates head sizes in multiples of 16
    model, feeds = _gqa(2, 6, 0, 4, 2, d, **kwargs)
    check(model, feeds)
    model, feeds = _gqa(2, 1, 5, 4, 2, d, **kwargs)
    check(model, feeds)


def test_group_query_attention_refuses_ragged_seqlens_with_the_reason():
    model, _ = _gqa(2, 1, 5, 4, 2, 8)
    seq = next(t for t in model.graph.initializer if t.name == "seqlens")
    seq.CopyFrom(numpy_helper.from_array(np.array([5, 3], np.int32), "seqlens"))
    declare(model, (2, 1, 32), (2, 2, 6, 8), (2, 2, 6, 8))
    with pytest.raises(DiagnosticError, match=r"seqlens_k \[5, 3\].*ragged batch"):
        import_model(model, "m.onnx")


# ---- onnxruntime's transformer optimizer, on models built here ---------------------------------


def _rms_residual_model(h: int = 16) -> onnx.ModelProto:
    """Two RMSNorms as Llama's code writes them (x * 1 / sqrt(mean(x^2) + eps) * w), the second
    after a residual add: what the optimizer fuses into SimplifiedLayerNormalization and
    SkipSimplifiedLayerNormalization."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []

    def init(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def rms(x, i):
        nodes.extend([
            helper.make_node("Pow", [x, init(f"two{i}", 2.0)], [f"sq{i}"]),
            helper.make_node("ReduceMean", [f"sq{i}"], [f"ms{i}"], axes=[-1], keepdims=1),
            helper.make_node("Add", [f"ms{i}", init(f"eps{i}", 1e-6)], [f"mse{i}"]),
            helper.make_node("Sqrt", [f"mse{i}"], [f"rt{i}"]),
            helper.make_node("Div", [init(f"one{i}", 1.0), f"rt{i}"], [f"inv{i}"]),
            helper.make_node("Mul", [x, f"inv{i}"], [f"nx{i}"]),
            helper.make_node("Mul", [init(f"g{i}", 1 + 0.1 * rng.standard_normal(h)), f"nx{i}"],
                             [f"rms{i}"])])
        return f"rms{i}"

    nodes.append(helper.make_node("MatMul", [rms("x", 0), init("w0", rng.standard_normal(
        (h, h)) * 0.3)], ["mm0"]))
    nodes.append(helper.make_node("Add", ["x", "mm0"], ["res0"]))
    nodes.append(helper.make_node("MatMul", [rms("res0", 1), init("w1", rng.standard_normal(
        (h, h)) * 0.3)], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, [2, 5, h])],
                              [helper.make_tensor_value_info("y", F32, [2, 5, h])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _bert_attention_model(b: int = 2, s: int = 8, h: int = 16, heads: int = 2,
                          layers: int = 2) -> onnx.ModelProto:
    """BERT encoder layers in the pattern onnxruntime's FusionAttention matches (the classic
    export: per-head Reshape/Transpose of Q, K (transposed to 0,2,3,1) and V, Div by sqrt(d),
    the -10000 padding mask from Unsqueeze/Cast/Sub/Mul, residual Add + LayerNormalization)."""
    rng = np.random.default_rng(0)
    d = h // heads
    nodes, inits = [], []

    def init(name, value, dtype=np.float32):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def op(kind, ins, **attrs):
        out = f"{kind}_{len(nodes)}"
        nodes.append(helper.make_node(kind, ins, [out], name=out, **attrs))
        return out

    def linear(x, name):
        w = op("MatMul", [x, init(f"{name}_w", rng.standard_normal((h, h)) * 0.3)])
        return op("Add", [w, init(f"{name}_b", rng.standard_normal(h) * 0.05)])

    def norm(x, name):
        return op("LayerNormalization", [x, init(f"{name}_g", 1 + 0.1 * rng.standard_normal(h)),
                                         init(f"{name}_b", 0.1 * rng.standard_normal(h))],
                  axis=-1, epsilon=1e-12)

    m = op("Unsqueeze", ["attention_mask", init("ax1", [1], np.int64)])
    m = op("Cast", [op("Unsqueeze", [m, init("ax2", [2], np.int64)])], to=F32)
    mask = op("Mul", [op("Sub", [init("one", 1.0), m]), init("neg", -10000.0)])
    x = norm("x", "ln0")
    heads4, merged = init("heads4", [0, 0, heads, d], np.int64), init("merged", [0, 0, h], np.int64)
    for i in range(layers):
        q = op("Transpose", [op("Reshape", [linear(x, f"q{i}"), heads4])], perm=[0, 2, 1, 3])
        k = op("Transpose", [op("Reshape", [linear(x, f"k{i}"), heads4])], perm=[0, 2, 3, 1])
        v = op("Transpose", [op("Reshape", [linear(x, f"v{i}"), heads4])], perm=[0, 2, 1, 3])
        scores = op("Div", [op("MatMul", [q, k]), init(f"sqrt{i}", np.sqrt(d))])
        probs = op("Softmax", [op("Add", [scores, mask])], axis=3)
        ctx = op("Transpose", [op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        x = norm(op("Add", [linear(op("Reshape", [ctx, merged]), f"o{i}"), x]), f"ln{i + 1}")
    graph = helper.make_graph(nodes, "bert", [
        helper.make_tensor_value_info("x", F32, [b, s, h]),
        helper.make_tensor_value_info("attention_mask", I64, [b, s])],
        [helper.make_tensor_value_info(x, F32, [b, s, h])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _optimized(model: onnx.ModelProto, model_type: str, heads: int, hidden: int,
               path) -> onnx.ModelProto:
    """The optimizer's output file, as users share it."""
    optimizer = pytest.importorskip("onnxruntime.transformers.optimizer")
    # opt_level 0: the Python fusions only (onnxruntime's own graph passes need torch here).
    optimizer.optimize_model(model, model_type=model_type, num_heads=heads, hidden_size=hidden,
                             opt_level=0).save_model_to_file(str(path))
    return onnx.load(str(path))


@pytest.mark.parametrize(("name", "fused"), [
    ("bert", {"com.microsoft:SkipLayerNormalization", "com.microsoft:BiasGelu"}),
    ("gpt2", {"com.microsoft:SkipLayerNormalization", "com.microsoft:FastGelu"}),
    ("rms", {":SimplifiedLayerNormalization", "com.microsoft:SkipSimplifiedLayerNormalization"}),
    ("bert_attention", {"com.microsoft:Attention", "com.microsoft:SkipLayerNormalization"})])
def test_models_after_onnxruntimes_transformer_optimizer_import_and_match(name, fused, tmp_path):
    if name == "rms":
        model, hidden, heads = _rms_residual_model(), 16, 2
        x = {"x": rnd(2, 5, 16)}
    elif name == "bert_attention":
        model, hidden, heads = _bert_attention_model(), 16, 2
        mask = np.ones((2, 8), np.int64)
        mask[1, 5:] = 0  # right padding, which the fused Attention's mask_index (lengths) assumes
        x = {"x": rnd(2, 8, 16), "attention_mask": mask}
    else:
        import test_onnx_transformers as tt

        model, hidden, heads = tt.MODELS[name](), tt.H, tt.HEADS
        for i in model.graph.input:  # the optimizer wants static shapes to fuse
            i.type.tensor_type.shape.Clear()
            for d in (tt.B, tt.S):
                i.type.tensor_type.shape.dim.add().dim_value = d
        x = tt.feeds(model)
    before = onnxruntime(model, x)[0]
    opt = _optimized(model, "gpt2" if name == "gpt2" else "bert", heads, hidden,
                     tmp_path / "opt.onnx")
    ops = {f"{n.domain}:{n.op_type}" for n in opt.graph.node}
    assert fused <= ops
    want = onnxruntime(opt, x)[0]
    np.testing.assert_allclose(want, before, rtol=1e-5, atol=1e-5)
    got = ours(declare(opt, want.shape), x)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1, np.abs(want).max()))


# ---- plans of the lowered fusions: precision per part, export ----------------------------------


def _lowered(model, feeds, pipeline):
    from mplower.pass_manager import PassContext, PassManager, parse_pipeline

    shapes = {i.name: feeds[i.name].shape for i in model.graph.input}
    imp = import_model(model, "m.onnx", input_shapes=shapes, inline_weights=True)
    PassManager(parse_pipeline(pipeline)).run(imp.module, PassContext())
    return imp


@pytest.mark.parametrize("case", ["gqa", "nbits", "skip_rms"])
def test_lowered_fusions_get_a_precision_per_part_and_export_to_onnxruntime(case):
    from mplower.onnx.exporter.core import export_module

    if case == "gqa":
        model, feeds = _gqa(2, 6, 0, 4, 2, 8)
    elif case == "nbits":
        packed, scales, zp, _, _ = _nbits_weights(24, 64, 32, 4)
        model, feeds = build("MatMulNBits", [("a", rnd(2, 3, 64), False), ("b", packed, True),
                                             ("scales", scales.reshape(-1), True),
                                             ("zp", zp.reshape(-1), True)],
                             K=64, N=24, bits=4, block_size=32)
    else:
        model, feeds = build("SkipSimplifiedLayerNormalization", [
            ("x", rnd(3, 4, 8), False), ("skip", rnd(3, 4, 8, seed=2), False),
            ("gamma", rnd(8, seed=3), True)], epsilon=1e-6)
    wants = onnxruntime(model, feeds)
    want = wants[0]
    declare(model, *(w.shape for w in wants))
    imp = _lowered(model, feeds, "assign-precision{policy=bf16},insert-casts")
    program = Program(imp.module)
    result = program.run([feeds[n] for n in imp.inputs])
    executed = {(s.op, s.executed["precision"]) for s in program.steps}
    if case == "skip_rms":
        # Two ops, two decisions: the residual add (follows its f32 inputs) and the norm (kept
        # f32, as the sheet keeps norms).
        assert {("mp.add", "f32"), ("mp.rms_norm", "f32")} <= executed
    else:
        assert ("mp.matmul", "bf16") in executed and ("mp.matmul", "f32") not in executed
    if case == "gqa":
        assert ("mp.softmax", "f32") in executed
    rel = np.linalg.norm(result.outputs[0] - want) / np.linalg.norm(want)
    assert rel < 1e-2
    exported = export_module(imp.module).model
    so = ort.SessionOptions()
    # onnxruntime would fuse the exported DequantizeLinear + MatMul into its own MatMulNBits,
    # which quantizes the activations to int8 (accuracy level 4): not the plan's numbers.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(exported.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    names = [i.name for i in exported.graph.input]
    theirs = sess.run(None, {n: feeds[m] for n, m in zip(names, imp.inputs)})[0]
    np.testing.assert_allclose(theirs, result.outputs[0], rtol=0, atol=1e-6)


def test_group_query_attention_refuses_runtime_seqlens_naming_the_inputs():
    model, _ = _gqa(2, 1, 5, 4, 2, 8)
    graph = model.graph
    seq = next(t for t in graph.initializer if t.name == "seqlens")
    graph.initializer.remove(seq)
    graph.input.append(helper.make_tensor_value_info("seqlens", I32, [2]))
    declare(model, (2, 1, 32), (2, 2, 6, 8), (2, 2, 6, 8))
    with pytest.raises(DiagnosticError, match=r"seqlens_k \('seqlens'\) is computed at run time "
                                              r"\(from graph input\(s\) 'seqlens'\)"):
        import_model(model, "m.onnx")


# ---- ONNX Attention (opset 23) beside onnxruntime, and through int8 calibration ----------------


def _onnx_attention(mask_kind: str):
    b, heads, kv_heads, s, d = 2, 4, 2, 6, 8
    inputs = [("q", rnd(b, heads, s, d), False), ("k", rnd(b, kv_heads, s, d, seed=1), False),
              ("v", rnd(b, kv_heads, s, d, seed=2), False)]
    if mask_kind == "bool":
        m = np.ones((b, 1, s, s), np.bool_)  # onnxruntime wants the query axis spelled out
        m[1, ..., 4:] = False  # padding at the end of the second sequence
        inputs.append(("mask", m, False))
    elif mask_kind == "float":
        inputs.append(("mask", rnd(b, 1, s, s, seed=3), False))
    return build("Attention", inputs, domain="", opset=23, is_causal=1)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_onnx_attention_gqa_causal_matches_onnxruntime(mask_kind):
    model, feeds = _onnx_attention(mask_kind)
    check(model, feeds)


def test_onnx_attention_masks_hold_no_infinity_so_int8_calibration_runs(tmp_path):
    """Masked keys get the lowest finite float through mp.where (the fill the sheets know),
    never -inf: calibration, which refuses infinities, runs over every intermediate."""
    from mplower.backend.executor import reference_runner
    from mplower.pass_manager import PassContext, PassManager, parse_pipeline

    model, feeds = _onnx_attention("bool")
    want = onnxruntime(model, feeds)[0]
    declare(model, want.shape)
    np.savez(tmp_path / "calib.npz", **feeds)
    imp = import_model(model, "m.onnx", input_shapes={k: v.shape for k, v in feeds.items()},
                       inline_weights=True)
    inter = Program(imp.module).run([feeds[n] for n in imp.inputs], reference=False)
    assert np.array_equal(inter.outputs[0], inter.outputs[0])  # no NaN
    pipeline = f"assign-precision{{policy=int8}},calibrate{{data={tmp_path / 'calib.npz'}}}," \
               f"quantize,insert-casts"
    PassManager(parse_pipeline(pipeline)).run(imp.module, PassContext(runner=reference_runner))
    result = Program(imp.module).run([feeds[n] for n in imp.inputs])
    assert sum(r.counts.nan for r in result.ops) == 0
    rel = np.linalg.norm(result.outputs[0] - want) / np.linalg.norm(want)
    assert rel < 0.1


# ---- a decoder step as onnxruntime-genai's model builder writes it ------------------------------


def _llm_decode_step(past: int = 5, s: int = 1, b: int = 1) -> tuple[onnx.ModelProto, dict]:
    """One Llama-style block over `s` new tokens with a KV cache of `past`: embedding Gather,
    SimplifiedLayerNormalization, 4-bit MatMulNBits projections, GroupQueryAttention with rotary
    embeddings and GQA heads, SkipSimplifiedLayerNormalization, a SwiGLU MLP (Sigmoid, Mul) and
    the lm head; past/present keys and values as graph inputs and outputs."""
    rng = np.random.default_rng(7)
    vocab, h, heads, kv_heads, d, ffn, block = 32, 64, 4, 2, 16, 64, 32
    nodes, inits = [], []

    def init(name, value, dtype=np.float32):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def node(kind, ins, outs, domain="", **attrs):
        nodes.append(helper.make_node(kind, ins, outs, name=outs[0], domain=domain, **attrs))
        return outs[0]

    def nbits(x, name, k, n):
        packed, scales, zp, _, _ = _nbits_weights(n, k, block, 4, seed=len(nodes))
        return node("MatMulNBits", [x, init(f"{name}_q", packed, np.uint8),
                                    init(f"{name}_s", scales.reshape(-1)),
                                    init(f"{name}_z", zp.reshape(-1), np.uint8)], [name], MS,
                    K=k, N=n, bits=4, block_size=block)

    def gamma(name):
        return init(name, 1 + 0.1 * rng.standard_normal(h))

    x = node("Gather", [init("embed", rng.standard_normal((vocab, h)) * 0.5), "input_ids"],
             ["embed_out"])
    hn = node("SimplifiedLayerNormalization", [x, gamma("ln1")], ["ln1_out"], axis=-1,
              epsilon=1e-5)
    qkv = nbits(hn, "qkv", h, (heads + 2 * kv_heads) * d)
    cos, sin = _caches(64, d // 2)
    node("GroupQueryAttention", [qkv, "", "", "past_key", "past_value", init(
        "seqlens_k", np.full(b, past + s - 1), np.int32), init("total", past + s, np.int32),
        init("cos", cos), init("sin", sin)], ["attn", "present_key", "present_value"], MS,
        num_heads=heads, kv_num_heads=kv_heads, do_rotary=1)
    o = nbits("attn", "o_proj", heads * d, h)
    node("SkipSimplifiedLayerNormalization", [o, x, gamma("ln2")],
         ["ln2_out", "", "", "resid"], MS, epsilon=1e-5)
    gate, up = nbits("ln2_out", "gate", h, ffn), nbits("ln2_out", "up", h, ffn)
    silu = node("Mul", [gate, node("Sigmoid", [gate], ["gate_sig"])], ["silu"])
    down = nbits(node("Mul", [silu, up], ["swiglu"]), "down", ffn, h)
    node("SkipSimplifiedLayerNormalization", [down, "resid", gamma("lnf")], ["final"], MS,
         epsilon=1e-5)
    nbits("final", "logits", h, vocab)
    cache = [b, kv_heads, past, d]
    graph = helper.make_graph(nodes, "llm", [
        helper.make_tensor_value_info("input_ids", I64, [b, s]),
        helper.make_tensor_value_info("past_key", F32, cache),
        helper.make_tensor_value_info("past_value", F32, cache)], [
        helper.make_tensor_value_info("logits", F32, [b, s, vocab]),
        helper.make_tensor_value_info("present_key", F32, [b, kv_heads, past + s, d]),
        helper.make_tensor_value_info("present_value", F32, [b, kv_heads, past + s, d])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(MS, 1)], ir_version=10)
    feeds = {"input_ids": rng.integers(0, vocab, (b, s)).astype(np.int64),
             "past_key": rnd(*cache, seed=11), "past_value": rnd(*cache, seed=12)}
    return model, feeds


@pytest.mark.parametrize(("past", "s", "b"), [(5, 1, 2), (0, 6, 2), (4, 3, 1)])
def test_llm_block_as_the_genai_builder_writes_it_matches_onnxruntime(past, s, b):
    """past = 0 is the prompt step: empty caches (B, kv_heads, 0, D), as the builder feeds
    its first step."""
    model, feeds = _llm_decode_step(past, s, b)
    check(model, feeds, rtol=1e-4, atol=1e-5)


# ---- malformed contrib nodes: onnx's checker knows no com.microsoft schema, so the handlers check

@pytest.mark.parametrize(("op", "inputs", "attrs", "message"), [
    ("MatMulNBits", [("a", rnd(1, 32), False), ("b", np.zeros((8, 2, 8), np.uint8), True),
                     ("scales", np.ones(16, np.float32), True)], {"K": 32, "N": 8},
     "attribute 'block_size' is required"),
    ("MatMulNBits", [("a", rnd(1, 32), False), ("b", np.zeros((8, 2, 8), np.uint8), True),
                     ("scales", np.ones(15, np.float32), True)],
     {"K": 32, "N": 8, "block_size": 16}, r"scales \(15 values\)"),
    ("MultiHeadAttention", [("q", rnd(1, 2, 8), False), ("k", rnd(1, 2, 8), False),
                            ("v", rnd(1, 2, 8), False)], {}, "attribute 'num_heads' is required"),
    ("MultiHeadAttention", [("q", rnd(1, 2, 8), False), ("k", rnd(1, 2, 3, 4), False),
                            ("v", rnd(1, 3, 8), False)], {"num_heads": 2}, "must be 4-D"),
    ("GroupQueryAttention", [("q", rnd(1, 2, 2, 8), False)], {"num_heads": 2, "kv_num_heads": 1},
     "query must be 3-D"),
    ("Attention", [("x", rnd(1, 2, 8), False), ("w", rnd(8, 24), True), None, None,
                   ("past", rnd(2, 1, 2, 4), False)], {"num_heads": 2}, r"past must be \(2, B"),
])
def test_malformed_contrib_nodes_are_located_errors(op, inputs, attrs, message):
    model, _ = build(op, inputs, **attrs)
    declare(model, (1, 2, 8))
    with pytest.raises(DiagnosticError, match=message) as e:
        import_model(model, "m.onnx")
    assert f"(com.microsoft::{op})" in str(e.value)


def test_default_domain_simplified_layer_norm_counts_as_supported():
    from mplower.onnx.importer import unsupported_ops

    model, _ = build("SimplifiedLayerNormalization", [("x", rnd(2, 8), False),
                                                      ("scale", rnd(8), True)], domain="")
    assert not unsupported_ops(model.graph)


@pytest.mark.parametrize(("past", "s"), [(0, 6), (5, 1)])
def test_group_query_attention_rotary_position_ids_as_onnxruntime_reads_them(past, s):
    """A first prompt rotates by the first position id + 0, 1, ... (onnxruntime reads
    position_ids[0, 0] for every sequence); a decode step by the ids as given. Irregular ids
    tell the readings apart."""
    model, feeds = _gqa(2, s, past, 4, 2, 16, rotary=True)
    model.graph.node[0].input.append("pos")
    pos = np.array([[3, 9, 1, 4, 0, 2], [7, 2, 5, 0, 1, 3]], np.int64)[:, :s]
    model.graph.input.append(helper.make_tensor_value_info("pos", I64, pos.shape))
    feeds["pos"] = pos
    check(model, feeds)
