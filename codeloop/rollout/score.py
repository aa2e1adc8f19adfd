"""Scoring a policy: the one path from sampled, verified trajectories to a score, for
`codeloop eval`, held-out evaluation during RL, the recipes' points, the refilter between recipe
stages and the pass-band curation.

`score(groups)` takes k trajectories per problem and gives `Scores`:
- `per_problem`: each problem's share of correct samples, over the samples that the
  infrastructure did not fail. A sample it failed (`Trajectory.unscorable`: the engine, a server
  or the sandbox) is left out and counted (`failed`); a problem with none left has no share.
- `metrics()`: the names every report uses (eval summaries, recipe points, and RL's logs under
  `eval/`): `pass@1` (the mean over problems of their shares: avg@k), its 95% interval
  `pass@1_low` and `pass@1_high` (`intervals.py`: bootstrap over problems), `problems` scored and
  `infrastructure_failures` (trajectories left out).

`score_policy` samples with `collect` and scores.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from codeloop.data.problems import Problem
from codeloop.intervals import interval
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent, collect
from codeloop.types import Trajectory

SCORE = "pass@1"  # the score's name in every report; its interval: SCORE + "_low", "_high"


@dataclass(frozen=True)
class Scores:
    """Per-problem shares of correct samples, the trajectories the infrastructure failed (left
    out), and the scored trajectories (for `rollout/stats.py`)."""

    per_problem: dict[str, float]
    failed: int = 0
    trajectories: list[Trajectory] = field(default_factory=list)

    @classmethod
    def merged(cls, parts: Iterable[Scores]) -> Scores:
        """One score of disjoint sets of problems (ranks' shares, an evaluation's lines)."""
        per_problem: dict[str, float] = {}
        failed, trajectories = 0, []
        for part in parts:
            per_problem |= part.per_problem
            failed += part.failed
            trajectories += part.trajectories
        return cls(per_problem, failed, trajectories)

    @classmethod
    def from_result(cls, record: Mapping[str, Any]) -> Scores:
        """A problem's score from its line of `codeloop eval`'s `results.jsonl`."""
        correct = record["correct"]
        return cls({str(record["id"]): sum(correct) / len(correct)}, record["failed"])

    def metrics(self) -> dict[str, float]:
        """`pass@1` with its interval, `problems` and `infrastructure_failures` (no `pass@1`
        when no problem could be scored)."""
        shares = list(self.per_problem.values())
        found: dict[str, float] = {"problems": len(shares), "infrastructure_failures": self.failed}
        if shares:
            low, high = interval(shares)
            found |= {SCORE: sum(shares) / len(shares), SCORE + "_low": low, SCORE + "_high": high}
        return found


def score(groups: Sequence[Sequence[Trajectory]]) -> Scores:
    """The scores of k verified trajectories per problem (the module docstring's rule)."""
    per_problem, failed, kept = {}, 0, []
    for group in groups:
        scorable = [t for t in group if not t.unscorable]
        failed += len(group) - len(scorable)
        if scorable:
            per_problem[scorable[0].prompt_id] = sum(t.reward == 1.0 for t in scorable) / len(
                scorable
            )
            kept += scorable
    return Scores(per_problem, failed, kept)


async def score_policy(
    agent: Agent,
    problems: Sequence[Problem],
    k: int,
    verifier: Verifier,
    *,
    seed: int = 0,
    progress: str = "",
) -> Scores:
    """k samples of each problem through the agent loop (seeded by `seed`, the problem id and
    the sample: `collect`), scored; a progress bar labelled `progress` when given."""
    return score(await collect(agent, problems, k, verifier, seed=seed, progress=progress))
