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

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from mplower.lowering.sharding import connect
from mplower.tune.cache import EvaluationCache, plan_key
from mplower.tune.evaluation import Candidate, Problem, evaluate


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
            self._client, self._cluster = connect(workers, scheduler)
            self.description = (f"dask scheduler {scheduler}" if scheduler is not None
                                else f"dask LocalCluster, {workers} workers")
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
