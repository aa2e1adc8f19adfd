"""An RL run's state besides its weights and optimiser: one value, saved and restored in one place.

`RunState` holds the position in the data order (the next problem to draw), the RNG of
Resample-on-Correct, the problems a checkpoint's position indexes (a checksum of their ids), and
for the asynchronous loop the positions drawn but not yet trained (`pending`) and each rank's
draws (`async_next`). `state_dict`/`load_state_dict` go into and out of a checkpoint's `extra`;
`carry_on_from` continues a recipe stage where the stage before it stopped, when both train on
the same problems.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from codeloop.data.problems import Problem


def problem_digest(problems: Sequence[Problem]) -> int:
    """A checksum of the problems' ids in order: which list a data position indexes."""
    return zlib.crc32("\n".join(p.id for p in problems).encode())


@dataclass
class RunState:
    seed: int = 0
    data_position: int = 0
    problems: int = 0  # problem_digest of the list data_position indexes
    pending: list[int] = field(default_factory=list)  # async: drawn, not trained
    async_next: list[int] = field(default_factory=list)  # async: each rank's draws so far
    roc_rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.roc_rng = random.Random(self.seed)

    def state_dict(self) -> dict[str, Any]:
        return {"data_position": self.data_position, "roc_rng": self.roc_rng.getstate(),
                "problems": self.problems, "pending": list(self.pending),
                "async_next": list(self.async_next)}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data_position = int(state["data_position"])
        self.roc_rng.setstate(state["roc_rng"])
        self.problems = int(state.get("problems") or 0)
        self.pending = [int(p) for p in state.get("pending", [])]
        self.async_next = [int(k) for k in state.get("async_next", [])]

    def carry_on_from(self, before: RunState, problems: int) -> None:
        """A new stage goes on drawing where `before` (the stage before it) stopped, when it
        trains on the same problems (`problems`: the `problem_digest` of its own); else it
        starts the data order afresh. Resampling's RNG starts from the seed in every stage."""
        if before.problems == problems:
            self.data_position = before.data_position
            self.pending, self.async_next = list(before.pending), list(before.async_next)
