"""Data curation by pass rate: keep the problems a policy solves in a band of its k samples
(`codeloop data filter --pass-band`)."""

from __future__ import annotations

from collections.abc import Sequence

from codeloop.data.curate import Removal
from codeloop.data.problems import Problem
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent
from codeloop.rollout.score import score_policy


async def pass_band(
    agent: Agent,
    problems: Sequence[Problem],
    k: int,
    verifier: Verifier,
    *,
    low: float,
    high: float,
    seed: int = 0,
) -> tuple[list[Problem], list[Removal]]:
    """Keep problems whose pass rate over k samples (`rollout/score.py`) lies in [low, high];
    a problem whose every sample the infrastructure failed has none and is removed as such."""
    rates = (await score_policy(agent, problems, k, verifier, seed=seed)).per_problem
    kept, removed = [], []
    for problem in problems:
        rate = rates.get(problem.id)
        if rate is None:
            removed.append(Removal(problem.id, "pass_rate", "not scored: infrastructure failed"))
        elif low <= rate <= high:
            kept.append(problem)
        else:
            removed.append(Removal(problem.id, "pass_rate", f"{rate:.3f} outside [{low}, {high}]"))
    return kept, removed
