"""Work over samples spread on dask.distributed, with results that do not depend on where it ran.

A pass that runs the model over a data set (calibrate's statistics, GPTQ's Hessians, an
evaluation's figures) cuts the samples into shards that the data alone fixes (never the number
of workers), computes one partial result per shard with a pure task, and combines the partials
in an order that the shard indices alone fix (`reduce_shards`). The serial run takes the same
shards and the same order, so 0, 1 or N workers give the same bits: for statistics whose
combine is exact (integer counts, minima and maxima) any order would do; for float sums (a
Hessian 2 X^T X summed over samples) the fixed partition and the fixed tree are what make the
rounding the same everywhere.

`SERIAL` runs every task in this process. `DaskShards` runs them on a dask LocalCluster of N
worker processes, or on a running cluster (`--scheduler ADDRESS`, as `mplower tune` spells it),
or on a client the caller made (tests); dask is imported, and the cluster started, on the first
task, so a command that asks for workers and runs no pass that uses them pays nothing. A worker
must see the files the tasks name (weights, data) at the same paths: the current folder for a
LocalCluster, a shared file system for a cluster (docs/distributed.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from mplower.ir.diagnostics import Diagnostic, DiagnosticError, Location

S = TypeVar("S")
T = TypeVar("T")
R = TypeVar("R")

# How long `--scheduler` may take to answer, connection and handshake each: a scheduler answers
# in milliseconds, and dask's own default (30 s, retried) kept a closed port waiting 36 s.
CONNECT_TIMEOUT_S = 5.0


def shard_ranges(count: int, size: int) -> list[range]:
    """Items 0..count-1 in consecutive shards of `size` (the last one shorter): a partition
    fixed by the data, whatever runs it."""
    if size < 1:
        raise ValueError(f"shard size must be at least 1, got {size}")
    return [range(i, min(i + size, count)) for i in range(0, count, size)]


class Serial:
    """Runs each task here, when it is submitted: a shard's partial is combined as soon as it
    exists, so the partials held at once are the depth of the reduction tree (or one)."""

    def share(self, value: S) -> S:
        return value

    def submit(self, fn: Callable[..., R], *args: Any) -> R:
        return fn(*args)

    def result(self, handle: R) -> R:
        return handle

    def close(self) -> None:
        pass


SERIAL = Serial()


@dataclass(frozen=True)
class _Failure:
    """A task's DiagnosticError as a value: it pickles (the exception's own arguments do not
    rebuild it) and travels through the reduction to the client, which raises it."""

    diagnostics: list[Diagnostic]
    source: str | None

    def raise_(self) -> None:
        e = DiagnosticError(*self.diagnostics)
        e.source = self.source
        raise e


def _guarded(fn: Callable[..., R], *args: Any) -> R | _Failure:
    try:
        return fn(*args)
    except DiagnosticError as e:
        return _Failure(e.diagnostics, e.source)


def _combine_guarded(combine: Callable[[R, R], R], a: R | _Failure, b: R | _Failure
                     ) -> R | _Failure:
    # The left operand's failure wins: the reported error is the first failing shard's, as in
    # the serial run, which stops there.
    if isinstance(a, _Failure):
        return a
    if isinstance(b, _Failure):
        return b
    return combine(a, b)


class DaskShards:
    """Runs tasks on dask.distributed: a LocalCluster of `workers` processes, the cluster at
    `scheduler`, or the caller's `client` (which it leaves open)."""

    def __init__(self, workers: int = 0, scheduler: str | None = None, client: Any = None):
        if client is None and scheduler is None and workers < 1:
            raise ValueError("DaskShards needs workers >= 1, a scheduler or a client")
        self.workers, self.scheduler = workers, scheduler
        self._client, self._own = client, client is None
        self._cluster = None

    def start(self) -> None:
        """Connect (start the LocalCluster) now rather than on the first task."""
        if self._client is None:
            self._client, self._cluster = connect(self.workers, self.scheduler)

    @property
    def client(self) -> Any:
        self.start()
        return self._client

    def share(self, value: S) -> Any:
        """`value` on every worker once (tasks that take it carry only a reference)."""
        return self.client.scatter(value, broadcast=True, hash=False)

    def submit(self, fn: Callable[..., R], *args: Any) -> Any:
        return self.client.submit(_guarded, fn, *args, pure=False)

    def wait(self, handles: Sequence[Any], done: Callable[[int], None]) -> None:
        """Waits for every task, calling `done(i)` as task i ends (in any order)."""
        from dask.distributed import as_completed

        index = {h.key: i for i, h in enumerate(handles)}
        for h in as_completed(list(handles)):
            done(index[h.key])

    def result(self, handle: Any) -> Any:
        value = handle.result()
        if isinstance(value, _Failure):
            value.raise_()
        return value

    def close(self) -> None:
        """Close the client and cluster this made (a caller's client stays open)."""
        if self._own and self._client is not None:
            self._client.close()
            if self._cluster is not None:
                self._cluster.close()
            self._client = self._cluster = None


Executor = Serial | DaskShards


def executor_for(workers: int = 0, scheduler: str | None = None) -> Executor:
    """`SERIAL` for 0 workers and no scheduler, else a `DaskShards` (connected on first use)."""
    if scheduler is None and workers == 0:
        return SERIAL
    return DaskShards(workers, scheduler)


def reduce_shards(executor: Executor | None, task: Callable[[S, T], R], shared: S,
                  shards: Sequence[T], combine: Callable[[R, R], R], *, tree: bool = True,
                  done: Callable[[int], None] | None = None) -> R:
    """combine over task(shared, shard) for every shard, in an order the shard count alone
    fixes. `tree`: the partials meet in a binary tree, pairwise, shard i with its neighbour as
    the bits of i say (((0+1)+(2+3))+4 for five), reduced on the workers where they are (float
    sums: Hessians); otherwise a left fold in shard order on the client (combines that are
    exact in any order: counts, extremes). `shared` goes to each worker once. `combine`
    returns a new value and leaves its arguments as they were (a dask task may rerun).
    `done(i)` is called as shard i's task ends. A DiagnosticError raised by a task is raised
    here: the first failing shard's."""
    if not shards:
        raise ValueError("reduce_shards needs at least one shard")
    ex = executor or SERIAL
    ref = ex.share(shared)
    serial = isinstance(ex, Serial)
    if not tree:
        # Serially each task runs as its turn comes; on dask all are submitted at once.
        futures = None if serial else [ex.submit(task, ref, s) for s in shards]
        acc = None
        for i, s in enumerate(shards):
            part = ex.result(ex.submit(task, ref, s) if futures is None else futures[i])
            if futures is not None:
                futures[i] = None  # folded: its partial may leave the worker
            if done is not None:
                done(i)
            acc = part if i == 0 else combine(acc, part)
        return acc
    # A binary counter of partials: stack[j] covers a run of 2**height shards; two runs of one
    # height merge into the next, so the tree is fixed by the shard count alone.
    stack: list[tuple[int, Any]] = []
    leaves = []
    for i, s in enumerate(shards):
        h = ex.submit(task, ref, s)
        if not serial:  # a serial partial is a value: only the tree's nodes hold it
            leaves.append(h)
        elif done is not None:
            done(i)
        node = (0, h)
        while stack and stack[-1][0] == node[0]:
            height, left = stack.pop()
            node = (height + 1, ex.submit(_combine_guarded, combine, left, node[1]))
        stack.append(node)
    root = stack.pop()[1]
    while stack:  # the shorter runs on the right join first: (... + (run + run))
        root = ex.submit(_combine_guarded, combine, stack.pop()[1], root)
    if leaves and done is not None:
        ex.wait(leaves, done)
    del leaves
    return ex.result(root)


def sum_over_shards(executor: Executor | None, task: Callable[[S, T], Any], shared: S,
                    shards: Sequence[T], done: Callable[[int], None] | None = None) -> Any:
    """The sum of task(shared, shard) over shards (arrays, such as GPTQ's per-layer Hessian
    2 X^T X of each shard's samples), added in `reduce_shards`'s fixed tree: the same bits
    with any number of workers, given a task whose own sum has a fixed order."""
    return reduce_shards(executor, task, shared, shards, _add, tree=True, done=done)


def _add(a: Any, b: Any) -> Any:
    return a + b


# ---- connecting ----------------------------------------------------------------------------

def _unreachable(address: str, e: BaseException) -> DiagnosticError:
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    return DiagnosticError.at(Location(address, 0, 0),
                              f"cannot connect to the dask scheduler: {reason}")


def check_scheduler(address: str) -> None:
    """A located error unless a dask scheduler answers at `address` within the timeout.

    dask.distributed.Client waits without a bound for a service that accepts the connection
    and says nothing, and reads whatever another service sends as a message length (a
    MemoryError for an HTTP server's reply); so the scheduler is asked who it is first, over
    dask's own comm, under one deadline."""
    import asyncio
    import socket

    from distributed.comm import connect as comm_connect
    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, where = parse_address(address)
        if scheme == "tcp":  # a closed port is refused at once; dask retries until its timeout
            socket.create_connection(parse_host_port(where), CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError, TypeError) as e:
        raise _unreachable(address, e) from None

    async def identity() -> object:
        comm = await comm_connect(address, timeout=CONNECT_TIMEOUT_S)
        try:
            await comm.write({"op": "identity"})
            return await comm.read()
        finally:
            comm.abort()

    try:
        reply = asyncio.run(asyncio.wait_for(identity(), CONNECT_TIMEOUT_S))
    except TimeoutError:
        raise DiagnosticError.at(Location(address, 0, 0), (
            f"cannot connect to the dask scheduler: no answer within "
            f"{CONNECT_TIMEOUT_S:g} s")) from None
    except Exception as e:  # noqa: BLE001  (refused, a bad address, another protocol)
        if isinstance(e, MemoryError):  # another service's bytes read as a message length
            e = ValueError("the service there does not speak dask's protocol")
        raise _unreachable(address, e) from None
    if not (isinstance(reply, dict) and reply.get("type") == "Scheduler"):
        raise DiagnosticError.at(Location(address, 0, 0), (
            "cannot connect to the dask scheduler: the service there is not a "
            "dask scheduler"))


def connect(workers: int, scheduler: str | None) -> tuple[Any, Any]:
    """A dask Client of the cluster at `scheduler`, or of a new LocalCluster of `workers`
    single-threaded processes; and that cluster (None for a scheduler's)."""
    from dask.distributed import Client, LocalCluster

    if scheduler is not None:
        check_scheduler(scheduler)
        try:
            return Client(scheduler, timeout=CONNECT_TIMEOUT_S), None
        except Exception as e:  # noqa: BLE001  (gone since the check: one line)
            raise _unreachable(scheduler, e) from None
    # The cores are shared out: each worker's GEMM threads (numba's count) get cores / workers,
    # so N workers do not oversubscribe the machine. Results do not depend on the thread count
    # (docs/architecture.md, determinism).
    threads = max(1, (os.cpu_count() or 1) // workers)
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                           dashboard_address=None, env={"NUMBA_NUM_THREADS": str(threads)})
    return Client(cluster), cluster
