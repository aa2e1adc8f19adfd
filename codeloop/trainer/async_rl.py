"""Asynchronous RL (`trainer.mode = "async"`): generation never waits for the optimiser.

`AsyncGroups` is the RL loop's group source in this mode (`groups.py`), made of two parts. The
`Producer` keeps groups (oversample x G samples of one problem, in the data order) generating
through the same `collect` as the synchronous loop, within the staleness bound, and puts each
scored, resampled group on a queue the moment it ends. Through the `Intake` (its filters and
counts) the loop's learner takes the first `prompts_per_step` usable groups off the queue, trains
on them while the producer goes on (`Learner.update_async`: in a worker thread on a GPU; on a
CPU on the loop's thread between the engine's steps), then publishes the weights, which become
policy version `step_index`. Rank 0 shows the step's groups taken on a bar, with the trajectories
sampled and the groups passed over or stale since the last step.

Staleness is bounded as AReaL bounds it: a group may start at version v only while the groups
taken for training plus those outstanding (generating or queued) stay below
(v + max_staleness + 1) x prompts_per_step, so with `max_staleness = 0` nothing generates during
an update (the synchronous schedule, group by group) and with 1 the next batch generates while
this one trains. Every sampled token records the version that sampled it
(`Trajectory.versions`); a group whose oldest token is more than `max_staleness` versions old
when the learner reaches it is regenerated (its problem sampled again) or dropped
(`trainer.stale_groups`), and counted. Groups without signal are dropped as in the synchronous
loop (`algo.drop_zero_signal_groups`), and a new problem takes their place.

Partial rollouts (`trainer.partial_rollout`): `continue` publishes the new weights at once; the
in-process engine swaps them between two decoding steps, so a request in flight goes on under
the new weights and its earlier tokens keep their old logprobs and versions. `wait` closes a
gate in front of the engines, waits until no request is being decoded, publishes, and opens it
again (servers need this: their reload must not race a request). A trajectory inside a tool call
is not touched by either: its next turn simply samples with whatever weights are current.

The loss is taken against the engine's logprobs (behaviour), so off-policy tokens keep their
true importance ratio; `algo.off_policy = "decoupled"` adds decoupled PPO's correction. A step
passes over at most MAX_REFILL_ROUNDS x its share of groups without signal (the synchronous
refill's budget), then trains on what it has.

Under torchrun each rank runs its own producer over its own engines and draws the data positions
r, r + size, r + 2 size, ...; it trains on its share of `prompts_per_step` (the update and the
weight gather are collective, so the ranks meet there), metrics are averaged or summed over the
ranks and the dumps gathered. Resuming keeps each rank's draws (`next`, in the run state's entry
of this source) when the world size is the same.
Checkpoints record the data positions drawn but not yet trained (`pending`): a resumed run
samples them again first, so a stop loses and duplicates no problem (the samples that were in
flight are lost work, not lost data).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from codeloop.algo.group import MAX_REFILL_ROUNDS, Group, make_group
from codeloop.config import Config, ConfigError
from codeloop.data.problems import Problem
from codeloop.engine.protocol import (
    Batched,
    Engine,
    Generation,
    KVPolled,
    KVReporting,
    SamplingParams,
)
from codeloop.progress import progress_bar
from codeloop.rollout.collect import collect
from codeloop.trainer.distributed import World, all_gather, all_max
from codeloop.trainer.groups import Drawn, samples_of
from codeloop.trainer.rollout_side import RolloutSide
from codeloop.trainer.state import RunState
from codeloop.types import Trajectory


class Gate:
    """Stands in front of the engines: counts the generate calls inside, and can hold new ones
    back until those inside are done (`closed()`). Knows the current policy version."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.inside = 0
        self._open = asyncio.Event()
        self._open.set()
        self._empty = asyncio.Event()
        self._empty.set()

    @asynccontextmanager
    async def entered(self) -> AsyncIterator[int]:
        """Wait while the gate is closed; yields the version current on entry."""
        await self._open.wait()
        self.inside += 1
        self._empty.clear()
        try:
            yield self.version
        finally:
            self.inside -= 1
            if not self.inside:
                self._empty.set()

    @asynccontextmanager
    async def closed(self) -> AsyncIterator[None]:
        """No generate call runs inside this block."""
        self._open.clear()
        try:
            await self._empty.wait()
            yield
        finally:
            self._open.set()


class GatedEngine:
    """An engine behind a `Gate`. Tokens of an engine that does not say which weights sampled
    them get the version current when the call entered (exact when updates wait for the gate)."""

    def __init__(self, engine: Engine, gate: Gate) -> None:
        self.engine, self.gate = engine, gate

    # What the engine behind declares (`engine/protocol.py`), and nothing it does not: a
    # property that raises AttributeError makes isinstance say the gated engine lacks it too.

    @property
    def max_batch(self) -> int:
        if isinstance(self.engine, Batched):
            return self.engine.max_batch
        raise AttributeError("max_batch")

    @property
    def kv_capacity_tokens(self) -> int:
        if isinstance(self.engine, KVReporting):
            return self.engine.kv_capacity_tokens
        raise AttributeError("kv_capacity_tokens")

    @property
    def kv_tokens_used(self) -> int | None:
        if isinstance(self.engine, KVReporting):
            return self.engine.kv_tokens_used
        raise AttributeError("kv_tokens_used")

    async def refresh_kv(self) -> None:
        """The engine's, where it has one (a method is always there for isinstance)."""
        if isinstance(self.engine, KVPolled):
            await self.engine.refresh_kv()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        async with self.gate.entered() as version:
            generation = await self.engine.generate(prompt_ids, params)
        if generation.versions is None:
            generation = dataclasses.replace(
                generation, versions=[version] * len(generation.token_ids)
            )
        return generation


class Activity:
    """When the producer had something generating: intervals, to measure overlap."""

    def __init__(self) -> None:
        self.running = 0
        self.since = 0.0
        self.spans: list[tuple[float, float]] = []

    def start(self) -> None:
        if not self.running:
            self.since = time.perf_counter()
        self.running += 1

    def stop(self) -> None:
        self.running -= 1
        if not self.running:
            self.spans.append((self.since, time.perf_counter()))

    def busy_between(self, start: float, end: float) -> float:
        """Seconds of [start, end] during which something was generating."""
        spans = self.spans + ([(self.since, end)] if self.running else [])
        self.spans = [s for s in self.spans if s[1] > start]
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)


SOURCE = "async"  # this source's entry in `RunState.sources`


class Producer:
    """Keeps groups generating ahead of the learner: draws this rank's data positions (those a
    resumed run had drawn and not trained first), starts a group while the staleness bound
    allows (`may_start`: groups taken plus outstanding below (version + max_staleness + 1) x
    this rank's share of a step), and queues each finished group. Knows nothing of what the
    learner does with a group, only that it leaves (`retire`)."""

    def __init__(
        self,
        cfg: Config,
        world: World,
        state: RunState,
        order: Callable[[int], Problem],
        *,
        rollout: RolloutSide,
        version: int,
        on_scored: Callable[[Trajectory], None],
    ) -> None:
        self.cfg, self.world, self.state, self.order = cfg, world, state, order
        self.verifier, self.on_scored = rollout.verifier, on_scored
        # this rank's share of a step's groups, and of the data order (positions r, r + size, ..)
        self.batch = len(range(world.rank, cfg.trainer.prompts_per_step, world.size))
        saved = state.sources.get(SOURCE, {})  # what `saved` wrote: draws, and those untrained
        draws = [int(n) for n in saved.get("next", [])]
        if len(draws) == world.size:
            self.next = draws[world.rank]  # draws made, resumed with the same world
        else:
            self.next = -(-max(state.data_position - world.rank, 0) // world.size)
        self.redo = [
            int(p) for p in sorted(saved.get("pending", [])) if int(p) % world.size == world.rank
        ]  # drawn first
        self.gate = Gate(version)
        n = cfg.algo.group_size * cfg.algo.oversample
        self.agent = rollout.agent(
            self.batch * n, [GatedEngine(e, self.gate) for e in rollout.engines]
        )
        self.ready: asyncio.Queue[Group | None] = asyncio.Queue()
        self.positions: dict[int, Problem] = {}  # drawn and not yet trained or discarded
        self.taken = version * self.batch  # groups taken for training, all steps
        self.outstanding = 0  # groups generating or queued
        self.activity = Activity()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None

    def saved(self) -> dict[str, Any]:
        """Every rank's positions drawn and not trained (`pending`) and draws so far (`next`)
        (all ranks call it)."""
        mine = sorted({*self.positions, *self.redo})
        pending = sorted(p for part in all_gather(mine, self.world) for p in part)
        return {"pending": pending, "next": all_gather(self.next, self.world)}

    def start(self) -> None:
        self._loop = asyncio.create_task(self._produce())

    async def stop(self) -> None:
        tasks = [t for t in (self._loop, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop = None

    async def finished(self) -> Group:
        """The next group to finish (a failure of one is raised here)."""
        group = await self.ready.get()
        if self._failure is not None:
            raise self._failure
        assert group is not None
        return group

    def take(self, groups: int) -> None:
        """A step took its share (`groups`, even if it trained on fewer)."""
        self.taken += groups
        self.wake()

    def retire(self, group: Group) -> None:
        """A group leaves the pipeline: trained, or discarded."""
        self.outstanding -= 1
        self.positions.pop(group.position, None)
        self.wake()

    def regenerate(self, group: Group) -> None:
        """Sample a retired group's problem again, before any new draw."""
        self.redo.append(group.position)
        self.positions[group.position] = group.problem

    def publish(self, version: int) -> None:
        """The engines serve `version` now: the bound lets more groups start."""
        self.gate.version = version
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    def _may_start(self) -> bool:
        bound = (self.gate.version + self.cfg.trainer.max_staleness + 1) * self.batch
        return self.taken + self.outstanding < bound

    async def _produce(self) -> None:
        while True:
            while self._may_start():
                position, problem = self._draw()
                self.outstanding += 1
                task = asyncio.create_task(self._group(position, problem))
                self._tasks.add(task)
                task.add_done_callback(self._done)
            self._wake.clear()
            await self._wake.wait()

    def _draw(self) -> tuple[int, Problem]:
        if self.redo:
            position = self.redo.pop(0)
        else:
            position = self.next * self.world.size + self.world.rank
            self.next += 1
            self.state.data_position = max(self.state.data_position, position + 1)
        problem = self.positions[position] = self.order(position)
        return position, problem

    async def _group(self, position: int, problem: Problem) -> None:
        algo = self.cfg.algo
        self.activity.start()
        try:
            sampled = await collect(
                self.agent,
                [problem],
                algo.group_size * algo.oversample,
                self.verifier,
                seed=self.cfg.trainer.seed,
                keys=[position],
                on_trajectory=self.on_scored,
            )
        finally:
            self.activity.stop()
        group = make_group(problem, sampled[0], algo, self.state.roc_rng, position=position)
        self.ready.put_nowait(group)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
            self.ready.put_nowait(None)  # wakes the learner


class Intake:
    """What the learner takes from the producer: the first usable groups to finish, passing
    over stale ones (regenerated or dropped, `trainer.stale_groups`) and ones without signal
    (`algo.drop_zero_signal_groups`), counted; rank 0's bar of the step's groups, with the
    trajectories sampled and the groups passed over since the last step."""

    def __init__(self, cfg: Config, world: World) -> None:
        self.cfg, self.world = cfg, world
        self.counts: Counter[str] = Counter()
        self.finished: list[Group] = []  # trained or discarded since the last step
        self.trained: set[int] = set()  # id() of those of `finished` that trained
        self.sampled = 0  # trajectories scored since the last step
        self.bar: Any = None

    async def batch(self, producer: Producer, version: int) -> list[Group]:
        """This step's groups: the first usable ones to finish. Like the synchronous refill
        (MAX_REFILL_ROUNDS rounds), at most MAX_REFILL_ROUNDS x batch groups without signal
        are passed over in a step; then it trains on what it has, possibly nothing."""
        t, want = self.cfg.trainer, producer.batch
        batch: list[Group] = []
        passed_over = 0
        while len(batch) < want and passed_over < MAX_REFILL_ROUNDS * want:
            group = await producer.finished()
            if version - _oldest_version(group, version) > t.max_staleness:
                self.counts["stale"] += 1
                self.discard(producer, group)
                if t.stale_groups == "regenerate":
                    producer.regenerate(group)
                    self.counts["regenerated"] += 1
                continue
            if self.cfg.algo.drop_zero_signal_groups and not group.has_signal:
                self.counts["no_signal"] += 1
                passed_over += 1
                self.discard(producer, group)
                continue
            batch.append(group)
            self.show(len(batch))
        for group in batch:
            producer.retire(group)
            self.finished.append(group)
            self.trained.add(id(group))
        return batch

    def discard(self, producer: Producer, group: Group) -> None:
        producer.retire(group)
        self.finished.append(group)

    def handed_over(self) -> tuple[list[Group], set[int]]:
        """The groups trained or discarded since the last call, and the ids of those trained."""
        handed = self.finished, self.trained
        self.finished, self.trained = [], set()
        return handed

    def scored(self, trajectory: Trajectory) -> None:
        self.sampled += 1
        self.show()

    def open_bar(self, total: int) -> None:
        self.bar = progress_bar(
            total=total, desc="rollout", unit="group", leave=False, disable=not self.world.is_main
        )

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def show(self, taken: int = -1) -> None:
        if self.bar is not None:
            if taken >= 0:
                self.bar.n = taken
            self.bar.set_postfix(
                sampled=self.sampled,
                no_signal=self.counts["no_signal"],
                stale=self.counts["stale"],
                refresh=False,
            )
            self.bar.refresh()

    def step_counts(self) -> dict[str, float]:
        """The groups passed over since the last step (and the bar's figures start again)."""
        counts = {
            "async/stale_groups": float(self.counts.pop("stale", 0)),
            "async/regenerated_groups": float(self.counts.pop("regenerated", 0)),
            "rollout/groups_dropped": float(self.counts.pop("no_signal", 0)),
        }
        self.sampled = 0
        self.show(0)
        return counts


class AsyncGroups:
    """The asynchronous group source (module docstring): a `Producer` running ahead of the
    learner over the rollout side's engines, each behind a `Gate`, and the `Intake` the learner
    takes each step's groups through."""

    wait_metric = "timing/wait_for_groups_s"
    in_thread: bool | None = (
        None  # on a GPU in a worker thread, on a CPU between the engine's steps
    )

    def __init__(
        self,
        cfg: Config,
        world: World,
        state: RunState,
        order: Callable[[int], Problem],
        *,
        rollout: RolloutSide,
        version: int,
    ) -> None:
        """`version`: the policy version the engines serve (the step the run starts from)."""
        if rollout.servers and cfg.trainer.partial_rollout == "continue":
            raise ConfigError(
                "trainer.partial_rollout = 'continue' swaps weights mid-request, "
                "which only the in-process engine can; servers need 'wait'"
            )
        self.cfg, self.world = cfg, world
        self.intake = Intake(cfg, world)
        self.producer = Producer(
            cfg, world, state, order, rollout=rollout, version=version, on_scored=self.intake.scored
        )
        self._staleness: list[int] = []  # of the last step's kept trajectories

    def save(self, state: RunState) -> None:
        """The producer's draws, in the run state's entry of this source."""
        state.sources[SOURCE] = self.producer.saved()
        state.data_position = max(all_gather(state.data_position, self.world))

    async def start(self) -> None:
        """The producer starts; rank 0 shows a bar of each step's groups with signal taken,
        with the trajectories sampled, groups passed over for want of signal and stale groups
        since the last step."""
        self.producer.start()
        self.intake.open_bar(self.producer.batch)

    async def stop(self) -> None:
        self.intake.close_bar()
        await self.producer.stop()

    async def draw(self) -> Drawn:
        version, t = self.producer.gate.version, self.cfg.trainer
        batch = await self.intake.batch(self.producer, version)
        self.producer.take(self.producer.batch)  # this step's share, even if it is short
        samples = samples_of(batch)
        self._staleness = [
            version - (tr.oldest_version if tr.oldest_version is not None else version)
            for g in batch
            for tr in g.kept
        ]
        if self.world.distributed and -all_max(-len(samples), self.world) < t.updates_per_step:
            samples = []  # a rank without enough: nobody steps (the update's passes must match)
        finished, trained = self.intake.handed_over()
        return Drawn(batch, finished, samples, trained)

    @asynccontextmanager
    async def publishing(self, version: int) -> AsyncIterator[None]:
        """`wait`: no request is being decoded while the weights change; then the bound lets
        the producer start what version `version` allows."""
        if self.cfg.trainer.partial_rollout == "wait":
            async with self.producer.gate.closed():
                yield
        else:
            yield
        self.producer.publish(version)

    def metrics(
        self, drawn: Drawn, waited: float, updated: float
    ) -> tuple[dict[str, float], dict[str, float]]:
        staleness = self._staleness
        busy = self.producer.activity.busy_between(waited, updated)
        local = {  # averaged over the ranks (the maximum is the same on every rank)
            "async/staleness_max": float(all_max(max(staleness, default=0), self.world)),
            "async/overlap": busy / max(updated - waited, 1e-9),
            "async/staleness_mean": sum(staleness) / max(len(staleness), 1),
        }
        counts = {
            **self.intake.step_counts(),
            "async/outstanding_groups": float(self.producer.outstanding),
            "rollout/groups_kept": float(len(drawn.train)),
        }
        return local, counts


def _oldest_version(group: Group, current: int) -> int:
    """The oldest policy version among a group's sampled tokens (`current` if none known)."""
    known = [v for tr in group.sampled if (v := tr.oldest_version) is not None]
    return min(known, default=current)
