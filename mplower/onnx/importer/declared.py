"""What a model declares about shapes, read as exporters mean it.

Exporters write "any size" in several ways: a symbolic `dim_param`, no value, -1 (and 0 on
outputs), so a classifier's output declared `[-1, 2]` states nothing that a computed `[64, 2]`
contradicts. One symbol is one size across the graph, so an input given with `--input-shape`
sizes every other input that shares its symbols. And where onnx's own shape inference or checker
cannot handle an op that models still hold, the importer's walk of `core` checks a stand-in.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from mplower.ir.diagnostics import DiagnosticError, Location


def dim_known(d: onnx.TensorShapeProto.Dimension) -> bool:
    """A fixed size; -1 (and a dim_param, or nothing) is a dynamic one."""
    return d.HasField("dim_value") and d.dim_value >= 0


def forget_unknown_dims(graph: onnx.GraphProto) -> None:
    """Declared output and intermediate dims of -1 or 0 become unknown, before ONNX's strict
    shape inference would call them a contradiction of the sizes it infers."""
    for vi in list(graph.output) + list(graph.value_info):
        tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        if tt is None or not tt.HasField("shape"):
            continue
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value <= 0:
                d.Clear()


def named(dim_param: str) -> bool:
    """A symbol shared by the dimensions that carry it: not empty, and not '?', which
    exporters (Paddle2ONNX's p2o, for one) write for each size they know nothing about."""
    return any(c.isalnum() for c in dim_param)


def symbol_values(graph: onnx.GraphProto, input_shapes: Mapping[str, tuple[int, ...]],
                  loc: Location) -> dict[str, int]:
    """The size of each symbolic dimension that an input given with --input-shape names; two
    inputs that give one symbol two sizes are an error."""
    values: dict[str, tuple[int, str]] = {}
    for vi in graph.input:
        given = input_shapes.get(vi.name)
        tt = vi.type.tensor_type
        if given is None or not tt.HasField("shape") or len(given) != len(tt.shape.dim):
            continue  # a rank mismatch is reported with the input itself
        for d, v in zip(tt.shape.dim, given):
            if not named(d.dim_param):
                continue
            seen = values.setdefault(d.dim_param, (v, vi.name))
            if seen[0] != v:
                raise DiagnosticError.at(loc, (
                    f"--input-shape gives the symbolic dimension '{d.dim_param}' the size "
                    f"{seen[0]} for input '{seen[1]}' and {v} for input '{vi.name}'"))
    return {k: v for k, (v, _) in values.items()}


# Ops whose result has the type and shape of their first input, which onnx's shape inference
# leaves untyped (GroupNormalization at every opset, so strict inference fails on the next node)
# or its checker refuses (GroupNormalization-18, per-group scale, which models at opsets 18 to
# 20 hold and onnxruntime runs): inference and the checker see an Identity in their place, and
# the importer checks the node by its own rule.
STAND_INS = frozenset({"GroupNormalization"})


def with_stand_ins(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model`, or a copy of it with each STAND_INS node an Identity of its first input."""
    if not any(n.op_type in STAND_INS for n in model.graph.node):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for n in copy.graph.node:
        if n.op_type in STAND_INS and n.domain in ("", "ai.onnx"):
            n.op_type = "Identity"
            del n.input[1:]
            del n.attribute[:]
    return copy
