"""Module and Function: the IR as networkx graphs, and the rewriter API that keeps them consistent.

A `Function` holds one `networkx.MultiDiGraph`: a node per operation (function arguments are
nodes with op `"arg"`, the terminator has op `"return"`), an edge per use of a value carrying
`pos` (operand position in the user) and `res` (result index in the producer). Node data:
`op` (name), `attrs` (dict), `types` (result types), `name` (the result's SSA name without `%`),
`loc` (Location). The program (printing) order is kept beside the graph; every mutation goes
through the methods below so that graph, operand order and order stay in step, and
`mplower.ir.verifier` checks exactly that.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from mplower.ir.diagnostics import UNKNOWN, Location
from mplower.ir.types import TensorType

ARG = "arg"
RETURN = "return"

Value = tuple[int, int]  # (producer node, result index)


class Function:
    def __init__(self, name: str, loc: Location = UNKNOWN):
        self.name = name
        self.loc = loc
        self.graph = nx.MultiDiGraph()
        self.args: list[int] = []
        self.result_types: list[TensorType] = []
        self.attrs: dict[str, Any] = {}
        self._order: list[int] = []  # ops in program order, args excluded, return last
        self._before: dict[int, list[int]] = {}  # pending insertions, applied lazily
        self._after: dict[int, list[int]] = {}
        self._at_start: list[int] = []  # created right after the arguments, in creation order
        self._dirty = False
        self._next_id = 0
        self._names: set[str] = set()
        # base -> a k such that base_1 .. base_{k-1} are all taken, so that fresh_name is not
        # quadratic in the number of ops made from one hint.
        self._suffix: dict[str, int] = {}

    # ---- reading -------------------------------------------------------------------------
    def ops(self) -> list[int]:
        """Operations in program order (arguments excluded, the return last). A fresh list."""
        if self._dirty:
            self._materialize()
        return list(self._order)

    @property
    def nodes(self) -> dict[int, dict[str, Any]]:
        """Node data by node id (networkx's own dict: read it, mutate through the methods)."""
        return self.graph._node

    def __len__(self) -> int:
        return self.graph.number_of_nodes() - len(self.args)

    def op(self, node: int) -> str:
        return self.graph._node[node]["op"]

    def data(self, node: int) -> dict[str, Any]:
        return self.graph._node[node]

    def attrs_of(self, node: int) -> dict[str, Any]:
        return self.graph._node[node]["attrs"]

    def types(self, node: int) -> list[TensorType]:
        return self.graph._node[node]["types"]

    def type_of(self, value: Value) -> TensorType:
        return self.graph._node[value[0]]["types"][value[1]]

    # networkx's node and adjacency dicts (`_node[n]`, `_pred[v][u][key]`, `_succ[u][v][key]`)
    # are read directly on these hot paths: its views cost several times more per call.
    def operand_edges(self, node: int) -> list[tuple[int, int, int]]:
        """(position, producer, result index) of each operand, in operand order."""
        edges = [(d["pos"], u, d["res"]) for u, keyed in self.graph._pred[node].items()
                 for d in keyed.values()]
        edges.sort()
        return edges

    def operands(self, node: int) -> list[Value]:
        return [(u, r) for _, u, r in self.operand_edges(node)]

    def operand_types(self, node: int) -> list[TensorType]:
        nodes = self.graph._node
        return [nodes[u]["types"][r] for _, u, r in self.operand_edges(node)]

    def uses(self, value: Value) -> list[tuple[int, int]]:
        """(user node, operand position) for every use of `value`."""
        node, res = value
        return [(v, d["pos"]) for v, keyed in self.graph._succ[node].items()
                for d in keyed.values() if d["res"] == res]

    def has_uses(self, node: int) -> bool:
        return bool(self.graph._succ[node])

    def op_name(self, node: int) -> str:
        """An op as per-op tables name it: `%s` for `%s` and for all results of `%s:3`."""
        return f"%{self.graph.nodes[node]['name']}"

    def value_name(self, value: Value) -> str:
        d = self.graph.nodes[value[0]]
        if len(d["types"]) > 1:
            return f"%{d['name']}#{value[1]}"
        return f"%{d['name']}"

    @property
    def return_node(self) -> int:
        if self._dirty:
            self._materialize()
        return self._order[-1]

    def walk(self, op_name: str | None = None) -> Iterator[int]:
        for n in self.ops():
            if op_name is None or self.graph.nodes[n]["op"] == op_name:
                yield n

    # ---- building ------------------------------------------------------------------------
    def fresh_name(self, hint: str = "") -> str:
        base = hint or "v"
        if base not in self._names:
            return base
        k = self._suffix.get(base, 1)
        while f"{base}_{k}" in self._names:
            k += 1
        self._suffix[base] = k
        return f"{base}_{k}"

    def _add_node(self, op: str, attrs: dict, types: list[TensorType], name: str,
                  loc: Location) -> int:
        node = self._next_id
        self._next_id += 1
        self.graph.add_node(node, op=op, attrs=attrs, types=types, name=name, loc=loc)
        if name:
            self._names.add(name)
        return node

    def add_arg(self, name: str, type_: TensorType, loc: Location = UNKNOWN) -> int:
        node = self._add_node(ARG, {"index": len(self.args)}, [type_], name, loc)
        self.args.append(node)
        return node

    def append_op(self, op: str, operands: Iterable[Value], attrs: dict[str, Any],
                  types: list[TensorType], name: str = "", loc: Location = UNKNOWN) -> int:
        """Add an op at the end of the body (the parser's path: no ordering bookkeeping)."""
        node = self._add_node(op, attrs, types, name, loc)
        add_edge = self.graph.add_edge
        for pos, (src, res) in enumerate(operands):
            add_edge(src, node, pos=pos, res=res)
        self._order.append(node)
        return node

    # ---- rewriting -----------------------------------------------------------------------
    def create_op(self, op: str, operands: Iterable[Value], types: list[TensorType],
                  attrs: dict[str, Any] | None = None, *, before: int | None = None,
                  after: int | None = None, name_hint: str = "",
                  loc: Location | None = None) -> int:
        """Create an op right before `before` or right after `after` (one of them is required)."""
        if (before is None) == (after is None):
            raise ValueError("create_op needs exactly one of before= or after=")
        anchor = before if before is not None else after
        if loc is None:
            loc = self.graph.nodes[anchor]["loc"]
        name = self.fresh_name(name_hint) if types else ""
        node = self._add_node(op, dict(attrs or {}), list(types), name, loc)
        for pos, (src, res) in enumerate(operands):
            self.graph.add_edge(src, node, pos=pos, res=res)
        if before is not None:
            self._before.setdefault(before, []).append(node)
        elif self.graph.nodes[after]["op"] == ARG:  # after an argument: at the body's start
            self._at_start.append(node)
        else:
            self._after.setdefault(after, []).append(node)
        self._dirty = True
        return node

    def replace_all_uses(self, old: Value, new: Value, *, exclude: Iterable[int] = ()) -> int:
        """Point every use of `old` (except by the ops in `exclude`) at `new`; returns the count."""
        skip = set(exclude)
        node, res = old
        moved = [(v, k, d) for v, keyed in self.graph._succ[node].items()
                 for k, d in keyed.items() if d["res"] == res and v not in skip]
        for v, k, d in moved:
            self.graph.remove_edge(node, v, key=k)
            self.graph.add_edge(new[0], v, pos=d["pos"], res=new[1])
        return len(moved)

    def set_operand(self, node: int, pos: int, value: Value) -> None:
        for u, keyed in self.graph._pred[node].items():
            key = next((k for k, d in keyed.items() if d["pos"] == pos), None)
            if key is not None:
                self.graph.remove_edge(u, node, key=key)
                break
        self.graph.add_edge(value[0], node, pos=pos, res=value[1])

    def erase(self, node: int) -> None:
        """Remove an op whose results have no uses."""
        if self.graph._succ[node]:
            raise ValueError(f"cannot erase {self.graph.nodes[node]['op']}: its results are used")
        name = self.graph.nodes[node]["name"]
        self._names.discard(name)
        base, _, k = name.rpartition("_")
        if k.isdigit() and base in self._suffix:  # base_k is free again
            self._suffix[base] = min(self._suffix[base], int(k))
        self.graph.remove_node(node)
        self._dirty = True

    def rename(self, node: int, hint: str) -> None:
        """Name `node` afresh from `hint`: a pass that replaced an op by a new one gives the
        new one the old name once the old op is erased (sheets and reports refer to it)."""
        old = self.graph.nodes[node]["name"]
        self._names.discard(old)
        self.graph.nodes[node]["name"] = name = self.fresh_name(hint)
        self._names.add(name)

    def set_attr(self, node: int, key: str, value: Any) -> None:
        self.graph.nodes[node]["attrs"][key] = value

    def set_attrs(self, node: int, values: dict[str, Any]) -> None:
        """set_attr for each entry, with one node lookup (a pass that annotates every op)."""
        self.graph._node[node]["attrs"].update(values)

    def del_attr(self, node: int, key: str) -> None:
        self.graph.nodes[node]["attrs"].pop(key, None)

    def set_result_type(self, node: int, index: int, type_: TensorType) -> None:
        self.graph.nodes[node]["types"][index] = type_

    def _materialize(self) -> None:
        nodes = self.graph.nodes
        order: list[int] = []
        # Each op expands to (its pending `before` ops, itself, its pending `after` ops), depth
        # first. An explicit stack, not recursion: a pass may build chains of thousands.
        stack: list[tuple[int, bool]] = [(n, False) for n in reversed(self._order)]
        stack.extend((n, False) for n in reversed(self._at_start))
        while stack:
            n, expanded = stack.pop()
            if expanded:
                if n in nodes:
                    order.append(n)
                continue
            stack.extend((a, False) for a in reversed(self._after.pop(n, ())))
            stack.append((n, True))
            stack.extend((b, False) for b in reversed(self._before.pop(n, ())))
        self._order = order
        self._at_start = []
        self._before.clear()
        self._after.clear()
        self._dirty = False


@dataclass
class Module:
    name: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    functions: dict[str, Function] = field(default_factory=dict)
    path: str = "<stdin>"  # the file it was read from; weights resolve relative to it
    loc: Location = UNKNOWN
    # Where each attribute of `attrs` was written, for a diagnostic about its value (a file
    # that `mp.weights` names); an attribute set by a pass has none and falls back to `loc`.
    attr_locs: dict[str, Location] = field(default_factory=dict)

    def attr_loc(self, name: str) -> Location:
        """Where the attribute `name` was written, else where the module was."""
        return self.attr_locs.get(name, self.loc)

    def function(self, name: str | None = None) -> Function:
        """The named function, or `main`, or the only one."""
        if name is not None:
            return self.functions[name]
        if "main" in self.functions:
            return self.functions["main"]
        if len(self.functions) == 1:
            return next(iter(self.functions.values()))
        raise KeyError("module has several functions and none is named 'main'")
