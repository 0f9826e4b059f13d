"""ONNX import handlers: If, Loop and Scan, resolved at import into straight-line mp ops.

The IR has no regions, so control flow is flattened while the model is read. A subgraph is
imported in place (`import_subgraph`): its nodes go through the same walk as the main graph, in
a scope that binds its formal inputs and sees every outer value, and whose own names (which a
Loop body reuses on every iteration) vanish when it ends. Then:

- an If whose condition folds at import is its taken branch; an If on a run-time condition
  imports both branches and selects each output with mp.where, which needs the branches to
  give the same types;
- a Loop whose trip count and condition are known at import (a constant M, a condition that is
  constant or that the body computes from the iteration number alone) is unrolled, its scan
  outputs stacked on a new leading axis;
- a Scan is unrolled over the static length of its scan inputs, each direction and axis as the
  attributes say (Scan-8, which adds a batch axis, runs the same unrolling per batch row).

Anything else (a data-dependent trip count or loop condition, branches of different types, an
unrolling longer than `MAX_UNROLL` steps) is refused with the node and the reason.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import onnx
from onnx import helper

import mplower.dialect  # noqa: F401  (registers the mp ops)
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.types import tensor
from mplower.onnx.importer.core import (
    Const,
    Run,
    StaticInputsNeeded,
    Unbound,
    _attrs,
    _Importer,
    _node_inputs,
    _shape_of,
    handler,
    onnx_type_name,
)

# The most steps a Loop or Scan is unrolled into: each step copies the body into the module.
MAX_UNROLL = 4096

Value = Const | Run


def import_subgraph(imp: _Importer, graph: onnx.GraphProto, bindings: Mapping[str, Value],
                    where: str) -> list[Value]:
    """The values of `graph`'s outputs, its nodes imported in place with its inputs bound to
    `bindings`; a failure inside names `where` (the subgraph) and the inner node."""
    outer_env, outer_cache, outer_node = imp.env, imp.materialized, imp.node
    outer_producer = imp.producer
    scope = ChainMap(dict(bindings), outer_env)
    for t in graph.initializer:
        scope[t.name] = Const(imp._tensor_array(t))
    imp.env, imp.materialized = scope, ChainMap({}, outer_cache)
    # So that a value the IR needs constant names the graph inputs it comes from.
    imp.producer = ChainMap({o: n for n in graph.node for o in n.output if o}, outer_producer)
    imp.consumers.update(i for n in graph.node for i in _node_inputs(n) if i)
    imp.consumers.update(o.name for o in graph.output)
    try:
        for n in graph.node:
            imp.node = n
            imp._convert(n)
        imp.node = outer_node
        outs = []
        for o in graph.output:
            v = scope.get(o.name)
            if v is None:
                raise imp.error(f"{where} never computes its output '{o.name}'")
            if isinstance(v, Unbound):
                raise imp.error(f"{where} outputs '{o.name}' of element type "
                                f"{onnx_type_name(v.onnx_type)}, which the IR lacks")
            outs.append(v)
        return outs
    except StaticInputsNeeded as e:
        raise StaticInputsNeeded(e.names, _within(imp, outer_node, where, e)) from None
    except DiagnosticError as e:
        if imp.node is outer_node:
            raise
        raise DiagnosticError(_within(imp, outer_node, where, e)) from None
    finally:
        imp.env, imp.materialized, imp.node = outer_env, outer_cache, outer_node
        imp.producer = outer_producer


def _within(imp: _Importer, outer: onnx.NodeProto, where: str, e: DiagnosticError):
    imp.node = outer
    return imp.error(f"in {where}: {e.diagnostics[0].message}").diagnostics[0]


def _type_of(v: Value) -> tuple[tuple[int, ...], str]:
    """(shape, ONNX element type name), alike for constants and run-time values."""
    t = helper.np_dtype_to_tensor_dtype(v.array.dtype) if isinstance(v, Const) else v.onnx_type
    return _shape_of(v), onnx_type_name(t)


def _index(imp: _Importer, v: Value, axis: int, i: int) -> Value:
    """v[i] along `axis`, that axis removed."""
    if isinstance(v, Const):
        return Const(np.take(v.array, i, axis=axis))
    shape = v.type.shape
    starts = tuple(i if k == axis else 0 for k in range(len(shape)))
    ends = tuple(i + 1 if k == axis else d for k, d in enumerate(shape))
    part = imp.emit("mp.slice", [v], {"starts": starts, "ends": ends}, onnx_type=v.onnx_type)
    rest = shape[:axis] + shape[axis + 1:]
    return imp.emit("mp.reshape", [part], declared=tensor(rest, v.type.elem),
                    onnx_type=v.onnx_type)


def _stack(imp: _Importer, values: Sequence[Value], axis: int, what: str) -> Value:
    """The values stacked along a new `axis` (np.stack)."""
    kinds = {_type_of(v) for v in values}
    if len(kinds) > 1:
        listing = ", ".join(f"{list(s)} {t}" for s, t in sorted(kinds))
        raise imp.error(f"{what} changes type from step to step ({listing}); the steps must "
                        f"agree to be stacked")
    if all(isinstance(v, Const) for v in values):
        return Const(np.stack([v.array for v in values], axis=axis))
    parts = []
    for v in values:
        r = imp.as_run(v)
        shape = r.type.shape[:axis] + (1,) + r.type.shape[axis:]
        parts.append(imp.emit("mp.reshape", [r], declared=tensor(shape, r.type.elem),
                              onnx_type=r.onnx_type))
    if len(parts) == 1:
        return parts[0]
    return imp.emit("mp.concat", parts, {"axis": axis}, onnx_type=parts[0].onnx_type)


# ---- If ----------------------------------------------------------------------------------


@handler("If")
def _if(imp: _Importer, node: onnx.NodeProto) -> list:
    a = _attrs(node)
    cond = imp.need_tensor(0)
    if _shape_of(cond) not in ((), (1,)):
        raise imp.error(f"the condition has shape {list(_shape_of(cond))}; If takes a single "
                        f"boolean")
    if isinstance(cond, Const):
        taken = "then_branch" if bool(cond.array.reshape(-1)[0]) else "else_branch"
        return import_subgraph(imp, a[taken], {}, taken)
    try:
        return _select(imp, node, cond, import_subgraph(imp, a["then_branch"], {}, "then_branch"),
                       import_subgraph(imp, a["else_branch"], {}, "else_branch"))
    except StaticInputsNeeded:
        raise
    except DiagnosticError as e:
        # What both branches cannot do together, the taken one alone may: where the
        # condition comes from graph inputs, say so, which lets the ONNX backend bind them.
        roots = imp._graph_inputs_under(node.input[0])
        if not roots:
            raise
        why = e.diagnostics[0]
        raise StaticInputsNeeded(roots, replace(why, message=(
            f"{why.message}; the condition depends on graph input(s) "
            f"{', '.join(map(repr, roots))}, and with their values known at import (as the "
            f"ONNX backend binds them) the If imports its taken branch alone"))) from None


def _select(imp: _Importer, node: onnx.NodeProto, cond: Run, then: list[Value],
            other: list[Value]) -> list[Value]:
    """Each output of an If on a run-time condition: mp.where over the two branches'."""
    if cond.type.shape:
        cond = imp.emit("mp.reshape", [cond], declared=tensor((), cond.type.elem),
                        onnx_type=cond.onnx_type)
    outs = []
    for k, (t, e) in enumerate(zip(then, other)):
        if t is e:
            outs.append(t)
            continue
        tt, te = _type_of(t), _type_of(e)
        if tt != te:
            raise imp.error(
                f"output #{k}: then_branch gives {list(tt[0])} {tt[1]}, else_branch "
                f"{list(te[0])} {te[1]}; an If on a run-time condition ('{node.input[0]}') "
                f"becomes a select over both branches, which needs equal types")
        rt, re_ = imp.as_run(t), imp.as_run(e)
        outs.append(imp.emit("mp.where", [cond, rt, re_], onnx_type=rt.onnx_type,
                             hint=node.output[k] or "if"))
    return outs


# ---- Loop --------------------------------------------------------------------------------


def _flag(imp: _Importer, v: Value, what: str) -> bool:
    if not isinstance(v, Const):
        raise imp.error(f"{what} depends on run-time data; mplower unrolls a Loop only when its "
                        f"trip count and condition are known at import")
    if v.array.size != 1:
        raise imp.error(f"{what} has shape {list(v.array.shape)}; it must be one boolean")
    return bool(v.array.reshape(-1)[0])


@handler("Loop")
def _loop(imp: _Importer, node: onnx.NodeProto) -> list:
    body = _attrs(node)["body"]
    trips = imp.const(0, "the trip count M")
    trips = None if trips is None else int(np.asarray(trips).reshape(-1)[0])
    cond = imp.const(1, "the loop condition")
    running = True if cond is None else _flag(imp, Const(np.asarray(cond)), "the loop condition")
    carried = [imp.need(i) for i in range(2, len(node.input))]
    names = [i.name for i in body.input]
    if len(names) != 2 + len(carried):
        raise imp.error(f"the body takes {len(names)} inputs; this Loop carries {len(carried)} "
                        f"values (the body takes them after the iteration number and condition)")
    scans: list[list[Value]] = []
    k = 0
    while running and (trips is None or k < trips):
        if k == MAX_UNROLL:
            raise imp.error(f"the loop runs more than {MAX_UNROLL} iterations, the most mplower "
                            f"unrolls")
        bindings = {names[0]: Const(np.array(k, np.int64)), names[1]: Const(np.array(True))}
        bindings.update(zip(names[2:], carried))
        outs = import_subgraph(imp, body, bindings, f"the body (iteration {k})")
        running = _flag(imp, outs[0], f"the loop condition after iteration {k}")
        carried = outs[1:1 + len(carried)]
        for j, v in enumerate(outs[1 + len(carried):]):
            if k == 0:
                scans.append([])
            scans[j].append(v)
        k += 1
    n_scan = len(body.output) - 1 - len(carried)
    wanted = [o for o in node.output[len(carried):] if o]
    if k == 0 and n_scan and wanted:
        raise imp.error("the loop runs no iteration, so its scan outputs are empty tensors "
                        "whose shape only the body could say; mplower has no such tensor")
    stacked = [_stack(imp, vals, 0, f"scan output #{j}") for j, vals in enumerate(scans)]
    return list(carried) + stacked


# ---- Scan --------------------------------------------------------------------------------


def _scan(imp: _Importer, body: onnx.GraphProto, states: list[Value], inputs: list[Value],
          in_axes: list[int], in_dirs: list[int], out_axes: list[int],
          out_dirs: list[int]) -> list[Value]:
    """Scan-9 semantics over the given values: final states, then the scan outputs."""
    lengths = {_shape_of(v)[ax] for v, ax in zip(inputs, in_axes)}
    if len(lengths) != 1:
        raise imp.error(f"the scan inputs have lengths {sorted(lengths)} along their scan axes; "
                        f"they must agree")
    (steps,) = lengths
    if steps > MAX_UNROLL:
        raise imp.error(f"the scan runs {steps} steps, more than the {MAX_UNROLL} mplower "
                        f"unrolls")
    names = [i.name for i in body.input]
    n_out = len(body.output) - len(states)
    per_step: list[list[Value]] = [[] for _ in range(n_out)]
    for t in range(steps):
        bindings = dict(zip(names, states))
        for name, v, ax, rev in zip(names[len(states):], inputs, in_axes, in_dirs):
            bindings[name] = _index(imp, v, ax, steps - 1 - t if rev else t)
        outs = import_subgraph(imp, body, bindings, f"the body (step {t})")
        states = outs[:len(states)]
        for j, v in enumerate(outs[len(states):]):
            per_step[j].append(v)
    if steps == 0 and n_out:
        raise imp.error("the scan has no step, so its scan outputs are empty tensors whose "
                        "shape only the body could say; mplower has no such tensor")
    results = list(states)
    for j, vals in enumerate(per_step):
        if out_dirs[j]:
            vals = vals[::-1]
        rank = len(_shape_of(vals[0])) + 1
        results.append(_stack(imp, vals, out_axes[j] % rank, f"scan output #{j}"))
    return results


def _input_axes(imp: _Importer, inputs: list[Value], given: list | None) -> list[int]:
    """scan_input_axes, normalized against each scan input's rank (default 0)."""
    if given is None:
        return [0] * len(inputs)
    if len(given) != len(inputs):
        raise imp.error(f"scan_input_axes has {len(given)} entries for {len(inputs)} scan "
                        f"inputs")
    out = []
    for ax, v in zip(given, inputs):
        rank = len(_shape_of(v))
        if not -rank <= int(ax) < rank:
            raise imp.error(f"scan_input_axes entry {ax} is out of range for rank {rank}")
        out.append(int(ax) % rank)
    return out


@handler("Scan")
def _scan_node(imp: _Importer, node: onnx.NodeProto) -> list:
    a = _attrs(node)
    body, m = a["body"], int(a["num_scan_inputs"])
    first = 1 if imp.opset < 9 else 0  # Scan-8 leads with sequence_lens
    values = [imp.need_tensor(i) for i in range(first, len(node.input))]
    n_state = len(values) - m
    if n_state < 0:
        raise imp.error(f"num_scan_inputs is {m}, but the node has {len(values)} inputs")
    states, inputs = values[:n_state], values[n_state:]
    n_out = len(body.output) - n_state
    if imp.opset < 9:
        return _scan8(imp, node, body, states, inputs, n_out)
    in_axes = _input_axes(imp, inputs, a.get("scan_input_axes"))
    in_dirs = list(a.get("scan_input_directions", [0] * m))
    out_axes = [int(x) for x in a.get("scan_output_axes", [0] * n_out)]
    out_dirs = list(a.get("scan_output_directions", [0] * n_out))
    if len(in_dirs) != m or len(out_axes) != n_out or len(out_dirs) != n_out:
        raise imp.error("scan_input_directions, scan_output_axes and scan_output_directions "
                        "need one entry per scan input / scan output")
    return _scan(imp, body, states, inputs, in_axes, in_dirs, out_axes, out_dirs)


def _scan8(imp: _Importer, node: onnx.NodeProto, body: onnx.GraphProto, states: list,
           inputs: list, n_out: int) -> list:
    """Scan-8: axis 0 of every value is a batch; each row scans its own sequence (axis 1)."""
    lens = imp.const(0, "sequence_lens")
    batch = {_shape_of(v)[0] for v in states + inputs}
    if len(batch) != 1:
        raise imp.error(f"the inputs have batch sizes {sorted(batch)}; Scan-8 takes one")
    (rows,) = batch
    steps = _shape_of(inputs[0])[1] if inputs else 0
    if lens is not None and (np.asarray(lens).reshape(-1) != steps).any():
        raise imp.error(f"sequence_lens {np.asarray(lens).reshape(-1).tolist()} differ from the "
                        f"scan length {steps}; mplower unrolls Scan-8 over full sequences only")
    dirs = list(_attrs(node).get("directions", [0] * len(inputs)))
    per_row = []
    for b in range(rows):
        row_states = [_index(imp, v, 0, b) for v in states]
        row_inputs = [_index(imp, v, 0, b) for v in inputs]
        per_row.append(_scan(imp, body, row_states, row_inputs, [0] * len(inputs), dirs,
                             [0] * n_out, [0] * n_out))
    return [_stack(imp, [r[j] for r in per_row], 0, f"output #{j}")
            for j in range(len(states) + n_out)]
