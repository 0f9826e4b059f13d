"""onnxruntime's ops written into the default domain, moved to the domain that imports them."""

from __future__ import annotations

import onnx
from onnx import helper

# Ops that onnxruntime registers in the default domain though onnx has no such op (its
# SimplifiedLayerNormalization), each with the domain whose handler imports it. Handler modules
# fill it; such nodes move there before onnx's checker (which rejects them) sees the model.
CONTRIB_DEFAULT_DOMAIN: dict[str, str] = {}


def _domain(node: onnx.NodeProto) -> str:
    """The node's domain, or for an onnxruntime op in the default domain the one that imports
    it."""
    if node.domain in ("", "ai.onnx") and node.op_type in CONTRIB_DEFAULT_DOMAIN \
            and not onnx.defs.has(node.op_type):
        return CONTRIB_DEFAULT_DOMAIN[node.op_type]
    return node.domain


def _move_contrib_ops(model: onnx.ModelProto) -> None:
    domains = set()
    for n in model.graph.node:
        if _domain(n) != n.domain:
            n.domain = _domain(n)
            domains.add(n.domain)
    for d in domains - {o.domain for o in model.opset_import}:
        model.opset_import.append(helper.make_opsetid(d, 1))
