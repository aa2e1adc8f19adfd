"""Pass rates of a policy: k samples per problem through the agent loop, scored by the reward.

Used to refilter problems between recipe stages (keep what the policy does not solve reliably)
and by data curation (keep a pass-rate band).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from codeloop.config import RewardConfig, RolloutConfig
from codeloop.data.curate import Removal
from codeloop.data.problems import Problem
from codeloop.errors import RunError
from codeloop.intervals import interval
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent, collect, pass_rates
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.stats import problem_shares, trajectory_stats
from codeloop.rollout.tools import ToolExecutor
from codeloop.types import Trajectory

if TYPE_CHECKING:
    from codeloop.engine.hf_engine import TransformersEngine


async def score_policy(
    engine: TransformersEngine,
    fmt: PromptFormat,
    problems: Sequence[Problem],
    tools: ToolExecutor,
    rollout: RolloutConfig,
    reward: RewardConfig,
    k: int,
    seed: int,
    progress: str = "",
    max_kv_tokens: int = 0,
    engine_stats: dict[str, float] | None = None,
) -> list[list[Trajectory]]:
    """`collect` of the policy in `engine` (the run's own, with its current weights) with its
    own verifier, admitting at most `max_kv_tokens` reserved tokens (0: what the engine
    admits). `engine_stats`, when given, receives what the engine did meanwhile
    (`EngineStats.metrics`)."""
    before = engine.stats()
    with engine.reserving_at_most(max_kv_tokens), Verifier(reward) as verifier:
        agent = Agent(engine, tools, fmt, rollout)
        groups = await collect(agent, problems, k, verifier, seed, progress=progress)
    if engine_stats is not None:
        engine_stats.update(engine.stats().since(before).metrics())
    return groups


def policy_metrics(groups: Sequence[Sequence[Trajectory]]) -> dict[str, Any]:
    """Accuracy (avg@k, over problems) with its 95% interval over problems (`intervals.py`) and each
    problem's share (`per_problem`, for paired comparisons), mean response and policy tokens,
    tool calls, and the tool-error ratio among correct answers (`rollout/stats.py`), over the
    trajectories that infrastructure did not fail (`infrastructure_failures` counts those)."""
    shares, failed = problem_shares(groups)
    if not shares:
        raise RunError(
            f"all {failed} trajectories failed in the engine or the sandbox: nothing to score"
        )
    found = trajectory_stats([t for g in groups for t in g if not t.unscorable])
    keys = ("response_tokens", "policy_tokens", "tool_error_ratio_correct", "tool_calls")
    return {
        # avg@k: the mean over problems of their shares, the quantity its interval is of (a
        # problem that lost samples to infrastructure counts as much as any other)
        "accuracy": sum(shares.values()) / len(shares),
        **{key: found[key] for key in keys},
        "accuracy_interval95": list(interval(list(shares.values()))),
        "problems": len(shares),
        "infrastructure_failures": failed,
        "per_problem": shares,
    }


async def pass_band(
    agent: Agent,
    problems: Sequence[Problem],
    k: int,
    verifier: Verifier,
    low: float,
    high: float,
    seed: int = 0,
) -> tuple[list[Problem], list[Removal]]:
    """Keep problems whose pass rate over k samples lies in [low, high]."""
    rates = await pass_rates(agent, problems, k, verifier, seed)
    kept = [p for p in problems if low <= rates[p.id] <= high]
    removed = [
        Removal(p.id, "pass_rate", f"{rates[p.id]:.3f} outside [{low}, {high}]")
        for p in problems
        if not low <= rates[p.id] <= high
    ]
    return kept, removed
