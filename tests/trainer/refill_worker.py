"""Run by torchrun (see test_distributed.py): `SyncGroups.groups` with zero-signal groups dropped
and refilled, over synthetic rollouts in which the group of data position p has signal when p
is odd. Writes each rank's group positions and data position to OUT/rank<r>.json."""

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from codeloop.algo.group import Group
from codeloop.config import Config
from codeloop.data.problems import Problem
from codeloop.trainer import distributed
from codeloop.trainer.groups import SyncGroups, problem_at
from codeloop.trainer.state import RunState


async def synthetic_rollout(problems: list[tuple[int, Problem]]) -> list[Group]:
    groups = []
    for position, problem in problems:
        rewards = [1.0, 0.0] if position % 2 else [0.0, 0.0]
        kept = [SimpleNamespace(reward=r) for r in rewards]
        groups.append(Group(problem, [], kept, [0.0, 0.0], position))  # type: ignore[arg-type]
    return groups


def main() -> None:
    out = Path(sys.argv[1])
    world = distributed.init()
    cfg, state = Config(), RunState()
    cfg.algo.drop_zero_signal_groups = True
    problems = [Problem(f"q{i}", f"problem {i}", "1") for i in range(20)]
    source = SyncGroups(cfg, world, state, lambda p: problem_at(problems, 0, p), None)
    source.sample = synthetic_rollout  # type: ignore[method-assign]  # no engine or sandbox
    groups, _ = asyncio.run(source.groups(4))
    record = {"positions": [g.position for g in groups], "data_position": state.data_position}
    (out / f"rank{world.rank}.json").write_text(json.dumps(record))
    distributed.barrier(world)


if __name__ == "__main__":
    main()
