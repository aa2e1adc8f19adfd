"""The RL loop takes its groups from any `GroupSource`: a schedule defined here (it replays one
hand-made group each step) drives `RLRun.train`, which trains on exactly its samples, publishes
each new version inside its `publishing` block, and logs and checkpoints what it adds. The
synchronous source refills groups without signal, within MAX_REFILL_ROUNDS rounds."""

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from codeloop.algo.group import Group
from codeloop.config import Config
from codeloop.data.problems import Problem
from codeloop.engine.model import tiny_model
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer.checkpoint import read_state
from codeloop.trainer.distributed import World
from codeloop.trainer.groups import Drawn, SyncGroups, problem_at, samples_of
from codeloop.trainer.logs import RunLogger, read_metrics
from codeloop.trainer.rl import RLRun, build_run
from codeloop.trainer.state import RunState
from codeloop.types import RolloutStatus, Trajectory

PROBLEM = Problem("p", "What is 1 + 1?", "2")


def _group(
    position: int, rewards: Sequence[float] = (1.0, 0.0), problem: Problem = PROBLEM
) -> Group:
    """Two samples of 3 sampled tokens after a 2-token prompt, with these rewards (right: 1) and
    their group advantages (+1, -1 for a right and a wrong one)."""
    sampled = [
        Trajectory(
            problem.id,
            i,
            [1, 2],
            [5 + i, 6, 7],
            [1, 1, 1],
            [-1.0] * 3,
            RolloutStatus.ANSWERED,
            final_answer="2" if r else "3",
            reward=r,
            text="\\boxed{2}" if r else "\\boxed{3}",
        )
        for i, r in enumerate(rewards)
    ]
    advantages = [1.0 if r else -1.0 for r in rewards] if len(set(rewards)) > 1 else [0.0, 0.0]
    return Group(problem, sampled, sampled, advantages, position)


class Replay:
    """A group source of one hand-made group a step, recording what the loop asks of it."""

    wait_metric = "timing/replay_s"
    in_thread: bool | None = False

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.drawn: list[Drawn] = []

    async def start(self) -> None:
        self.calls.append("start")

    async def draw(self) -> Drawn:
        self.calls.append("draw")
        group = _group(len(self.drawn))
        self.drawn.append(Drawn([group], [group], samples_of([group])))
        return self.drawn[-1]

    @asynccontextmanager
    async def publishing(self, version: int) -> AsyncIterator[None]:
        self.calls.append(f"publishing {version}")
        yield
        self.calls.append("published")

    def metrics(
        self, drawn: Drawn, waited: float, updated: float
    ) -> tuple[dict[str, float], dict[str, float]]:
        assert drawn is self.drawn[-1] and waited <= updated
        return {"replay/mean": 0.5}, {"replay/groups": len(drawn.train)}

    def save(self, state: RunState) -> None:
        state.sources["replay"] = {"buffer": [41, 42]}  # its own entry, its own fields

    async def stop(self) -> None:
        self.calls.append("stop")


class Weights:
    """An engine that records the policy versions published to it (it samples nothing)."""

    def __init__(self) -> None:
        self.versions: list[int] = []

    def update_weights(self, state: dict[str, torch.Tensor], version: int = 0) -> None:
        self.versions.append(version)


def test_the_loop_trains_on_what_its_source_draws(
    trainer_fmt: PromptFormat, tmp_path: Path
) -> None:
    cfg = Config()
    cfg.trainer.output_dir, cfg.trainer.checkpoint_every = str(tmp_path), 1
    cfg.trainer.lr, cfg.trainer.warmup_steps, cfg.reward.workers = 1e-3, 0, 1
    cfg.trainer.profile_step = 2
    model = tiny_model(len(trainer_fmt.tokenizer), hidden_size=32, layers=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine, source = Weights(), Replay()
    logger = RunLogger(tmp_path)
    run = build_run(cfg, model, trainer_fmt, [PROBLEM], tools=None, logger=logger, engine=engine)  # type: ignore[arg-type]

    async def main() -> list[dict[str, float]]:
        try:
            return await run.train(2, source=source)
        finally:
            await run.close()

    history = asyncio.run(main())
    logger.close()
    assert source.calls == [
        "start",
        "draw",
        "publishing 1",
        "published",
        "draw",
        "publishing 2",
        "published",
        "stop",
    ]
    assert engine.versions == [0, 1, 2]  # the weights before the first step, then each step's
    for metrics in history:
        assert metrics["loss/policy_tokens"] == 6  # 2 samples x 3 sampled tokens, both signal
        assert metrics["reward/mean"] == 0.5 and metrics["replay/mean"] == 0.5
        assert metrics["replay/groups"] == 1
        timings = ("timing/replay_s", "timing/update_s", "timing/sync_s")
        assert metrics["timing/step_s"] == sum(metrics[k] for k in timings)
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]
    profiles = sorted(p.name for p in tmp_path.glob("profile_step_*"))
    assert profiles == ["profile_step_000002.txt"]  # trainer.profile_step only
    profile = (tmp_path / profiles[0]).read_text()
    assert profile.startswith("RL step 2: ") and "aten::" in profile  # the update's CPU ops
    assert "profile/gpu_share" not in history[1]  # on a CPU: no GPU to share the time with
    state = read_state(tmp_path / "checkpoints" / "step_000002")
    assert state["extra"]["sources"] == {"replay": {"buffer": [41, 42]}}  # in the checkpoint
    assert any(not torch.equal(v, before[k]) for k, v in run.learner.model.state_dict().items())


class SlowReplay(Replay):
    """A `Replay` whose draws take `seconds` each."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def draw(self) -> Drawn:
        await asyncio.sleep(self.seconds)
        return await super().draw()


def _slow_steps(
    fmt: PromptFormat, run_dir: Path, deadline: Any, progress: str = ""
) -> tuple[list[dict[str, float]], RLRun, SlowReplay]:
    """Up to three RL steps of 0.5 s each (`SlowReplay`) under `deadline`."""
    cfg = Config()
    cfg.trainer.output_dir, cfg.reward.workers = str(run_dir), 1
    model = tiny_model(len(fmt.tokenizer), hidden_size=32, layers=1)
    logger = RunLogger(run_dir)
    run = build_run(cfg, model, fmt, [PROBLEM], tools=None, logger=logger, engine=Weights())  # type: ignore[arg-type]
    source = SlowReplay(0.5)

    async def main() -> list[dict[str, float]]:
        try:
            return await run.train(3, progress, source=source, deadline=deadline)
        finally:
            await run.close()

    history = asyncio.run(main())
    logger.close()
    return history, run, source


@pytest.mark.parametrize(("budget", "steps"), [(-1.0, 0), (1.0, 1), (60.0, 3)])
def test_no_step_starts_that_would_end_after_the_deadline(
    trainer_fmt: PromptFormat, tmp_path: Path, budget: float, steps: int
) -> None:
    """Steps of 0.5 s: a deadline passed runs none; 1 s from now runs the first (nothing is
    known of a step's length before it) but not the second (more than 0.5 + 0.5 s); a minute
    runs all three."""
    history, run, source = _slow_steps(trainer_fmt, tmp_path, time.perf_counter() + budget)
    assert len(history) == steps == run.step_index
    assert source.calls.count("draw") == steps and source.calls[-1] == "stop"


def test_a_deadline_asked_each_step_stops_where_it_moved_and_the_first_step_says_what_fits(
    trainer_fmt: PromptFormat, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A deadline function asked before each step: a minute away for the first two, then
    passed (a screen kept more problems to score after RL); two steps run. After the first
    step of 0.5 s one line says that all three fit in the minute."""
    asked: list[float] = []
    start = time.perf_counter()

    def deadline() -> float:
        asked.append(time.perf_counter())
        return start + (60.0 if len(asked) <= 2 else -1.0)

    history, _, _ = _slow_steps(trainer_fmt, tmp_path, deadline, "stage1")
    assert len(history) == 2 and len(asked) == 3
    line = r"stage1: a step took \d s \(sampling and update\): time for about 3 of its 3 steps"
    assert re.search(line, capsys.readouterr().out)


def _synchronous(refill: bool, signal: Callable[[int], bool]) -> tuple[SyncGroups, RunState]:
    """`SyncGroups` over synthetic groups: the group of data position p has signal when
    `signal(p)` (rewards 1, 0; else 0, 0)."""
    cfg, state = Config(), RunState()
    cfg.trainer.prompts_per_step, cfg.algo.drop_zero_signal_groups = 4, refill
    problems = [Problem(f"q{i}", f"problem {i}", "1") for i in range(20)]
    source = SyncGroups(cfg, World(), state, lambda p: problem_at(problems, 0, p), rollout=None)

    async def sample(chosen: Sequence[tuple[int, Problem]]) -> list[Group]:
        groups = []
        for position, problem in chosen:
            groups.append(_group(position, (1.0, 0.0) if signal(position) else (0.0, 0.0), problem))
        return groups

    source.sample = sample  # type: ignore[method-assign]
    return source, state


@pytest.mark.parametrize(
    ("refill", "signal", "trained", "sampled", "dropped"),
    [
        # odd positions have signal: round 1 draws 0-3 (keeps 1, 3), round 2 draws 4-5 (5),
        # round 3 draws 6 (none), round 4 draws 7 (7)
        (True, lambda p: p % 2 == 1, [1, 3, 5, 7], 8, 4),
        (False, lambda p: p % 2 == 1, [0, 1, 2, 3], 4, 0),  # no refill: all four stay
        (True, lambda p: False, [], 16, 16),  # MAX_REFILL_ROUNDS rounds of 4, then it gives up
    ],
)
def test_the_synchronous_source_refills_groups_without_signal(
    refill: bool, signal: Callable[[int], bool], trained: list[int], sampled: int, dropped: int
) -> None:
    source, state = _synchronous(refill, signal)
    drawn = asyncio.run(source.draw())
    assert [g.position for g in drawn.train] == trained
    assert [g.position for g in drawn.finished] == list(range(sampled))  # every group sampled
    assert state.data_position == sampled  # the next problem to draw
    assert source.metrics(drawn, 0.0, 0.0) == (
        {},
        {"rollout/groups_kept": len(trained), "rollout/groups_dropped": dropped},
    )
