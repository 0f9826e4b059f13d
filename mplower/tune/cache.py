"""Every evaluated plan, keyed by its content: the problem's hash and the plan's canonical JSON.

The search asks for the same plan more than once (a greedy step that re-adds a unit, the
bisection that retries a prefix, a uniform sheet's plan taken as a seed); a hit costs nothing
and is not counted as an evaluation. Keys are sha256 digests, so they are the same in every
process and on every run of the same problem.
"""

from __future__ import annotations

import json
from typing import Any

from mplower.tune.evaluation import Candidate, Problem, digest


def plan_key(problem: Problem, candidate: Candidate) -> str:
    return digest(problem.key, json.dumps(candidate.to_json(), sort_keys=True))


class EvaluationCache:
    """Results by plan key, in the order they were first computed; `hits` counts reuses."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, Any]] = {}
        self.hits = 0

    def get(self, key: str) -> dict[str, Any] | None:
        found = self.results.get(key)
        if found is not None:
            self.hits += 1
        return found

    def put(self, key: str, result: dict[str, Any]) -> None:
        self.results[key] = result

    def __len__(self) -> int:
        return len(self.results)
