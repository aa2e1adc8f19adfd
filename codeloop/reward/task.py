"""Answers to reasoning-gym problems, scored by their task's own `score_answer`.

A gym problem's gold is a `TaskGold`: the task's name, its answer and the metadata its scorer
reads (JSON text, as `data/gym.py` keeps it). `task_score` runs in a verifier worker
(`workers.py`), under the verifier's deadline and memory limit: the reward is 1 only at the
task's full score (1.0). A scorer that raises gives None: the answer could not be scored (the
verifier counts it as `verifier_error`, never as a plain 0); one that hangs is killed at the
deadline (`timeout`). reasoning-gym is imported in the worker on first use.
"""

from __future__ import annotations

import json
from typing import NamedTuple


class TaskGold(NamedTuple):
    """A gym problem's gold: scored by `task`'s scorer, not the math verifier."""

    task: str
    answer: str
    metadata: str  # JSON


def task_score(pred: str, gold: TaskGold) -> bool | None:
    """Whether the task scores `pred` in full; None when its scorer raised."""
    from reasoning_gym import get_score_answer_fn

    entry = {"answer": gold.answer, "metadata": json.loads(gold.metadata)}
    try:
        return float(get_score_answer_fn(gold.task)(pred, entry)) == 1.0
    except Exception:  # noqa: BLE001 - a scorer's parse of a free-form answer fails many ways
        return None
