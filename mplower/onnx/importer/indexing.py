"""ONNX import handlers: gathers."""

from __future__ import annotations

import onnx

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.onnx.importer.core import (
    _attrs,
    _Importer,
    handler,
)

# ---- indexing, masks and the rest of what transformer exporters emit --------------------------


@handler("Gather", "GatherElements")
def _gather(imp: _Importer, node: onnx.NodeProto) -> list:
    data, idx = imp.run_input(0), imp.run_input(1)
    op = "mp.gather" if node.op_type == "Gather" else "mp.gather_elements"
    axis = int(_attrs(node).get("axis", 0))
    return [imp.emit(op, [data, idx], {"axis": axis}, onnx_type=data.onnx_type)]


@handler("GatherND")
def _gather_nd(imp: _Importer, node: onnx.NodeProto) -> list:
    data, idx = imp.run_input(0), imp.run_input(1)
    attrs = {"batch_dims": int(_attrs(node).get("batch_dims", 0))}
    return [imp.emit("mp.gather_nd", [data, idx], attrs, onnx_type=data.onnx_type)]
