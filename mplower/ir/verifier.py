"""The verifier: structure (SSA, order, edges) and every op's own rules from its OpDef.

Structure: each value is defined once and before its uses in program order, each op's operand
edges number 0..n-1, every edge names an existing result, the function ends with a return whose
types match the signature, and every value's type is one a tensor can have (`shape_problem`:
the parser refuses such types in text; modules built through the API, by the ONNX importer for
one, are checked here). Ops: known to the registry, operand count, attributes
(`check_attrs`), and declared result types equal to the types the op's rule infers. All
failures are collected, each located at its op, and raised together. Ops come from the registry
that the dialects fill (mplower.dialect); the IR layer does not import them.
"""

from __future__ import annotations

from mplower.ir.diagnostics import Diagnostic, DiagnosticError
from mplower.ir.graph import ARG, RETURN, Function, Module
from mplower.ir.opdef import OpError, check_attrs, lookup
from mplower.ir.types import shape_problem


def verify(module: Module) -> None:
    diags: list[Diagnostic] = []
    for f in module.functions.values():
        diags.extend(verify_function(f))
    if diags:
        raise DiagnosticError(*diags)


def verify_function(f: Function) -> list[Diagnostic]:
    diags: list[Diagnostic] = []
    g = f.graph
    nodes = g.nodes
    order = f.ops()
    index = {n: i for i, n in enumerate(order)}
    for a in f.args:
        index[a] = -1
    if len(index) != g.number_of_nodes():
        stray = [n for n in g.nodes if n not in index]
        diags.append(Diagnostic(f.loc, f"internal: {len(stray)} ops are in the graph but not in "
                                       f"the function's order"))
        return diags
    if not order or nodes[order[-1]]["op"] != RETURN:
        diags.append(Diagnostic(f.loc, f"function @{f.name} does not end with a return"))
        return diags
    seen_names: dict[str, int] = {}
    checked: set[int] = set()  # ids of the types seen: types are interned, few and shared
    for n in f.args + order:
        for t in nodes[n]["types"]:
            if id(t) not in checked:
                checked.add(id(t))
                problem = shape_problem(t.shape)
                if problem is not None:
                    diags.append(Diagnostic(nodes[n]["loc"], f"{t} {problem}"))
        name = nodes[n]["name"]
        if name:
            if name in seen_names:
                diags.append(Diagnostic(nodes[n]["loc"], f"redefinition of value '%{name}'"))
            seen_names[name] = n
    for i, n in enumerate(order):
        d = nodes[n]
        edges = f.operand_edges(n)
        if [e[0] for e in edges] != list(range(len(edges))):
            diags.append(Diagnostic(d["loc"], "internal: operand positions are not 0..n-1"))
            continue
        bad = False
        for pos, u, res in edges:
            if index[u] >= i:
                diags.append(Diagnostic(d["loc"], f"operand #{pos} '%{nodes[u]['name']}' is "
                                                  f"used before it is defined"))
                bad = True
            elif res >= len(nodes[u]["types"]):
                diags.append(Diagnostic(d["loc"], f"operand #{pos} names result #{res} of an "
                                                  f"op with {len(nodes[u]['types'])}"))
                bad = True
        if bad:
            continue
        in_types = [nodes[u]["types"][res] for _, u, res in edges]
        if d["op"] == RETURN:
            if i != len(order) - 1:
                diags.append(Diagnostic(d["loc"], "return must be the last operation"))
            elif in_types != f.result_types:
                want = ", ".join(map(str, f.result_types)) or "nothing"
                got = ", ".join(map(str, in_types)) or "nothing"
                diags.append(Diagnostic(d["loc"], f"return type mismatch: function @{f.name} "
                                                  f"returns {want} but return gives {got}"))
            continue
        msg = verify_op(d["op"], in_types, d["attrs"], d["types"])
        if msg:
            diags.append(Diagnostic(d["loc"], msg))
    return diags


def verify_op(name: str, in_types: list, attrs: dict, out_types: list) -> str | None:
    """The first rule that the op breaks, as a message, or None."""
    if name == ARG:
        return None
    try:
        opdef = lookup(name)
    except OpError as e:
        return e.message
    n = len(in_types)
    lo, hi = opdef.min_operands, opdef.max_operands
    if n < lo or (hi is not None and n > hi):
        want = str(lo) if lo == hi else (f"at least {lo}" if hi is None else f"{lo} to {hi}")
        return f"'{name}' expects {want} operands, got {n}"
    if opdef.num_results is not None and len(out_types) != opdef.num_results:
        return f"'{name}' has {opdef.num_results} result(s), got {len(out_types)}"
    try:
        full = check_attrs(opdef, attrs)
        expected = opdef.infer(in_types, full, out_types)
    except OpError as e:
        # Some op rules already name the op ("mp.relu takes no attribute 'x'").
        return e.message if name in e.message else f"'{name}' {e.message}"
    if list(expected) != list(out_types):
        want = ", ".join(map(str, expected))
        got = ", ".join(map(str, out_types))
        return f"'{name}' result type {got} does not match the inferred type {want}"
    return None
