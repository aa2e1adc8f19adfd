"""GRPO advantages: each kept trajectory's reward against the others of its group.

A = (r - mean) / (std + eps) over the kept G of one prompt, with the sample standard deviation
(n - 1 in the denominator, as torch.std and the released code's verl use). A group whose kept
rewards are all equal carries no signal: its advantages are 0 and `has_signal` is False, so the
trainer may drop it and refill from extra prompts (`algo.drop_zero_signal_groups`). Without
the division (`algo.adv_scale = "none"`: Dr. GRPO, Liu et al. 2025) A = r - mean.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def has_signal(rewards: Sequence[float]) -> bool:
    return len(set(rewards)) > 1


def group_advantages(
    rewards: Sequence[float], eps: float = 1e-6, *, scale: bool = True
) -> list[float]:
    """One advantage per reward of one group, in order; `scale` False: r - mean alone."""
    if not has_signal(rewards):
        return [0.0] * len(rewards)
    mean = statistics.fmean(rewards)
    if not scale:
        return [r - mean for r in rewards]
    std = statistics.stdev(rewards)
    return [(r - mean) / (std + eps) for r in rewards]
