"""Pattern rewriting: a rewrite is a declared pattern and a function; one walker applies them all.

In the spirit of xDSL's `RewritePattern` + `PatternRewriteWalker` and tinygrad's
`PatternMatcher`: a `Pattern` says which ops it looks at (by op name or by trait), `match`
reads the function around one such op and returns what the rewrite needs (None: no match), and
`rewrite` changes the function through its rewriter API (mplower.ir.graph). `apply_patterns`
walks the ops in program order and applies the first pattern that matches each, sweep after
sweep, until a sweep changes nothing, counting each application under the pattern's name.
The order is the program's and the patterns' (no sets, no hashing), so a rewrite is
deterministic. The helpers below are the questions patterns ask of an op's neighbours.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mplower.ir.graph import RETURN, Function, Value
from mplower.ir.opdef import OPS, Trait


@dataclass(frozen=True)
class Pattern:
    """One rewrite: `match(f, node)` returns a match (anything but None) on the ops named in
    `ops` or declaring `trait` (both empty: every op), and `rewrite(f, node, match)` applies it.
    `name` is the statistic its applications count under."""

    name: str
    match: Callable[[Function, int], Any]
    rewrite: Callable[[Function, int, Any], None]
    ops: frozenset[str] = frozenset()
    trait: Trait | None = None

    def looks_at(self, op: str) -> bool:
        if self.ops and op not in self.ops:
            return False
        if self.trait is not None:
            opdef = OPS.get(op)
            return opdef is not None and self.trait in opdef.traits
        return True


def apply_patterns(f: Function, patterns: Sequence[Pattern],
                   count: Callable[[str, int], None] | None = None,
                   max_sweeps: int = 100) -> int:
    """Apply `patterns` to `f` until none matches (or `max_sweeps` sweeps); the number of
    rewrites. `count(name, 1)` is called once per application (PassContext.stat)."""
    total = 0
    nodes = f.nodes
    for _ in range(max_sweeps):
        changed = 0
        for n in f.ops():
            d = nodes.get(n)
            if d is None:  # erased by an earlier rewrite of this sweep
                continue
            for p in patterns:
                if not p.looks_at(d["op"]):
                    continue
                m = p.match(f, n)
                if m is None:
                    continue
                p.rewrite(f, n, m)
                changed += 1
                if count is not None:
                    count(p.name, 1)
                break
        total += changed
        if not changed:
            break
    return total


# ---- what patterns ask ------------------------------------------------------------------------


def producer(f: Function, value: Value, ops: Iterable[str] | str | None = None) -> int | None:
    """The node that computes `value`, if it is one of `ops` (None: any op; an argument is
    not an op)."""
    d = f.data(value[0])
    if isinstance(ops, str):
        ops = (ops,)
    if d["op"] == "arg" or ops is not None and d["op"] not in ops:
        return None
    return value[0]


def only_user(f: Function, value: Value, ops: Iterable[str] | str | None = None) -> int | None:
    """The one op that uses `value`, if it uses it once, is one of `ops` (None: any) and is
    not the function's return (a result the function returns must stay)."""
    uses = f.uses(value)
    if len(uses) != 1:
        return None
    user = uses[0][0]
    op = f.op(user)
    if isinstance(ops, str):
        ops = (ops,)
    if op == RETURN or ops is not None and op not in ops:
        return None
    return user


def replace_op(f: Function, old: Sequence[int], op: str, operands: Sequence[Value],
               attrs: dict[str, Any]) -> int:
    """Replace the chain of ops `old` (first to last; each read only by the next) by one `op`
    on `operands`, placed where the last one was, with its result type and its name (reports
    and sheets name a value by it); the old ops are erased. The new node."""
    last = old[-1]
    d = f.data(last)
    new = f.create_op(op, operands, list(d["types"]), attrs, before=last,
                      name_hint=f"{d['name']}_fused", loc=f.data(old[0])["loc"])
    for k in range(len(d["types"])):
        f.replace_all_uses((last, k), (new, k))
    name = d["name"]
    for n in reversed(old):
        f.erase(n)
    f.rename(new, name)
    return new
