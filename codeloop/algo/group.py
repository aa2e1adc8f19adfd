"""One prompt's group: its scored samples, the G of them that train, and their advantages.

`make_group` applies the algorithm to a prompt's samples: a sample whose end infrastructure
decided (a sandbox fault, or an engine or inference server that failed it:
`Trajectory.unscorable`) is evidence of nothing and never kept (neither rewarded nor
penalised); the rest are
resampled to the G that train (`algo.resample`: GRPO-RoC or a variant) and given group
advantages. A group whose kept rewards are all equal has no signal. `MAX_REFILL_ROUNDS` bounds
how often a step draws more prompts to replace groups without signal
(`algo.drop_zero_signal_groups`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from codeloop.algo.advantage import group_advantages, has_signal
from codeloop.algo.resample import resample
from codeloop.config import AlgoConfig
from codeloop.data.problems import Problem
from codeloop.types import Trajectory

MAX_REFILL_ROUNDS = 4


@dataclass
class Group:
    problem: Problem
    sampled: list[Trajectory]
    kept: list[Trajectory]
    advantages: list[float]
    position: int = 0  # in the data order: the same on every rank

    @property
    def has_signal(self) -> bool:
        """Its kept rewards differ (else its advantages are all 0 and it trains nothing)."""
        return has_signal([t.reward or 0.0 for t in self.kept])


def make_group(
    problem: Problem,
    sampled: list[Trajectory],
    algo: AlgoConfig,
    rng: random.Random,
    *,
    position: int = 0,
) -> Group:
    """The scored samples of one prompt, resampled to the G that train, with advantages."""
    healthy = [t for t in sampled if not t.unscorable]  # no engine, server or sandbox failure
    kept = resample(healthy, algo.group_size, algo.resample, rng) if healthy else []
    advantages = group_advantages([t.reward or 0.0 for t in kept], algo.adv_eps)
    return Group(problem, list(sampled), kept, advantages, position)
