"""Resample-on-Correct (GRPO-RoC): from the oversampled trajectories of a prompt keep G.

The report's rule (the default, `roc`), for n = oversample x G sampled trajectories:
- negatives (reward 0): keep floor(n_neg x G / n) of them (floor(n_neg / 2) at the report's 2x),
  uniformly at random, so failures stay diverse;
- positives (reward 1): keep the rest, G - kept negatives, sampled without replacement with
  probability proportional to 1 / (p_total + PENALTY_FLOOR), so clean successes are preferred:
  - p_err = failed tool calls / tool calls (any status but `ok`, parse errors included, an
    infrastructure fault not: RL leaves such trajectories out), 0.5 when the trajectory made
    no tool call;
  - p_format = 1 without a closed `<answer>...</answer>` (or with an unclosed tag), else
    min(1, (answers - 1) / assistant turns);
  - p_total = p_err + p_format, in [0, 2].
  If there are too few of one side the other side fills the group.
`roc_released`: the released code's variant, a proportional split with at least 2 per side
(when there are that many), keeping the lowest-penalty positives (ties by sample index) and the
first negatives in sample order, deterministically (the rStar maintainers called their sort of
negatives a migration bug and removed it: microsoft/rStar issue #49, PR #50). `random`: a
uniformly random G of the n (oversampling without selection: the control that separates RoC's
choice from its extra samples). `none`: plain GRPO on the first G by sample index. All of it
is seeded by the caller's `random.Random`.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from codeloop.reward.extract import strip_tool_output
from codeloop.types import Trajectory

# Keeps a spotless positive (p_total = 0) finite: its weight is 20, against 1.8 at p_total = 0.5
# and 0.95 at p_total = 1, so clean trajectories dominate without making the draw deterministic.
PENALTY_FLOOR = 0.05
_CLOSED_ANSWER = re.compile(r"<answer>.*?</answer>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Penalty:
    p_err: float
    p_format: float

    @property
    def total(self) -> float:
        return self.p_err + self.p_format


def penalty(trajectory: Trajectory) -> Penalty:
    """RoC's p_err and p_format of one trajectory (see the module docstring)."""
    calls = trajectory.tool_calls
    p_err = sum(record.failed for record in calls) / len(calls) if calls else 0.5
    text = strip_tool_output(trajectory.text)
    answers = len(_CLOSED_ANSWER.findall(text))
    unclosed = text.count("<answer>") != answers or text.count("</answer>") != answers
    turns = max(trajectory.num_turns, 1)  # an answered trajectory had at least its one turn
    p_format = 1.0 if answers == 0 or unclosed else min(1.0, (answers - 1) / turns)
    return Penalty(p_err, p_format)


def _weighted_sample(
    items: list[Trajectory], weights: list[float], k: int, rng: random.Random
) -> list[Trajectory]:
    """k items without replacement, each draw proportional to weight (exponential keys)."""
    keys = [-math.log(1.0 - rng.random()) / w for w in weights]
    order = sorted(range(len(items)), key=keys.__getitem__)
    return [items[i] for i in order[:k]]


def _split(n_pos: int, n_neg: int, keep: int) -> tuple[int, int]:
    """(positives, negatives) to keep under the report's rule."""
    neg = min(n_neg, n_neg * keep // (n_pos + n_neg))
    pos = min(n_pos, keep - neg)
    return pos, min(n_neg, keep - pos)


def _split_released(n_pos: int, n_neg: int, keep: int, minimum: int = 2) -> tuple[int, int]:
    """Proportional split, then at least `minimum` per side where a side has that many."""
    neg = round(n_neg * keep / (n_pos + n_neg))
    if neg <= min(minimum, n_neg):
        neg = min(minimum, n_neg)
    pos = min(n_pos, keep - neg)
    if pos <= min(minimum, n_pos):
        pos = min(minimum, n_pos)
    return pos, min(n_neg, keep - pos)


def resample(
    trajectories: Sequence[Trajectory], keep: int, mode: str, rng: random.Random
) -> list[Trajectory]:
    """The `keep` trajectories that train, in sample order (`mode`: roc, roc_released, none)."""
    if any(t.reward is None for t in trajectories):
        raise ValueError("resample: every trajectory needs a reward first")
    ordered = sorted(trajectories, key=lambda t: t.sample_index)
    keep = min(keep, len(ordered))
    positives = [t for t in ordered if t.reward == 1.0]
    negatives = [t for t in ordered if t.reward != 1.0]
    match mode:
        case "none":
            return ordered[:keep]
        case "random":
            return sorted(rng.sample(ordered, keep), key=lambda t: t.sample_index)
        case "roc":
            n_pos, n_neg = _split(len(positives), len(negatives), keep)
            weights = [1.0 / (penalty(t).total + PENALTY_FLOOR) for t in positives]
            kept = _weighted_sample(positives, weights, n_pos, rng)
        case "roc_released":  # sorted() is stable: ties by index
            n_pos, n_neg = _split_released(len(positives), len(negatives), keep)
            kept = sorted(positives, key=lambda t: penalty(t).total)[:n_pos]
            kept += negatives[:n_neg]  # in sample order: rStar PR #50 removed their sort
            return sorted(kept, key=lambda t: t.sample_index)
        case _:
            raise ValueError(
                f"algo.resample: unknown mode {mode!r}; expected roc, roc_released, random, none"
            )
    kept += rng.sample(negatives, n_neg)
    return sorted(kept, key=lambda t: t.sample_index)
