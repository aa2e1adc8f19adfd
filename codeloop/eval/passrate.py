"""Pass rates of a policy: k samples per problem through the agent loop, scored by the reward.

Used to refilter problems between recipe stages (keep what the policy does not solve reliably)
and by data curation (keep a pass-rate band).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence

from codeloop.config import RolloutConfig
from codeloop.data.problems import Problem
from codeloop.reward import Verifier
from codeloop.rollout.agent import run_trajectory
from codeloop.rollout.engine import Engine, ToolExecutor
from codeloop.rollout.prompt import PromptFormat


async def pass_rates(engine: Engine, tools: ToolExecutor, fmt: PromptFormat,
                     problems: Sequence[Problem], k: int, cfg: RolloutConfig, verifier: Verifier,
                     seed: int = 0) -> dict[str, float]:  # fmt: skip
    """{problem id: fraction of its k samples that are correct}."""

    async def sample(problem: Problem, i: int) -> float:
        sample_seed = zlib.crc32(f"{seed} {problem.id} {i}".encode()) & 0x7FFFFFFF
        trajectory = await run_trajectory(engine, tools, fmt, cfg, problem.id, i,
                                          fmt.prompt_ids(problem.problem), sample_seed)  # fmt: skip
        return verifier.score(trajectory, problem.answer).reward

    rewards = await asyncio.gather(*(sample(p, i) for p in problems for i in range(k)))
    return {p.id: sum(rewards[j * k : (j + 1) * k]) / k for j, p in enumerate(problems)}
