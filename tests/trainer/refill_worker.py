"""Run by torchrun (see test_distributed.py): `SyncGroups.groups(4)` with zero-signal groups
dropped and refilled (unless `keep`), over synthetic rollouts in which the group of data
position p has signal when SIGNAL[RULE](p). Writes each rank's group positions and data position
(or the error that stopped it) to OUT/rank<r>.json. Usage: refill_worker.py OUT RULE [keep]."""

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from codeloop.algo.group import Group
from codeloop.config import Config
from codeloop.data.problems import Problem
from codeloop.errors import RunError
from codeloop.trainer import distributed
from codeloop.trainer.groups import SyncGroups, problem_at
from codeloop.trainer.state import RunState

SIGNAL = {
    "odd": lambda p: p % 2 == 1,
    "none": lambda p: False,
    "only_1": lambda p: p == 1,
    "1_and_3": lambda p: p in (1, 3),
}


def main() -> None:
    out, signal = Path(sys.argv[1]), SIGNAL[sys.argv[2]]
    world = distributed.init()
    cfg, state = Config(), RunState()
    cfg.algo.drop_zero_signal_groups = sys.argv[3:] != ["keep"]
    problems = [Problem(f"q{i}", f"problem {i}", "1") for i in range(20)]
    source = SyncGroups(cfg, world, state, lambda p: problem_at(problems, 0, p), rollout=None)

    async def synthetic_rollout(chosen: list[tuple[int, Problem]]) -> list[Group]:
        groups = []
        for position, problem in chosen:
            rewards = [1.0, 0.0] if signal(position) else [0.0, 0.0]
            kept = [SimpleNamespace(reward=r) for r in rewards]
            groups.append(Group(problem, [], kept, [0.0, 0.0], position))  # type: ignore[arg-type]
        return groups

    source.sample = synthetic_rollout  # type: ignore[method-assign]  # no engine or sandbox
    try:
        groups, _ = asyncio.run(source.groups(4))
        record = {"positions": [g.position for g in groups], "data_position": state.data_position}
    except RunError as error:
        record = {"error": str(error)}
    (out / f"rank{world.rank}.json").write_text(json.dumps(record))
    distributed.barrier(world)


if __name__ == "__main__":
    main()
