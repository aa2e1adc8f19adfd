"""A recipe's points (one evaluation each: `points.json` of `codeloop real`, the `points` of
`codeloop demo`'s summary): the policy in the run's engine scored (`rollout/score.py`) with its
trajectory statistics, and in words (a point's pass@1 with its interval, and the sentence that
ends a recipe)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from codeloop.config import RewardConfig, RolloutConfig
from codeloop.data.problems import Problem
from codeloop.engine.hf_engine import TransformersEngine
from codeloop.errors import RunError
from codeloop.intervals import compare, percent, verdict
from codeloop.reward import Verifier
from codeloop.reward.verifier import Gold
from codeloop.rollout.collect import Agent
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.score import SCORE, score_policy
from codeloop.rollout.stats import trajectory_stats
from codeloop.rollout.tools import ToolExecutor
from codeloop.types import ExecStatus, Trajectory

STATISTICS = (  # `rollout/stats.py` means that a point keeps
    "response_tokens",
    "policy_tokens",
    "tool_calls",
    "tool_error_ratio",
    "tool_error_ratio_correct",
    "tool_use",
    "cut_off_in_call",
    "malformed_calls",
)


async def score_point(
    engine: TransformersEngine,
    fmt: PromptFormat,
    problems: Sequence[Problem],
    tools: ToolExecutor,
    *,
    rollout: RolloutConfig,
    reward: RewardConfig,
    samples: int,
    seed: int,
    max_kv_tokens: int = 0,
    progress: str = "",
) -> dict[str, Any]:
    """The policy in `engine` (the run's own, with its current weights) scored on `problems`
    with `samples` trajectories each at the `rollout` settings, admitting at most
    `max_kv_tokens` reserved tokens (0: what the engine admits): the score
    (`rollout/score.py`), each problem's share (`per_problem`, for paired comparisons) and the
    `STATISTICS` of the scored trajectories."""
    with engine.reserving_at_most(max_kv_tokens), Verifier(reward) as verifier:
        agent = Agent(engine, tools, fmt, rollout)
        found = await score_policy(agent, problems, samples, verifier, seed=seed, progress=progress)
        printed = printed_right(found.trajectories, problems, verifier)
    if not found.per_problem:
        raise RunError(
            f"all {found.failed} trajectories failed in the engine or the sandbox: nothing to score"
        )
    means = trajectory_stats(found.trajectories)
    return {
        **found.metrics(),
        **{key: means[key] for key in STATISTICS},
        "printed_right_answered_wrong": printed,
        "per_problem": found.per_problem,
    }


def printed_right(
    trajectories: Sequence[Trajectory], problems: Sequence[Problem], verifier: Verifier
) -> float:
    """The share of `trajectories` answered wrong (reward 0) whose last tool output is itself a
    right answer (the last non-empty output of a call that ran, scored as the answer): the
    program computed it, and the model answered something else."""
    gold = {p.id: p.gold for p in problems}
    items: list[tuple[Trajectory | str, Gold]] = []
    for t in trajectories:
        if t.reward != 0.0 or t.prompt_id not in gold:
            continue
        outputs = [
            r.result.stdout.strip()
            for r in t.tool_calls
            if r.result.status == ExecStatus.OK and r.result.stdout.strip()
        ]
        if outputs:
            items.append((f"<answer>\\boxed{{{outputs[-1]}}}</answer>", gold[t.prompt_id]))
    right = sum(r.reward == 1.0 for r in verifier.score_batch(items)) if items else 0
    return right / max(1, len(trajectories))


def read_points(path: Path) -> list[dict[str, Any]]:
    """The points a run wrote so far (none when it wrote no file)."""
    if not path.is_file():
        return []
    points: list[dict[str, Any]] = json.loads(path.read_text())
    if any(SCORE not in p for p in points):
        raise RunError(
            f"{path}: points without {SCORE} (an older codeloop): use a new run directory"
        )
    return points


def score_text(point: Mapping[str, Any]) -> str:
    """A point's pass@1 with its interval (`12.5% [9.0, 16.5]`)."""
    return percent(point[SCORE], (point[SCORE + "_low"], point[SCORE + "_high"]))


def first_vs_last(points: Sequence[Mapping[str, Any]], what: str) -> str:
    """The sentence that ends a recipe: its last point against its first (SFT), paired over the
    problems both scored, or why it cannot be said."""
    first, last = points[0], points[-1]
    if len(points) < 2:
        return f"{what}: only the {first['stage']} point so far"
    result = compare(first["per_problem"], last["per_problem"])
    return f"{what}, {last['stage']} against {first['stage']}: " + verdict(
        result, first["stage"], last["stage"]
    )
