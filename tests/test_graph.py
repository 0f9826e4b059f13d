"""The rewriter API of Function: insertion order, use replacement, erasure, names.

After every mutation the program order must be a topological order of the graph, operand
positions must stay 0..n-1, and the verifier must accept the function; `_check` asserts all three.
"""

from __future__ import annotations

import random

import networkx as nx
import pytest
from conftest import func_ir

from mplower.ir.graph import ARG, RETURN, Function
from mplower.ir.parser import parse
from mplower.ir.printer import print_function
from mplower.ir.types import tensor
from mplower.ir.verifier import verify_function

T4 = tensor((4,), "f32")
T = "tensor<4xf32>"


def _function(body: str, args: str = f"%x: {T}") -> Function:
    return parse(func_ir(body, args=args, result=T)).function()


def _check(f: Function) -> None:
    order = f.ops()
    pos = {n: i for i, n in enumerate(order)}
    assert set(order) | set(f.args) == set(f.graph.nodes)
    assert len(order) == len(set(order))
    for u, v in f.graph.edges():
        assert u in f.args or pos[u] < pos[v], (f.data(u)["name"], f.data(v)["name"])
    assert nx.is_directed_acyclic_graph(f.graph)
    assert f.op(order[-1]) == RETURN
    for n in order:
        assert sorted(p for _, _, p in f.graph.in_edges(n, data="pos")) == list(
            range(f.graph.in_degree(n)))
    assert verify_function(f) == []


def _names(f: Function) -> list[str]:
    return [f.data(n)["name"] or f.op(n) for n in f.ops()]


@pytest.fixture
def chain() -> Function:
    return _function(f"%a = mp.relu %x : ({T}) -> {T}\n%b = mp.neg %a : ({T}) -> {T}\n"
                     f"return %b : {T}")


def test_create_op_before_and_after_an_op(chain):
    a, b, _ = chain.ops()
    pre = chain.create_op("mp.exp", [(a, 0)], [T4], before=b, name_hint="pre")
    post = chain.create_op("mp.exp", [(a, 0)], [T4], after=a, name_hint="post")
    assert _names(chain) == ["a", "post", "pre", "b", RETURN]
    assert chain.operands(pre) == [(a, 0)] and chain.data(post)["loc"] == chain.data(a)["loc"]
    _check(chain)


def test_several_ops_after_one_anchor_keep_creation_order(chain):
    a = chain.ops()[0]
    first = chain.create_op("mp.exp", [(a, 0)], [T4], after=a, name_hint="first")
    chain.create_op("mp.neg", [(first, 0)], [T4], after=a, name_hint="second")
    assert _names(chain) == ["a", "first", "second", "b", RETURN]
    _check(chain)


def test_create_op_after_an_argument_goes_to_the_start_of_the_body(chain):
    x = chain.args[0]
    c1 = chain.create_op("mp.exp", [(x, 0)], [T4], after=x, name_hint="c1")
    chain.create_op("mp.neg", [(c1, 0)], [T4], after=x, name_hint="c2")
    assert _names(chain) == ["c1", "c2", "a", "b", RETURN]
    assert chain.data(c1)["loc"] == chain.data(x)["loc"]
    _check(chain)


def test_create_op_relative_to_a_pending_op(chain):
    a, b, _ = chain.ops()
    p = chain.create_op("mp.exp", [(a, 0)], [T4], before=b, name_hint="p")
    chain.create_op("mp.neg", [(p, 0)], [T4], after=p, name_hint="q")
    chain.create_op("mp.relu", [(a, 0)], [T4], before=p, name_hint="r")
    assert _names(chain) == ["a", "r", "p", "q", "b", RETURN]
    _check(chain)


def test_create_op_needs_exactly_one_anchor(chain):
    a, b, _ = chain.ops()
    with pytest.raises(ValueError):
        chain.create_op("mp.exp", [(a, 0)], [T4])
    with pytest.raises(ValueError):
        chain.create_op("mp.exp", [(a, 0)], [T4], before=b, after=a)


def test_long_chains_of_insertions_do_not_recurse(chain):
    # Materializing the order used to recurse once per pending op: 5000 raised RecursionError.
    a = chain.ops()[0]
    prev = a
    for _ in range(5000):
        prev = chain.create_op("mp.neg", [(prev, 0)], [T4], after=prev, name_hint="n")
    b = chain.ops()[-2]
    for _ in range(3000):
        b = chain.create_op("mp.relu", [(a, 0)], [T4], before=b, name_hint="r")
    assert len(chain.ops()) == 2 + 5000 + 3000 + 1
    assert chain.ops()[1:5001] == sorted(chain.ops()[1:5001])  # the chain in creation order
    _check(chain)


def test_replace_all_uses_moves_every_use_except_excluded(chain):
    a, b, ret = chain.ops()
    x = chain.args[0]
    c = chain.create_op("mp.exp", [(a, 0)], [T4], after=a, name_hint="c")
    d = chain.create_op("mp.add", [(a, 0), (a, 0)], [T4], after=c, name_hint="d")
    assert chain.replace_all_uses((a, 0), (c, 0), exclude=[c]) == 3  # b and both of d's
    assert chain.operands(c) == [(a, 0)]
    assert chain.operands(d) == [(c, 0), (c, 0)]
    assert chain.operands(b) == [(c, 0)]
    assert chain.uses((a, 0)) == [(c, 0)]
    assert chain.replace_all_uses((x, 0), (x, 0)) == 1
    assert chain.operands(ret) == [(b, 0)]
    _check(chain)


def test_replace_all_uses_keeps_operand_positions(chain):
    a, b, _ = chain.ops()
    x = chain.args[0]
    s = chain.create_op("mp.sub", [(x, 0), (a, 0)], [T4], before=b, name_hint="s")
    chain.replace_all_uses((x, 0), (a, 0), exclude=[a])
    assert chain.operands(s) == [(a, 0), (a, 0)]
    chain.replace_all_uses((a, 0), (x, 0), exclude=[b])
    assert chain.operands(s) == [(x, 0), (x, 0)]
    _check(chain)


def test_set_operand_replaces_one_position(chain):
    a, b, _ = chain.ops()
    x = chain.args[0]
    s = chain.create_op("mp.sub", [(a, 0), (a, 0)], [T4], before=b, name_hint="s")
    chain.set_operand(s, 1, (x, 0))
    assert chain.operands(s) == [(a, 0), (x, 0)]
    chain.set_operand(s, 0, (x, 0))
    assert chain.operands(s) == [(x, 0), (x, 0)]
    assert chain.graph.in_degree(s) == 2
    _check(chain)


def test_erase_refuses_an_op_whose_results_are_used(chain):
    a = chain.ops()[0]
    with pytest.raises(ValueError, match="cannot erase mp.relu: its results are used"):
        chain.erase(a)
    assert a in chain.graph and chain.ops()[0] == a


def test_erase_removes_the_op_and_frees_its_name(chain):
    a, b, ret = chain.ops()
    x = chain.args[0]
    chain.replace_all_uses((b, 0), (a, 0))
    chain.erase(b)
    assert b not in chain.graph and _names(chain) == ["a", RETURN]
    assert chain.fresh_name("b") == "b"
    chain.replace_all_uses((a, 0), (x, 0))
    chain.erase(a)
    assert chain.ops() == [ret] and len(chain) == 1
    _check(chain)


def test_erasing_an_anchor_keeps_the_ops_inserted_around_it(chain):
    a, b, _ = chain.ops()
    pre = chain.create_op("mp.exp", [(a, 0)], [T4], before=b, name_hint="pre")
    post = chain.create_op("mp.exp", [(pre, 0)], [T4], after=b, name_hint="post")
    chain.replace_all_uses((b, 0), (post, 0))
    chain.erase(b)
    assert _names(chain) == ["a", "pre", "post", RETURN]
    _check(chain)


def test_fresh_names_are_unique_and_avoid_arguments():
    f = _function(f"%0 = mp.relu %x : ({T}) -> {T}\nreturn %0 : {T}")
    first = f.ops()[0]
    assert f.fresh_name("x") == "x_1" and f.fresh_name("0") == "0_1"
    assert f.fresh_name("") == "v" and f.fresh_name("new") == "new"
    made = [f.create_op("mp.neg", [(first, 0)], [T4], after=first, name_hint="x")
            for _ in range(12)]
    names = [f.data(n)["name"] for n in made]
    assert names == ["x_1", "x_2", "x_3", "x_4", "x_5", "x_6", "x_7", "x_8", "x_9", "x_10",
                     "x_11", "x_12"]
    all_names = [f.data(n)["name"] for n in f.args + f.ops() if f.data(n)["name"]]
    assert len(all_names) == len(set(all_names))


def test_fresh_name_reuses_the_lowest_freed_suffix(chain):
    a = chain.ops()[0]
    made = [chain.create_op("mp.neg", [(a, 0)], [T4], after=a, name_hint="t") for _ in range(4)]
    assert [chain.data(n)["name"] for n in made] == ["t", "t_1", "t_2", "t_3"]
    chain.erase(made[2])
    chain.erase(made[1])
    assert chain.fresh_name("t") == "t_1"
    n = chain.create_op("mp.neg", [(a, 0)], [T4], after=a, name_hint="t")
    assert chain.data(n)["name"] == "t_1" and chain.fresh_name("t") == "t_2"
    _check(chain)


def test_op_without_results_gets_no_name(chain):
    a = chain.ops()[0]
    n = chain.create_op("x.effect", [(a, 0)], [], after=a, name_hint="eff")
    assert chain.data(n)["name"] == ""
    assert "x.effect %a : (tensor<4xf32>) -> ()" in print_function(chain)


def test_random_insertions_and_erasures_keep_a_topological_order():
    rng = random.Random(1234)
    f = _function(f"%a = mp.relu %x : ({T}) -> {T}\n%b = mp.neg %a : ({T}) -> {T}\n"
                  f"%c = mp.add %a, %b : ({T}, {T}) -> {T}\nreturn %c : {T}")
    for step in range(600):
        ops = [n for n in f.ops() if f.op(n) != RETURN]
        ret = f.return_node
        choice = rng.random()
        if choice < 0.55 or len(ops) < 3:
            anchor = rng.choice(ops + f.args)
            pos = {n: i for i, n in enumerate(f.ops())}
            # operands must come before the new op: values at or above the anchor
            if f.op(anchor) == ARG:
                pool = list(f.args)
                kw = {"after": anchor}
            elif rng.random() < 0.5:
                pool = f.args + [n for n in ops if pos[n] <= pos[anchor]]
                kw = {"after": anchor}
            else:
                pool = f.args + [n for n in ops if pos[n] < pos[anchor]]
                kw = {"before": anchor}
            srcs = [rng.choice(pool) for _ in range(rng.choice((1, 2)))]
            op = "mp.neg" if len(srcs) == 1 else "mp.mul"
            f.create_op(op, [(s, 0) for s in srcs], [T4], name_hint=f"s{step}", **kw)
        elif choice < 0.8:
            victim = rng.choice(ops)
            pos = {n: i for i, n in enumerate(f.ops())}
            earlier = [n for n in f.args + ops if n in f.args or pos[n] < pos[victim]]
            f.replace_all_uses((victim, 0), (rng.choice(earlier), 0))
            f.erase(victim)
        else:
            user = rng.choice(ops + [ret])
            pos = {n: i for i, n in enumerate(f.ops())}
            operands = f.operands(user)
            if operands:
                earlier = f.args + [n for n in ops if pos[n] < pos[user]]
                f.set_operand(user, rng.randrange(len(operands)), (rng.choice(earlier), 0))
        if step % 50 == 0:
            _check(f)
    _check(f)
    text = print_function(f)
    assert parse(f"module {{\n{text}\n}}\n").function().ops() and text.count("return") == 1


def test_walk_visits_ops_of_one_kind_in_order(chain):
    a, b, _ = chain.ops()
    c = chain.create_op("mp.relu", [(b, 0)], [T4], after=b, name_hint="c")
    assert list(chain.walk("mp.relu")) == [a, c]
    assert list(chain.walk()) == chain.ops()


def test_value_name_and_uses_of_an_argument(chain):
    x = chain.args[0]
    a = chain.ops()[0]
    assert chain.value_name((x, 0)) == "%x"
    assert chain.uses((x, 0)) == [(a, 0)]
    assert chain.type_of((x, 0)) == T4 and chain.operand_types(a) == [T4]
