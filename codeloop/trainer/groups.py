"""Where an RL step's groups come from: a `GroupSource`, synchronous or asynchronous.

The RL loop (`rl.py`) asks its source for a step's groups (`draw`), trains on them, and publishes
the new weights inside the source's `publishing` block. Two sources:

- `SyncGroups` (`trainer.mode = "sync"`, the report's): each `draw` samples the next
  `prompts_per_step` problems of the data order now, with every engine, and nothing samples
  while the learner trains.
- `AsyncGroups` (`async_rl.py`): a producer keeps groups generating ahead of the learner, within
  a staleness bound, and `draw` takes the first usable ones to finish.

Both build a group the same way (`algo.group.make_group`: Resample-on-Correct, advantages) and
draw problems in the same seeded data order (`problem_at`), so a run's data and groups do not
depend on the mode, only its timing does.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from codeloop.algo.group import MAX_REFILL_ROUNDS, Group, make_group
from codeloop.config import Config
from codeloop.data.problems import Problem
from codeloop.errors import RunError
from codeloop.rollout.collect import collect, seed_of
from codeloop.trainer.batch import Sample, from_trajectory
from codeloop.trainer.distributed import World, all_gather
from codeloop.trainer.rollout_side import RolloutSide
from codeloop.trainer.state import RunState


def problem_at(problems: Sequence[Problem], seed: int, position: int) -> Problem:
    """The problem at `position` of the data order: epoch after epoch, each a seeded shuffle."""
    epoch, index = divmod(position, len(problems))
    order = list(range(len(problems)))
    random.Random(seed_of(seed, epoch)).shuffle(order)
    return problems[order[index]]


@dataclass
class Drawn:
    """A step's groups, as a source hands them to the loop."""

    train: list[Group]  # the groups this rank trains on
    finished: list[Group]  # every group done with since the last step (logged and dumped)
    samples: list[Sample]  # what the learner trains on (`samples_of(train)`, or none)
    trained: set[int] | None = None  # id()s of `finished` that trained (None: all with signal)


def samples_of(groups: Sequence[Group]) -> list[Sample]:
    """The training samples of groups: each kept trajectory with its advantage."""
    return [
        from_trajectory(t, a) for g in groups for t, a in zip(g.kept, g.advantages, strict=True)
    ]


class GroupSource(Protocol):
    wait_metric: str  # the timing metric of `draw`
    in_thread: bool | None  # how the learner's update runs (`Learner.update_async`)

    async def start(self) -> None:
        """Before the first step (the engines serve the current weights)."""

    async def draw(self) -> Drawn:
        """This rank's groups for the next step."""
        ...

    def publishing(self, version: int) -> AbstractAsyncContextManager[None]:
        """The block in which the weights of policy version `version` are published."""
        ...

    def metrics(
        self, drawn: Drawn, waited: float, updated: float
    ) -> tuple[dict[str, float], dict[str, float]]:
        """(metrics averaged over the ranks, counts summed over them) of the step that drew
        `drawn`, waited for it until `waited` and updated until `updated` (perf_counter)."""
        ...

    def save(self, state: RunState) -> None:
        """Record in `state` what a resumed run needs of this source (every rank calls it)."""

    async def stop(self) -> None:
        """After the last step."""


class SyncGroups:
    """Groups sampled when a step asks for them (the module docstring)."""

    wait_metric = "timing/rollout_and_reward_s"
    in_thread: bool | None = False  # nothing samples meanwhile

    def __init__(
        self,
        cfg: Config,
        world: World,
        state: RunState,
        order: Callable[[int], Problem],
        *,
        rollout: RolloutSide | None,
    ) -> None:
        self.cfg, self.world, self.state, self.order = cfg, world, state, order
        self.rollout = rollout

    async def start(self) -> None:
        pass

    async def draw(self) -> Drawn:
        train, sampled = await self.groups(self.cfg.trainer.prompts_per_step)
        return Drawn(train, sampled, samples_of(train))

    def publishing(self, version: int) -> AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    def metrics(
        self, drawn: Drawn, waited: float, updated: float
    ) -> tuple[dict[str, float], dict[str, float]]:
        # groups passed over for want of signal, as the asynchronous source counts them
        refill = self.cfg.algo.drop_zero_signal_groups
        dropped = sum(not g.has_signal for g in drawn.finished) if refill else 0
        return {}, {"rollout/groups_kept": len(drawn.train), "rollout/groups_dropped": dropped}

    def save(self, state: RunState) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def groups(self, count: int) -> tuple[list[Group], list[Group]]:
        """(the groups this rank trains on, every group this rank sampled). Every rank takes its
        share of the same problems. A group whose kept rewards are all equal has no signal
        (advantages 0). With `algo.drop_zero_signal_groups` (the report's choice) such groups
        are dropped and more problems drawn until `count` groups with signal remain over all
        ranks (at most MAX_REFILL_ROUNDS rounds); without it they stay in the batch, where the
        learner leaves their tokens out of the loss's denominator; with several ranks the kept
        groups are then gathered in data order and dealt out again, so that the step trains on
        the groups one process would."""
        refill, world = self.cfg.algo.drop_zero_signal_groups, self.world
        groups: list[Group] = []
        sampled: list[Group] = []
        for _ in range(MAX_REFILL_ROUNDS):
            chosen = self._next_problems(count - len(groups))  # the same on every rank
            batch = await self.sample(chosen[world.rank :: world.size])
            sampled += batch
            if refill:
                batch = [g for g in batch if g.has_signal]
            if refill and world.distributed:  # everyone's, so that every rank decides alike
                batch = sorted(
                    (g for rank in all_gather(batch, world) for g in rank), key=lambda g: g.position
                )
            groups += batch
            if len(groups) >= count or not refill:
                break
        if not (refill and world.distributed):
            return groups, sampled
        if 0 < len(groups) < world.size:
            raise RunError(
                f"only {len(groups)} groups with signal after {MAX_REFILL_ROUNDS} "
                f"rounds, fewer than the {world.size} ranks: raise "
                "trainer.prompts_per_step"
            )
        return groups[world.rank :: world.size], sampled

    def _next_problems(self, count: int) -> list[tuple[int, Problem]]:
        chosen = []
        for _ in range(count):
            chosen.append((self.state.data_position, self.order(self.state.data_position)))
            self.state.data_position += 1
        return chosen

    async def sample(self, problems: Sequence[tuple[int, Problem]]) -> list[Group]:
        """The groups of (data position, problem) pairs, sampled with every engine at once."""
        assert self.rollout is not None
        algo = self.cfg.algo
        n = algo.group_size * algo.oversample
        agent = self.rollout.agent(batch_size=len(problems) * n)
        positions = [position for position, _ in problems]  # seeds follow the data order
        scored = await collect(
            agent,
            [p for _, p in problems],
            n,
            self.rollout.verifier,
            seed=self.cfg.trainer.seed,
            keys=positions,
            progress="rollout" if self.world.is_main else "",
        )
        return [
            make_group(problem, sampled, algo, self.state.roc_rng, position=position)
            for (position, problem), sampled in zip(problems, scored, strict=True)
        ]
