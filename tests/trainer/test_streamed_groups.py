"""The synchronous step's stream of groups (`RLRun._streamed_groups`): which groups train and
how far the data position moves depend on the groups' samples, not on which finished first;
groups started past the step's end are cancelled; the refill budget holds; the number of
groups generating at once follows the share with signal. Synthetic rollouts: the group of data
position p has signal when p is in `SIGNAL` and takes `delay(p)` seconds."""

import asyncio
import random
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from codeloop.config import Config
from codeloop.data.problems import Problem
from codeloop.trainer.distributed import World
from codeloop.trainer.rl import MAX_REFILL_ROUNDS, Group, RLRun

SIGNAL = {2, 5, 6, 9, 11}


class Stream:
    def __init__(self, signal: set[int], delay: Callable[[int], float], prior: float = 1.0):
        run = RLRun.__new__(RLRun)  # only what _groups reads: no model, engine or sandbox
        run.cfg, run.world, run.data_position = Config(), World(), 0
        run.cfg.algo.drop_zero_signal_groups = True
        run.problems = [Problem(f"q{i}", f"problem {i}", "1") for i in range(64)]
        run.roc_rng, run.signal_rate, run.overdrawn = random.Random(0), prior, 0
        run._agent = lambda batch_size: None  # type: ignore[method-assign,assignment,return-value]
        run._rollout = self.rollout  # type: ignore[method-assign]
        self.run, self.signal, self.delay = run, signal, delay
        self.started: list[int] = []
        self.cancelled: list[int] = []
        self.running = self.most_running = 0

    async def rollout(self, problems: list[tuple[int, Problem]], agent: object = None,
                      rng: object = None) -> list[Group]:  # fmt: skip
        ((position, problem),) = problems
        self.started.append(position)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(self.delay(position))
        except asyncio.CancelledError:
            self.cancelled.append(position)
            raise
        finally:
            self.running -= 1
        rewards = [1.0, 0.0] if position in self.signal else [0.0, 0.0]
        kept = [SimpleNamespace(reward=r) for r in rewards]
        return [Group(problem, [], kept, [0.0, 0.0], position)]  # type: ignore[arg-type]

    def groups(self, count: int) -> tuple[list[int], list[int]]:
        kept, sampled = asyncio.run(self.run._groups(count))
        return [g.position for g in kept], [g.position for g in sampled]


@pytest.mark.parametrize(
    "delay",
    [lambda p: 0.001 * p, lambda p: 0.001 * (40 - p), lambda p: 0.001 * ((7 * p) % 11)],
    ids=["in data order", "last first", "scrambled"],
)
def test_the_first_groups_with_signal_in_data_order_train_whichever_finishes_first(
    delay: Callable[[int], float],
) -> None:
    stream = Stream(SIGNAL, delay)
    kept, sampled = stream.groups(3)
    assert kept == [2, 5, 6]  # by hand: the first three positions of SIGNAL
    assert sampled == list(range(7)) and stream.run.data_position == 7
    assert stream.run.signal_rate == pytest.approx(3 / 7)
    beyond = [p for p in stream.started if p >= 7]
    assert stream.run.overdrawn == len(beyond)
    assert set(stream.cancelled) <= set(beyond)  # only groups past the end are cancelled
    assert stream.running == 0  # nothing left generating

    again = stream.groups(3)  # the next step starts at 7, where this one ended; two with
    assert again == ([9, 11], list(range(7, 19)))  # signal in its budget of 4 x 3 problems
    assert stream.run.data_position == 19


def test_a_step_without_signal_spends_the_refill_budget_then_trains_nothing() -> None:
    stream = Stream(set(), lambda p: 0.001)
    kept, sampled = stream.groups(2)
    assert kept == [] and sampled == list(range(2 * MAX_REFILL_ROUNDS))
    assert stream.run.data_position == 2 * MAX_REFILL_ROUNDS and stream.run.overdrawn == 0
    assert stream.cancelled == []
    # the first two found no signal, so more generate at once than the two still needed
    assert 2 < stream.most_running <= 2 * MAX_REFILL_ROUNDS


def test_the_window_follows_the_last_steps_share_of_groups_with_signal() -> None:
    rare = Stream({30}, lambda p: 0.001, prior=0.1)  # 1 in 10: the whole budget at once
    rare.groups(2)
    assert rare.most_running == 2 * MAX_REFILL_ROUNDS
    common = Stream(set(range(64)), lambda p: 0.001)  # every group has signal: no more than 2
    assert common.groups(2) == ([0, 1], [0, 1])
    assert common.most_running == 2 and common.started == [0, 1]


def test_groups_started_past_the_end_are_cancelled_not_awaited() -> None:
    stream = Stream(SIGNAL, lambda p: 0.001 if p < 7 else 60.0, prior=0.1)  # all 12 start
    assert stream.groups(3)[0] == [2, 5, 6]
    beyond = [p for p in stream.started if p >= 7]
    assert beyond and sorted(stream.cancelled) == beyond and stream.run.overdrawn == len(beyond)
