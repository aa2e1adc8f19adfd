"""One prompt's group: its scored samples, the G of them that train, and their advantages.

`make_group` applies the algorithm to a prompt's samples: a sample whose end infrastructure
decided (a sandbox fault, or an engine or inference server that failed it:
`Trajectory.unscorable`) is evidence of nothing and never kept (neither rewarded nor
penalised); the rest are
resampled to the G that train (`algo.resample`: GRPO-RoC or a variant) and given group
advantages. A group whose kept rewards are all equal has no signal. `MAX_REFILL_ROUNDS` bounds
how often a step draws more prompts to replace groups without signal
(`algo.drop_zero_signal_groups`); `expected_signal` estimates, from a screen, how many groups
will have signal.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
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
    rewards = [t.reward or 0.0 for t in kept]
    advantages = group_advantages(rewards, algo.adv_eps, scale=algo.adv_scale == "group")
    return Group(problem, list(sampled), kept, advantages, position)


def expected_signal(
    screened: Sequence[float], kept: Sequence[float], screen_samples: int, samples: int
) -> float:
    """The expected share of groups of `samples` samples with signal (neither all right nor
    all wrong) for the problems a screen kept, from the pass rates it measured over
    `screen_samples` samples: those of every problem screened (`screened`) and of the kept
    ones (`kept`). Each kept problem's rate is shrunk toward the screen's: a Beta prior fitted
    to all the screened rates by moments (beta-binomial), then the problem's posterior, whose
    chance of a mixed group is 1 - E[q^n] - E[(1 - q)^n]. At low pass rates a screen keeps
    many problems solved once by chance, which this counts and the kept rates alone do not.
    Resampling to G (which can drop a lone right or wrong sample) is not counted."""
    if not kept or not screened:
        return 0.0
    s = screen_samples
    mean = sum(screened) / len(screened)
    if mean <= 0.0 or mean >= 1.0:
        return 0.0
    spread = sum((r - mean) ** 2 for r in screened) / len(screened)
    binomial = mean * (1 - mean) / s
    # Var(rate) = binomial x (1 + (s - 1) rho), rho = 1 / (a + b + 1)
    rho = (spread / binomial - 1) / (s - 1) if s > 1 else 0.5
    rho = min(max(rho, 1e-3), 1 - 1e-3)
    total = 1 / rho - 1
    a, b = mean * total, (1 - mean) * total

    def moment(alpha: float, beta: float) -> float:  # E[q^samples] under Beta(alpha, beta)
        return math.exp(
            math.lgamma(alpha + samples)
            + math.lgamma(alpha + beta)
            - math.lgamma(alpha)
            - math.lgamma(alpha + beta + samples)
        )

    shares = []
    for rate in kept:
        k = round(rate * s)
        alpha, beta = a + k, b + s - k
        shares.append(1 - moment(alpha, beta) - moment(beta, alpha))
    return sum(shares) / len(shares)


def sampled_per_step(signal: float, rounds: int = MAX_REFILL_ROUNDS) -> float:
    """The prompts a step is expected to sample for each it trains on when groups without
    signal are refilled (`algo.drop_zero_signal_groups`) and a group has signal with chance
    `signal`: each round draws the shortfall, 1 + (1 - p) + ... + (1 - p)^(rounds - 1)."""
    return sum((1 - signal) ** r for r in range(rounds))
