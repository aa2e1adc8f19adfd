"""Pass rates of a policy: k samples per problem through the agent loop, scored by the reward.

Used to refilter problems between recipe stages (keep what the policy does not solve reliably)
and by data curation (keep a pass-rate band).
"""

from __future__ import annotations

import asyncio
import copy
import zlib
from collections.abc import Sequence
from typing import Any

from codeloop.config import RewardConfig, RolloutConfig
from codeloop.data.curate import Removal
from codeloop.data.problems import Problem
from codeloop.reward import Verifier
from codeloop.rollout.agent import run_trajectory
from codeloop.rollout.engine import Engine, ToolExecutor
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.scheduler import Scheduler
from codeloop.types import Trajectory


async def sample_and_score(engine: Engine | Scheduler, tools: ToolExecutor, fmt: PromptFormat,
                           problems: Sequence[Problem], k: int, cfg: RolloutConfig,
                           verifier: Verifier, seed: int = 0
                           ) -> list[list[Trajectory]]:  # fmt: skip
    """k scored trajectories per problem (`reward` and `final_answer` set), in problem order.
    With a `Scheduler`, each trajectory leases one of its engines."""

    scheduler = engine if isinstance(engine, Scheduler) else Scheduler([engine], "static")

    async def sample(problem: Problem, i: int) -> Trajectory:
        sample_seed = zlib.crc32(f"{seed} {problem.id} {i}".encode()) & 0x7FFFFFFF
        async with scheduler.lease() as leased:
            return await run_trajectory(leased, tools, fmt, cfg, problem.id, i,
                                        fmt.prompt_ids(problem.problem), sample_seed)  # fmt: skip

    flat = await asyncio.gather(*(sample(p, i) for p in problems for i in range(k)))
    golds = [p.answer for p in problems for _ in range(k)]
    for trajectory, result in zip(flat, verifier.score_batch(list(zip(flat, golds, strict=True))),
                                  strict=True):  # fmt: skip
        trajectory.reward, trajectory.final_answer = result.reward, result.extracted
    return [list(flat[j * k : (j + 1) * k]) for j in range(len(problems))]


async def score_snapshot(model: Any, fmt: PromptFormat, problems: Sequence[Problem],
                         tools: ToolExecutor, rollout: RolloutConfig, reward: RewardConfig,
                         k: int, seed: int, dtype: Any = None,
                         **engine_options: int) -> list[list[Trajectory]]:  # fmt: skip
    """`sample_and_score` with a copy of `model` (in `dtype`, a torch dtype, when given;
    training may go on with the original) in an in-process engine (`engine_options`:
    `max_batch`, `max_kv_tokens`), and its own verifier."""
    from codeloop.rollout.hf_engine import TransformersEngine

    policy = copy.deepcopy(model) if dtype is None else copy.deepcopy(model).to(dtype=dtype)
    engine = TransformersEngine(policy, fmt.tokenizer, fmt.end_of_turn_ids, **engine_options)
    with Verifier(reward) as verifier:
        return await sample_and_score(engine, tools, fmt, problems, k, rollout, verifier, seed)


def policy_metrics(groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
    """Accuracy (avg@k), mean response tokens, and the tool-error ratio among correct ones."""
    flat = [t for g in groups for t in g]
    correct = [t for t in flat if t.reward == 1.0]
    calls = [r for t in correct for r in t.tool_calls]
    return {
        "accuracy": sum(t.reward or 0.0 for t in flat) / max(len(flat), 1),
        "response_tokens": sum(len(t.response_ids) for t in flat) / max(len(flat), 1),
        "tool_error_ratio_correct": sum(r.failed for r in calls) / len(calls) if calls else 0.0,
        "tool_calls": sum(len(t.tool_calls) for t in flat) / max(len(flat), 1),
    }


async def pass_rates(engine: Engine | Scheduler, tools: ToolExecutor, fmt: PromptFormat,
                     problems: Sequence[Problem], k: int, cfg: RolloutConfig, verifier: Verifier,
                     seed: int = 0) -> dict[str, float]:  # fmt: skip
    """{problem id: fraction of its k samples that are correct}."""
    groups = await sample_and_score(engine, tools, fmt, problems, k, cfg, verifier, seed)
    return {
        p.id: sum(t.reward or 0.0 for t in g) / k for p, g in zip(problems, groups, strict=True)
    }


async def pass_band(engine: Engine | Scheduler, tools: ToolExecutor, fmt: PromptFormat,
                    problems: Sequence[Problem], k: int, cfg: RolloutConfig, verifier: Verifier,
                    low: float, high: float, seed: int = 0
                    ) -> tuple[list[Problem], list[Removal]]:  # fmt: skip
    """Keep problems whose pass rate over k samples lies in [low, high]."""
    rates = await pass_rates(engine, tools, fmt, problems, k, cfg, verifier, seed)
    kept = [p for p in problems if low <= rates[p.id] <= high]
    removed = [Removal(p.id, "pass_rate", f"{rates[p.id]:.3f} outside [{low}, {high}]")
               for p in problems if not low <= rates[p.id] <= high]  # fmt: skip
    return kept, removed
