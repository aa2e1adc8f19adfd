"""A problem (id, text, gold answer) and the error every problem source raises.

Kept apart from the readers (`problems.py`, `gym.py`) so that each reader can build problems
without importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from codeloop.errors import CodeloopError
from codeloop.reward.task import TaskGold


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str
    solution: str = ""  # a worked solution, where the source has one (GSM8K)
    # A reasoning-gym task's problem (`data/gym.py`): the task's name and the metadata its
    # scorer reads (JSON text); such a problem is scored by that task, not the math verifier.
    task: str = ""
    metadata: str = "{}"
    # The problem file's line as it was read (every key), what an environment's `reset(**row)`
    # receives (`rollout/environment.py`); empty for GSM8K's and reasoning-gym's problems.
    row: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def gold(self) -> str | TaskGold:
        """What the verifier scores an answer against: the answer, or the task's scorer."""
        return TaskGold(self.task, self.answer, self.metadata) if self.task else self.answer


class DataError(CodeloopError, ValueError):
    """A problem file that cannot be read as the config says."""
