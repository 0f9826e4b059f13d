"""Where candidate plans are evaluated: in this process, or on dask.distributed.

`--workers 0` evaluates here, one plan after another. `--workers N` starts a LocalCluster of N
single-threaded worker processes; `--scheduler ADDRESS` connects to a running cluster. The
problem (module, weights, calibration and evaluation data) is scattered once to every worker
(`broadcast=True`), and each task carries only its plan; a worker builds its workspace from
the problem on its first task. Results come back in the order the plans were asked for, and
an evaluation is a pure function of (problem, plan), so the search takes the same steps and
writes the same bytes as the serial run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.tune.cache import EvaluationCache, plan_key
from mplower.tune.evaluation import Candidate, Problem, evaluate

# How long `--scheduler` may take to answer, connection and handshake each: a scheduler answers
# in milliseconds, and dask's own default (30 s, retried) kept a closed port waiting 36 s.
CONNECT_TIMEOUT_S = 5.0


def _unreachable(address: str, e: BaseException) -> DiagnosticError:
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    return DiagnosticError.at(Location(address, 0, 0),
                              f"cannot connect to the dask scheduler: {reason}")


def _check_scheduler(address: str) -> None:
    """A located error unless a dask scheduler answers at `address` within the timeout.

    dask.distributed.Client waits without a bound for a service that accepts the connection
    and says nothing, and reads whatever another service sends as a message length (a
    MemoryError for an HTTP server's reply); so the scheduler is asked who it is first, over
    dask's own comm, under one deadline."""
    import asyncio
    import socket

    from distributed.comm import connect
    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, where = parse_address(address)
        if scheme == "tcp":  # a closed port is refused at once; dask retries until its timeout
            socket.create_connection(parse_host_port(where), CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError, TypeError) as e:
        raise _unreachable(address, e) from None

    async def identity() -> object:
        comm = await connect(address, timeout=CONNECT_TIMEOUT_S)
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


class Evaluator:
    """Evaluates plans with a budget of fresh evaluations, through the content cache."""

    def __init__(self, problem: Problem, budget: int, *, workers: int = 0,
                 scheduler: str | None = None,
                 progress: Callable[[int], None] | None = None):
        self.problem, self.budget = problem, budget
        self.cache = EvaluationCache()
        self.progress = progress
        self.description = "serial"
        self._client = self._cluster = self._problem_future = None
        if scheduler is not None or workers > 0:
            from dask.distributed import Client, LocalCluster

            if scheduler is not None:
                _check_scheduler(scheduler)
                try:
                    self._client = Client(scheduler, timeout=CONNECT_TIMEOUT_S)
                except Exception as e:  # noqa: BLE001  (gone since the check: one line)
                    raise _unreachable(scheduler, e) from None
                self.description = f"dask scheduler {scheduler}"
            else:
                # The cores are shared out: each worker's GEMM threads (numba's count) get
                # cores / workers, so N workers do not oversubscribe the machine. Results do not
                # depend on the thread count (docs/architecture.md, determinism).
                threads = max(1, (os.cpu_count() or 1) // workers)
                self._cluster = LocalCluster(n_workers=workers, threads_per_worker=1,
                                             processes=True, dashboard_address=None,
                                             env={"NUMBA_NUM_THREADS": str(threads)})
                self._client = Client(self._cluster)
                self.description = f"dask LocalCluster, {workers} workers"
            self._problem_future = self._client.scatter(problem, broadcast=True)

    @property
    def remaining(self) -> int:
        return self.budget - len(self.cache)

    def evaluate(self, candidates: Sequence[Candidate]) -> list[dict[str, Any] | None]:
        """The result of each plan, in order; None for a plan the budget no longer covers.
        Plans are evaluated at most once (the cache), fresh ones in parallel on a cluster."""
        keys = [self.cache.resolve(plan_key(self.problem, c)) for c in candidates]
        fresh: dict[str, Candidate] = {}
        for k, c in zip(keys, candidates, strict=True):
            if k not in self.cache.results and k not in fresh and len(fresh) < self.remaining:
                fresh[k] = c
        if fresh:
            for (k, c), result in zip(fresh.items(), self._run(list(fresh.values())),
                                      strict=True):
                self.cache.put(k, {"key": k, **result})
                if c.trace:  # a traced run is also the plain run of its plan: one evaluation
                    plain = replace(c, trace=False)
                    self.cache.aliases[plan_key(self.problem, plain)] = k
        out = []
        for k in keys:
            out.append(self.cache.results.get(k))
            if k not in fresh and k in self.cache.results:
                self.cache.hits += 1
        return out

    def _run(self, candidates: list[Candidate]) -> list[dict[str, Any]]:
        if self._client is None:
            results = []
            for c in candidates:
                results.append(evaluate(self.problem, c))
                if self.progress:
                    self.progress(1)
            return results
        from dask.distributed import as_completed

        futures = [self._client.submit(evaluate, self._problem_future, c, pure=False)
                   for c in candidates]
        for _ in as_completed(futures):
            if self.progress:
                self.progress(1)
        return self._client.gather(futures)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._cluster is not None:
            self._cluster.close()
