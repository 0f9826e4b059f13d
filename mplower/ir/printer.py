"""Module to text, in MLIR's custom form (default) or generic form (`--print-op-generic`).

The output is deterministic and re-parses to a module that prints identically. Every file is
printed inside `module { ... }` as mlir-opt does. In generic form each op is
`"mp.op"(%a, %b) {attrs} : (types) -> type`, which upstream MLIR parses with
`--allow-unregistered-dialect`.
"""

from __future__ import annotations

from functools import lru_cache

from mplower.ir.graph import RETURN, Function, Module
from mplower.ir.types import TensorType, attr_dict_to_str, attr_name, attr_to_str


@lru_cache(maxsize=4096)
def _types_str(types: tuple[TensorType, ...]) -> str:
    return ", ".join(str(t) for t in types)


@lru_cache(maxsize=4096)
def _functype_str(ins: tuple[TensorType, ...], outs: tuple[TensorType, ...]) -> str:
    res = str(outs[0]) if len(outs) == 1 else f"({_types_str(outs)})"
    return f"({_types_str(ins)}) -> {res}"


def print_function(f: Function, generic: bool = False, indent: str = "  ") -> str:
    nodes = f.graph.nodes
    args = ", ".join(f"%{nodes[a]['name']}: {nodes[a]['types'][0]}" for a in f.args)
    header = f"{indent}func.func @{_symbol(f.name)}({args})"
    if f.result_types:
        rs = f.result_types
        header += f" -> {rs[0]}" if len(rs) == 1 else f" -> ({_types_str(tuple(rs))})"
    if f.attrs:
        header += f" attributes {attr_dict_to_str(f.attrs)}"
    lines = [header + " {"]
    body = indent + "  "
    names: dict[int, str] = {}  # node -> "%name" (single result) or "%name" base (multi)
    multi: set[int] = set()
    for a in f.args:
        names[a] = "%" + nodes[a]["name"]
    for n in f.ops():
        d = nodes[n]
        edges = f.operand_edges(n)
        operands = [names[u] if u not in multi else f"{names[u]}#{r}" for _, u, r in edges]
        in_types = tuple(nodes[u]["types"][r] for _, u, r in edges)
        op = d["op"]
        if op == RETURN:
            if generic:
                lines.append(f'{body}"func.return"({", ".join(operands)}) : '
                             f"({_types_str(in_types)}) -> ()")
            elif operands:
                lines.append(f"{body}return {', '.join(operands)} : {_types_str(in_types)}")
            else:
                lines.append(f"{body}return")
            continue
        types = d["types"]
        name = "%" + d["name"]
        names[n] = name
        if len(types) > 1:
            multi.add(n)
            lhs = f"{name}:{len(types)} = "
        else:
            lhs = f"{name} = " if types else ""
        attrs = f" {attr_dict_to_str(d['attrs'])}" if d["attrs"] else ""
        ftype = _functype_str(in_types, tuple(types))
        if generic:
            lines.append(f'{body}{lhs}"{op}"({", ".join(operands)}){attrs} : {ftype}')
        else:
            ops = " " + ", ".join(operands) if operands else ""
            lines.append(f"{body}{lhs}{op}{ops}{attrs} : {ftype}")
    lines.append(indent + "}")
    return "\n".join(lines)


def _symbol(name: str) -> str:
    return name if attr_name(name) == name else f'"{name}"'


def print_module(m: Module, generic: bool = False) -> str:
    head = "module"
    if m.name:
        head += f" @{_symbol(m.name)}"
    if m.attrs:
        head += f" attributes {attr_dict_to_str(m.attrs)}"
    parts = [head + " {"]
    parts.extend(print_function(f, generic) for f in m.functions.values())
    parts.append("}")
    return "\n".join(parts) + "\n"


__all__ = ["attr_to_str", "print_function", "print_module"]
