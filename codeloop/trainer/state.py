"""An RL run's state besides its weights and optimiser: one value, saved and restored in one place.

`RunState` holds the position in the data order (the next problem to draw), the RNG of
Resample-on-Correct, the problems a checkpoint's position indexes (a checksum of their ids), and
what each group source saves for a resumed run (`sources`, by the source's name: the
asynchronous loop's draws not yet trained, say), which it reads and writes itself and this
module never looks into. `state_dict`/`load_state_dict` go into and out of a checkpoint's
`extra`; `carry_on_from` continues a recipe stage where the stage before it stopped, when both
train on the same problems.
"""

from __future__ import annotations

import copy
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
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)  # each source's own
    roc_rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.roc_rng = random.Random(self.seed)

    def state_dict(self) -> dict[str, Any]:
        return {
            "data_position": self.data_position,
            "roc_rng": self.roc_rng.getstate(),
            "problems": self.problems,
            "sources": copy.deepcopy(self.sources),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data_position = int(state["data_position"])
        self.roc_rng.setstate(state["roc_rng"])
        self.problems = int(state["problems"])
        self.sources = copy.deepcopy(state["sources"])

    @classmethod
    def restored(cls, state: dict[str, Any]) -> RunState:
        """A run state from its `state_dict` (a checkpoint's `extra`)."""
        restored = cls()
        restored.load_state_dict(state)
        return restored

    def carry_on_from(self, before: RunState, problems: int) -> None:
        """A new stage goes on drawing where `before` (the stage before it) stopped, when it
        trains on the same problems (`problems`: the `problem_digest` of its own), with what
        its sources saved; else it starts the data order afresh. Resampling's RNG starts from
        the seed in every stage."""
        if before.problems == problems:
            self.data_position = before.data_position
            self.sources = copy.deepcopy(before.sources)
