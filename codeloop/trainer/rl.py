"""The GRPO-RoC RL loop: draw groups, update, publish the weights, log, checkpoint.

`RLRun.step()` reads top to bottom. Its `GroupSource` (`groups.py`) hands it the step's groups:
`collect` samples oversample x G scored trajectories per prompt drawn in the data order
(`rollout/collect.py`), `algo/group.py` keeps G per prompt with Resample-on-Correct and computes
group advantages, and groups without signal are refilled when `algo.drop_zero_signal_groups`;
synchronously (`SyncGroups`, the report's) or by a producer running ahead of the learner
(`AsyncGroups`, `async_rl.py`, `trainer.mode = "async"`). The `Learner` (`learner.py`: the
sharded policy, the loss `algo/loss.py` names, optimiser, learning-rate schedule and checkpoints)
takes its optimiser steps; the rollout side's `WeightSink` (`weights.py`: the in-process engine,
or servers sent the weights or told to reload them, and checked to serve them) publishes them;
the step is logged and checkpointed, after an evaluation on held-out problems when one is due
(`held_out.py`, `trainer.eval_every`). `build_run` builds a run from the config: the rollout side
(`rollout_side.py`: engines, tools, verifier, sink) and the learner.

Everything random is seeded from `trainer.seed`, the data position and the sample index, and the
checkpoint holds the run state (`state.py`: data position, the RoC generator, the asynchronous
loop's pending draws), so a run stopped and resumed reproduces the uninterrupted run (with a
deterministic engine).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from codeloop.algo.group import Group
from codeloop.algo.resample import penalty
from codeloop.config import Config, ConfigError
from codeloop.data.problems import DataError, Problem
from codeloop.engine.hf_engine import EngineStats, TransformersEngine
from codeloop.progress import progress_bar
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.score import Scores, score_policy
from codeloop.rollout.stats import trajectory_stats
from codeloop.rollout.tools import ToolExecutor
from codeloop.trainer.async_rl import AsyncGroups
from codeloop.trainer.checkpoint import latest_checkpoint
from codeloop.trainer.distributed import World, all_gather, all_mean, all_sum, rank_address
from codeloop.trainer.groups import Drawn, GroupSource, SyncGroups, problem_at
from codeloop.trainer.held_out import HeldOut, gather_scores
from codeloop.trainer.learner import Learner
from codeloop.trainer.logs import RunLogger
from codeloop.trainer.profile import StepProfile
from codeloop.trainer.rollout_side import RolloutSide, build_rollout
from codeloop.trainer.state import RunState, problem_digest
from codeloop.trainer.weights import ServerSink
from codeloop.types import Trajectory


class RLRun:
    """A run's learner and rollout side, its problems, log and state (`build_run` makes one)."""

    def __init__(
        self,
        cfg: Config,
        learner: Learner,
        rollout: RolloutSide,
        fmt: PromptFormat,
        *,
        problems: Sequence[Problem],
        logger: RunLogger,
        world: World,
        held_out: HeldOut | None = None,
    ) -> None:
        self.cfg, self.learner, self.rollout, self.fmt = cfg, learner, rollout, fmt
        self.problems, self.logger, self.world = list(problems), logger, world
        self.held_out = held_out or HeldOut(cfg, [])  # scored every trainer.eval_every steps
        self.step_index = 0
        self.state = RunState(cfg.trainer.seed)  # `save` records which problems it indexes
        self.source: GroupSource | None = None  # while and after `train`

    # -- the loop --------------------------------------------------------------------------

    async def step(self) -> dict[str, float]:
        """One RL step (of `train`): draw the groups, update, publish the weights, log,
        checkpoint."""
        source, clock = self.source, Clock()
        assert source is not None, "RLRun.step runs inside RLRun.train"
        profiled = self._profile(self.step_index + 1)
        engine_before = self.rollout.engine_stats()
        drawn = await source.draw()
        waited = clock.lap(source.wait_metric)
        losses = await self.learner.update_async(drawn.samples, source.in_thread)
        updated = clock.lap("timing/update_s")
        self.step_index += 1
        async with source.publishing(self.step_index):
            await self.sync_weights()
        clock.lap("timing/sync_s")
        evaluated = await self.evaluate(clock)
        local, counts = source.metrics(drawn, waited, updated)
        local |= _engine_metrics(self.rollout.engine_stats(), engine_before)
        if profiled is not None:
            local |= profiled.stop(self.logger.run_dir, self.step_index, self.world.is_main)
        return self.finish_step(drawn, clock.timings() | local | evaluated, losses, counts)

    async def evaluate(self, clock: Clock) -> dict[str, float]:
        """The held-out metrics (`held_out.py`) when this step is due for them, else none."""
        if not self.held_out.due(self.step_index):
            return {}
        metrics = await self.held_out.score(self.rollout, self.world)
        clock.lap("timing/eval_s")
        return metrics

    def _profile(self, step: int) -> StepProfile | None:
        """The profiler, started, when `step` is `trainer.profile_step`."""
        if step != self.cfg.trainer.profile_step:
            return None
        profiled = StepProfile(self.world.device)
        profiled.start()
        return profiled

    async def train(
        self,
        steps: int,
        progress: str = "",
        source: GroupSource | None = None,
        deadline: float | Callable[[], float | None] | None = None,
    ) -> list[dict[str, float]]:
        """`steps` RL steps, their groups drawn from `source`, or synchronously or
        asynchronously as `trainer.mode` says. `progress`: the label of a progress bar over the
        steps (rank 0; none when empty), the last reward beside it. `deadline` (a
        `time.perf_counter()` value, or a function asked before each step): a step starts only
        when one as long as the last would end by then (the ranks agree), so fewer than `steps`
        may run; after the first step one line says how many fit."""
        self.source = source or self._new_source()
        await self.sync_weights()
        await self.source.start()
        history: list[dict[str, float]] = []
        last_s = 0.0
        try:
            with progress_bar(
                total=self.step_index + steps,
                initial=self.step_index,
                desc=progress,
                unit="step",
                disable=not (progress and self.world.is_main),
            ) as bar:
                for done in range(steps):
                    until = deadline() if callable(deadline) else deadline
                    if until is not None and self._out_of_time(until, last_s):
                        break
                    started = time.perf_counter()
                    history.append(await self.step())
                    last_s = time.perf_counter() - started
                    if not done and until is not None and self.world.is_main:
                        fit = min(steps, 1 + int((until - time.perf_counter()) // last_s))
                        print(
                            f"{progress or 'RL'}: a step took {last_s:.0f} s (sampling and "
                            f"update): time for about {fit} of its {steps} steps",
                            flush=True,
                        )
                    bar.update()
                    bar.set_postfix(reward=f"{history[-1]['reward/mean']:.3f}")
        finally:
            await self.source.stop()
        return history

    def _out_of_time(self, deadline: float, step_s: float) -> bool:
        """Whether a step of `step_s` seconds started now would end after `deadline`, on any
        rank."""
        late = time.perf_counter() + step_s > deadline
        return all_sum(float(late), self.world) > 0

    def finish_step(
        self,
        drawn: Drawn,
        local: dict[str, float],
        losses: dict[str, float],
        counts: dict[str, float],
    ) -> dict[str, float]:
        """Log and checkpoint a step (every rank calls it): the rollout metrics of the groups
        `drawn` finished and `local` averaged over the ranks, `counts` summed, `losses` as
        they are (the learner reduced them), trained tokens per second; the finished groups'
        trajectories dumped."""
        world = self.world
        metrics = all_mean(_rollout_metrics(drawn.finished) | local, world) | losses
        for key, count in counts.items():
            metrics[key] = all_sum(float(count), world)
        metrics["throughput/trained_tokens_per_s"] = metrics["loss/policy_tokens"] / max(
            metrics["timing/step_s"], 1e-9
        )
        dumps = all_gather(_dump(drawn.finished, drawn.trained), world)
        if world.is_main:
            self.logger.log(self.step_index, metrics)
            self.logger.trajectories(self.step_index, [r for rank in dumps for r in rank])
        every = self.cfg.trainer.checkpoint_every
        if every and self.step_index % every == 0:
            self.save()
        return metrics

    async def sync_weights(self) -> None:
        """The engines sample with the trained weights (gathered from the shards)."""
        sink, learner = self.rollout.sink, self.learner
        if learner.lora is not None and sink.takes_adapters:  # a few MB instead of the model
            await sink.publish(learner.adapter(), self.step_index)
            return
        await sink.publish(learner.full_state(everywhere=sink.everywhere), self.step_index)

    async def close(self) -> None:
        await self.rollout.close()

    def problem_at(self, position: int) -> Problem:
        """The problem at `position` of the data order (an epoch is a seeded shuffle)."""
        return problem_at(self.problems, self.cfg.trainer.seed, position)

    def _new_source(self) -> GroupSource:
        args = (self.cfg, self.world, self.state, self.problem_at)
        if self.cfg.trainer.mode == "async":
            return AsyncGroups(*args, rollout=self.rollout, version=self.step_index)
        return SyncGroups(*args, rollout=self.rollout)

    # -- checkpoints -----------------------------------------------------------------------

    def save(self) -> None:
        """A checkpoint of this step (every rank calls it: the weights are gathered)."""
        if self.source is not None:
            self.source.save(self.state)
        self.state.problems = problem_digest(self.problems)  # what data_position indexes
        self.learner.save(self.logger.run_dir, self.step_index, self.state.state_dict(), self.fmt)

    def resume(self) -> bool:
        """Continue from the run directory's latest checkpoint, if there is one. Either way the
        logs are rewound to the step the run starts from: what a killed attempt logged past its
        last checkpoint is logged again when the step is redone, not twice."""
        path = latest_checkpoint(self.logger.run_dir)
        seen = all_gather(path.name if path else "no checkpoint", self.world)
        if len(set(seen)) > 1:  # a node that does not see the run directory rank 0 writes
            views = ", ".join(
                f"rank {r} ({rank_address(r)}): {name}" for r, name in enumerate(seen)
            )
            raise ConfigError(
                f"{self.logger.run_dir}: the ranks see different checkpoints ({views}); every "
                "node must see trainer.output_dir at this path (a shared filesystem)"
            )
        if path is not None:
            self.step_index, extra = self.learner.load(path)
            self.state.load_state_dict(extra)
        if self.world.is_main:
            self.logger.rewind(self.step_index)
        return path is not None

    # -- between recipe stages -------------------------------------------------------------

    def use_problems(self, problems: Sequence[Problem]) -> None:
        """Train on `problems` from now on (a refiltered stage's)."""
        if not problems:
            raise DataError("RL needs at least one training problem")
        self.problems = list(problems)

    def carried(self) -> dict[str, Any]:
        """What the next recipe stage goes on from: the optimiser's and the schedule's state,
        and the run state (data position)."""
        return self.learner.optimizer_state() | {"state": self.state}

    def carry_on_from(self, carried: dict[str, Any], reset_optimizer: bool = False) -> None:
        """Go on from an earlier stage's `carried()`: its optimiser and schedule (unless
        `reset_optimizer`), and its data position when this stage trains on the same
        problems."""
        if not reset_optimizer:
            self.learner.load_optimizer_state(carried)
        self.state.carry_on_from(carried["state"], problem_digest(self.problems))

    async def score(self, problems: Sequence[Problem], k: int, progress: str = "") -> Scores:
        """`k` samples of each problem from the current policy, scored (`rollout/score.py`),
        this rank sampling its share of them (all ranks call it and get all the shares; the
        trajectories stay on the rank that sampled them)."""
        await self.sync_weights()
        world = self.world
        mine = list(problems)[world.rank :: world.size]
        found = await score_policy(
            self.rollout.agent(),
            mine,
            k,
            self.rollout.verifier,
            seed=self.cfg.trainer.seed,
            progress=progress if world.is_main else "",
        )
        return gather_scores(found, world)


@contextlib.asynccontextmanager
async def opened_run(
    cfg: Config,
    model: Any,
    fmt: PromptFormat,
    problems: Sequence[Problem],
    *,
    tools: ToolExecutor,
    run_dir: str | Path,
    world: World | None = None,
    engine: TransformersEngine | None = None,
) -> AsyncIterator[RLRun]:
    """The one lifecycle of an RL run (`codeloop train`, each recipe stage): its log in
    `run_dir` and the run built (`build_run`), the block's work (resume, train), a checkpoint
    when the block ends normally, and the log and the rollout side closed however it ends."""
    world = world or World()
    logger = RunLogger.for_run(cfg, run_dir, world.is_main)
    try:
        run = build_run(
            cfg, model, fmt, problems, tools=tools, logger=logger, engine=engine, world=world
        )
    except BaseException:
        logger.close()
        raise
    try:
        yield run
        run.save()
    finally:
        logger.close()
        await run.close()


def build_run(
    cfg: Config,
    model: Any,
    fmt: PromptFormat,
    problems: Sequence[Problem],
    *,
    tools: ToolExecutor,
    logger: RunLogger,
    world: World | None = None,
    engine: TransformersEngine | None = None,
) -> RLRun:
    """The RL run `cfg` describes on `problems`: the rollout side (`build_rollout`; `engine`:
    an in-process engine to sample with instead of a copy of `model`), then the learner, which
    trains `model` (sharded over the ranks of `world`; one process when None)."""
    if not problems:
        raise DataError("RL needs at least one training problem (data.train)")
    world = world or World()
    if world.distributed and cfg.trainer.prompts_per_step < world.size:
        raise ConfigError(f"{world.size} ranks need trainer.prompts_per_step >= {world.size}")
    probe = fmt.prompt_ids(problems[0].problem)  # a server's reload is checked on it
    rollout = build_rollout(
        cfg, model, fmt, tools, world=world, run_dir=logger.run_dir, probe=probe, engine=engine
    )
    learner = Learner(model, cfg, world, fmt.tokenizer.pad_token_id or 0)  # after the copy
    if learner.lora is not None and isinstance(rollout.sink, ServerSink):
        rollout.sink.adapter_metadata = learner.lora.push_metadata()
    return RLRun(
        cfg,
        learner,
        rollout,
        fmt,
        problems=problems,
        logger=logger,
        world=world,
        held_out=HeldOut.from_config(cfg),
    )


class Clock:
    """A step's timings: each lap from the one before, and their sum as `timing/step_s`."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, key: str) -> float:
        """Time `key` up to now; returns now."""
        now = time.perf_counter()
        self.laps[key] = now - self.last
        self.last = now
        return now

    def timings(self) -> dict[str, float]:
        return self.laps | {"timing/step_s": sum(self.laps.values())}


def _engine_metrics(now: EngineStats | None, before: EngineStats | None) -> dict[str, float]:
    """The in-process engines' work between two of their `stats()` (`engine/...`; none on
    servers): decoding steps, rows a step, prefills, prompt tokens computed and the share
    served from the prefix cache, seconds in prefill, decoding and between steps, graphs
    captured."""
    if now is None or before is None:
        return {}
    return {f"engine/{key}": float(value) for key, value in now.since(before).metrics().items()}


def _rollout_metrics(groups: list[Group]) -> dict[str, float]:
    """`rollout/stats.py` over every sampled trajectory (`rollout/...`, `reward/mean`) and the
    kept ones (`reward/kept_mean`); RoC's tool-error ratio among right answers of both."""
    sampled = trajectory_stats([t for g in groups for t in g.sampled])
    kept = trajectory_stats([t for g in groups for t in g.kept])
    metrics = {
        "reward/mean": sampled["reward"],
        "reward/kept_mean": kept["reward"],
        "roc/tool_error_ratio_correct": sampled["tool_error_ratio_correct"],
        "roc/tool_error_ratio_kept_correct": kept["tool_error_ratio_correct"],
    }
    for key, value in sampled.items():
        if key not in ("reward", "tool_error_ratio_correct"):
            metrics[f"rollout/{key}"] = value
    return metrics


def _dump(groups: list[Group], trained: set[int] | None = None) -> list[dict[str, Any]]:
    """Every sampled trajectory; `kept` marks those that trained (none of a group without
    signal, nor of a group not in `trained`, the id()s of the groups that trained, when
    given). `versions`: the oldest and newest policy version of its sampled tokens."""
    records = []
    for group in groups:
        trains = group.has_signal and (trained is None or id(group) in trained)
        kept = {id(t) for t in group.kept} if trains else set()
        for t in group.sampled:
            p = penalty(t)
            records.append(
                {
                    "prompt_id": t.prompt_id,
                    "sample_index": t.sample_index,
                    "position": group.position,
                    "problem": group.problem.problem,
                    "gold": group.problem.answer,
                    "status": str(t.status),
                    "reward": t.reward,
                    "final_answer": t.final_answer,
                    "kept": id(t) in kept,
                    "p_err": p.p_err,
                    "p_format": p.p_format,
                    "num_turns": t.num_turns,
                    "response_tokens": len(t.response_ids),
                    "tool_calls": [r.to_dict() for r in t.tool_calls],
                    "versions": _version_span(t),
                    "text": t.text,
                }
            )
    return records


def _version_span(trajectory: Trajectory) -> list[int]:
    """[oldest, newest] policy version of a trajectory's sampled tokens ([] if unknown)."""
    known = trajectory.policy_versions
    return [min(known), max(known)] if known else []
