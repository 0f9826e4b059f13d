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
    """Results by plan key, in the order they were first computed; `hits` counts reuses.
    `aliases` maps the key of a plan to the key of a run that answered it already (a traced
    run answers for the same plan without the trace)."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, Any]] = {}
        self.aliases: dict[str, str] = {}
        self.hits = 0

    def resolve(self, key: str) -> str:
        return self.aliases.get(key, key)

    def put(self, key: str, result: dict[str, Any]) -> None:
        self.results[key] = result

    def __len__(self) -> int:
        return len(self.results)
