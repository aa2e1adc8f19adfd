"""The GRPO-RoC RL loop: collect, resample, advantages, learn, publish, log.

`RLRun.step()` reads top to bottom: draw prompts in the data order, `collect` oversample x G
scored trajectories per prompt (`rollout/collect.py`), keep G per prompt with
Resample-on-Correct and compute group advantages (`algo/group.py`; refilling dropped
zero-signal groups when `algo.drop_zero_signal_groups`), let the `Learner` (`learner.py`: the
sharded policy, its loss, optimiser, learning-rate schedule and checkpoints) take its optimiser
steps, publish the new weights through a `WeightSink` (`weights.py`: the in-process engine, or
servers that reload a saved directory), log, checkpoint. Everything random is seeded from
`trainer.seed`, the data position and the sample index, and the checkpoint holds the data
position and the RoC generator (`state.py`), so a run stopped and resumed reproduces the
uninterrupted run (with a deterministic engine). Trajectories go through a `Scheduler`
(`rollout.scheduler`) over the engines: the in-process engine, or one `OpenAIEngine` per
`rollout.endpoints` (`rollout.backend = "openai"`: vLLM, SGLang, `codeloop serve`).
"""

from __future__ import annotations

import asyncio
import copy
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from codeloop.algo.group import MAX_REFILL_ROUNDS, Group, make_group
from codeloop.algo.resample import penalty
from codeloop.config import Config, ConfigError
from codeloop.data.problems import DataError, Problem
from codeloop.errors import RunError
from codeloop.progress import progress_bar
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent, collect, seed_of
from codeloop.rollout.engine import Engine, SamplingParams, ToolExecutor
from codeloop.rollout.hf_engine import TransformersEngine
from codeloop.rollout.openai_engine import EngineError, OpenAIEngine, servers
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.scheduler import Scheduler
from codeloop.rollout.stats import trajectory_stats
from codeloop.trainer.batch import Sample, collate, from_trajectory, on_device, token_logprobs
from codeloop.trainer.checkpoint import latest_checkpoint
from codeloop.trainer.distributed import (
    World,
    all_gather,
    all_mean,
    all_sum,
)
from codeloop.trainer.learner import Learner
from codeloop.trainer.logs import RunLogger
from codeloop.trainer.state import RunState, problem_digest
from codeloop.trainer.weights import EngineSink, ServerSink, WeightSink
from codeloop.types import Trajectory

if TYPE_CHECKING:
    from codeloop.trainer.async_rl import AsyncRL

T = TypeVar("T")
RELOAD_PROBE_TOKENS = 16  # greedy tokens a server is checked on after a reload


class RLRun:
    def __init__(self, cfg: Config, model: Any, fmt: PromptFormat, problems: Sequence[Problem],
                 tools: ToolExecutor, logger: RunLogger, engine: TransformersEngine | None = None,
                 world: World | None = None) -> None:  # fmt: skip
        if not problems:
            raise DataError("RL needs at least one training problem (data.train)")
        t, world = cfg.trainer, world or World()
        if world.distributed and t.prompts_per_step < world.size:
            raise ConfigError(f"{world.size} ranks need trainer.prompts_per_step >= {world.size}")
        self.cfg, self.fmt, self.problems, self.world = cfg, fmt, list(problems), world
        self.tools, self.logger = tools, logger
        self.servers = _servers(cfg)  # all of them: rank 0 reloads every one
        mine, self.kv_sharing = rank_share(self.servers, world)
        self.engines: list[Engine] = list(mine) or [
            engine
            or TransformersEngine(
                copy.deepcopy(model).to(world.device, world.compute_dtype),
                fmt.tokenizer,
                fmt.end_of_turn_ids,
                max_batch=cfg.rollout.engine_max_batch,
                max_kv_tokens=cfg.rollout.kv_capacity_tokens,
            )
        ]
        self.engine: Any = self.engines[0]
        # after the engine's unsharded copy: the learner shards the model
        self.learner = Learner(model, cfg, world, fmt.tokenizer.pad_token_id or 0)
        self.model = self.learner.model
        self.sink: WeightSink = (
            ServerSink(self.servers, mine,
                       Path(cfg.rollout.weights_dir or Path(logger.run_dir) / "weights"),
                       self.model, fmt.tokenizer, world, not cfg.rollout.kv_capacity_tokens)
            if self.servers else EngineSink(self.engine)
        )  # fmt: skip
        self.verifier = Verifier(cfg.reward)
        self.step_index = 0
        self.state = RunState(t.seed)  # `save` records which problems its position indexes
        self.async_loop: AsyncRL | None = None  # trainer.mode = "async"

    # -- the loop --------------------------------------------------------------------------

    async def step(self) -> dict[str, float]:
        """One RL step: collect, resample, advantages, learn, publish, log."""
        timings: dict[str, float] = {}
        clock = time.perf_counter()
        groups, sampled = await self._groups(self.cfg.trainer.prompts_per_step)
        samples = [
            from_trajectory(t, a) for g in groups for t, a in zip(g.kept, g.advantages, strict=True)
        ]
        clock = _lap(timings, "timing/rollout_and_reward_s", clock)
        losses = self.learner.update(samples)
        clock = _lap(timings, "timing/update_s", clock)
        self.step_index += 1
        await self.sync_weights()
        _lap(timings, "timing/sync_s", clock)
        timings["timing/step_s"] = sum(timings.values())
        counts: dict[str, float] = {"rollout/groups_kept": len(groups),
                  "rollout/groups_dropped": sum(not g.has_signal for g in sampled)}  # fmt: skip
        return self.finish_step(sampled, timings, losses, counts)

    def finish_step(self, groups: list[Group], local: dict[str, float], losses: dict[str, float],
                    counts: dict[str, float], trained: set[int] | None = None
                    ) -> dict[str, float]:  # fmt: skip
        """Log and checkpoint a step (every rank calls it): the rollout metrics of `groups` and
        `local` averaged over the ranks, `counts` summed, `losses` as they are (the learner
        reduced them), trained tokens per second; the groups' trajectories dumped (`trained`:
        the id()s of those that trained, when not every group with signal did)."""
        world = self.world
        metrics = all_mean(_rollout_metrics(groups) | local, world) | losses
        for key, count in counts.items():
            metrics[key] = all_sum(float(count), world)
        metrics["throughput/trained_tokens_per_s"] = metrics["loss/policy_tokens"] / max(
            metrics["timing/step_s"], 1e-9
        )
        dumps = all_gather(_dump(groups, trained), world)
        if world.is_main:
            self.logger.log(self.step_index, metrics)
            self.logger.trajectories(self.step_index, [r for rank in dumps for r in rank])
        self._maybe_checkpoint()
        return metrics

    async def sync_weights(self) -> None:
        """The engines sample with the trained weights (gathered from the shards); servers are
        then checked to serve them (`rollout.reload_check_tol`)."""
        state = self.learner.full_state(everywhere=self.sink.everywhere)
        await self.sink.publish(state, self.step_index)
        if isinstance(self.sink, ServerSink) and self.cfg.rollout.reload_check_tol:
            await self._check_served_weights(self.sink.mine)

    async def _check_served_weights(self, mine: Sequence[OpenAIEngine]) -> None:
        """Each rank asks its servers for a greedy continuation of a probe prompt and scores
        the same tokens with the trainer (one forward per rank, as FSDP needs): a server whose
        logprobs stray from the trainer's by more than the tolerance still serves old weights
        (vLLM has had reloads that silently kept them, vllm-project/vllm#32718)."""
        probe = self.fmt.prompt_ids(self.problems[0].problem)
        params = SamplingParams(RELOAD_PROBE_TOKENS, temperature=0.0, seed=0)
        served = await asyncio.gather(*(server.generate(probe, params) for server in mine))
        samples = [Sample(probe + g.token_ids, [0] * len(probe) + [1] * len(g.token_ids),
                          [0.0] * (len(probe) + len(g.token_ids))) for g in served]  # fmt: skip
        batch = on_device(collate(samples, self.learner.pad_id), self.model)
        with torch.no_grad(), self.world.autocast():
            trained = token_logprobs(self.model, batch)[0]
        tol = self.cfg.rollout.reload_check_tol
        for row, (server, generation) in enumerate(zip(mine, served, strict=True)):
            start, n = len(probe) - 1, len(generation.token_ids)
            theirs = torch.tensor(generation.logprobs, device=trained.device)
            gap = float((trained[row, start : start + n] - theirs).abs().mean()) if n else 0.0
            if gap > tol:
                raise EngineError(
                    f"{server.base_url}: after reloading the weights its logprobs differ from "
                    f"the trainer's by {gap:.4f} nats per token (> rollout.reload_check_tol "
                    f"{tol}): the server still serves other weights (a stale reload?)"
                )

    async def close(self) -> None:
        """Close the verifier's workers and the servers' HTTP sessions."""
        self.verifier.close()
        await asyncio.gather(*(server.close() for server in self.servers))

    async def train(self, steps: int, progress: str = "") -> list[dict[str, float]]:
        """`steps` RL steps, synchronous or asynchronous (`trainer.mode`). `progress`: the label
        of a progress bar over the steps (rank 0; none when empty), the last reward beside it."""
        with progress_bar(total=self.step_index + steps, initial=self.step_index, desc=progress,
                  unit="step", disable=not (progress and self.world.is_main)) as bar:  # fmt: skip

            def stepped(metrics: dict[str, float]) -> None:
                bar.update()
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")

            if self.cfg.trainer.mode == "async":
                from codeloop.trainer.async_rl import AsyncRL  # it builds on this module

                self.async_loop = AsyncRL(self)
                return await self.async_loop.train(steps, stepped)
            await self.sync_weights()
            history = []
            for _ in range(steps):
                history.append(await self.step())
                stepped(history[-1])
            return history

    # -- rollout, reward, resampling -------------------------------------------------------

    async def _groups(self, count: int) -> tuple[list[Group], list[Group]]:
        """(the groups this rank trains on, every group this rank sampled this step). Every rank
        takes its share of the same problems. A group whose kept rewards are all equal has no
        signal (advantages 0). With `algo.drop_zero_signal_groups` (the report's choice) such
        groups are dropped and more problems drawn until `count` groups with signal remain
        over all ranks (at most MAX_REFILL_ROUNDS rounds); without it they stay in the batch,
        where `update` leaves their tokens out of the loss's denominator;
        with several ranks the kept groups are then gathered in data order and dealt out again,
        so that the step trains on the groups one process would."""
        refill, world = self.cfg.algo.drop_zero_signal_groups, self.world
        groups: list[Group] = []
        sampled: list[Group] = []
        for _ in range(MAX_REFILL_ROUNDS):
            chosen = self._next_problems(count - len(groups))  # the same on every rank
            batch = await self._rollout(chosen[world.rank :: world.size])
            sampled += batch
            if refill:
                batch = [g for g in batch if g.has_signal]
            if refill and world.distributed:  # everyone's, so that every rank decides alike
                batch = sorted((g for rank in all_gather(batch, world) for g in rank),
                               key=lambda g: g.position)  # fmt: skip
            groups += batch
            if len(groups) >= count or not refill:
                break
        if not (refill and world.distributed):
            return groups, sampled
        if 0 < len(groups) < world.size:
            raise RunError(f"only {len(groups)} groups with signal after {MAX_REFILL_ROUNDS} "
                               f"rounds, fewer than the {world.size} ranks: raise "
                               "trainer.prompts_per_step")  # fmt: skip
        return groups[world.rank :: world.size], sampled

    def _next_problems(self, count: int) -> list[tuple[int, Problem]]:
        chosen = []
        for _ in range(count):
            chosen.append((self.state.data_position, self.problem_at(self.state.data_position)))
            self.state.data_position += 1
        return chosen

    def problem_at(self, position: int) -> Problem:
        """The problem at `position` of the data order (an epoch is a seeded shuffle)."""
        epoch, index = divmod(position, len(self.problems))
        order = list(range(len(self.problems)))
        random.Random(seed_of(self.cfg.trainer.seed, epoch)).shuffle(order)
        return self.problems[order[index]]

    async def _rollout(self, problems: list[tuple[int, Problem]]) -> list[Group]:
        algo = self.cfg.algo
        n = algo.group_size * algo.oversample
        scheduler = self.rollout_scheduler(batch_size=len(problems) * n)
        agent = Agent(scheduler, self.tools, self.fmt, self.cfg.rollout)
        positions = [position for position, _ in problems]  # seeds follow the data order
        scored = await collect(agent, [p for _, p in problems], n, self.verifier,
                               self.cfg.trainer.seed, keys=positions,
                               progress="rollout" if self.world.is_main else "")  # fmt: skip
        return [make_group(problem, sampled, algo, self.state.roc_rng, position)
                for (position, problem), sampled in zip(problems, scored, strict=True)]  # fmt: skip

    def rollout_scheduler(self, batch_size: int = 0) -> Scheduler:
        """A scheduler over this rank's engines, with its share of each server's KV capacity."""
        return Scheduler.for_rollout(self.engines, self.cfg.rollout, batch_size, self.kv_sharing)

    # -- checkpoints -----------------------------------------------------------------------

    def _maybe_checkpoint(self) -> None:
        every = self.cfg.trainer.checkpoint_every
        if every and self.step_index % every == 0:
            self.save()

    def save(self) -> None:
        """A checkpoint of this step (every rank calls it: the weights are gathered)."""
        state = self.state
        if self.async_loop is not None:  # every rank's positions drawn and not trained
            mine = self.async_loop.pending()
            state.pending = sorted(p for part in all_gather(mine, self.world) for p in part)
            state.async_next = all_gather(self.async_loop.next, self.world)
            state.data_position = max(all_gather(state.data_position, self.world))
        state.problems = problem_digest(self.problems)  # what data_position indexes
        extra = state.state_dict()
        self.learner.save(self.logger.run_dir, self.step_index, extra, self.fmt)

    def resume(self) -> bool:
        """Continue from the run directory's latest checkpoint, if there is one. Either way the
        logs are rewound to the step the run starts from: what a killed attempt logged past its
        last checkpoint is logged again when the step is redone, not twice."""
        path = latest_checkpoint(self.logger.run_dir)
        if path is not None:
            self.step_index, extra = self.learner.load(path)
            self.state.load_state_dict(extra)
        if self.world.is_main:
            self.logger.rewind(self.step_index)
        return path is not None


def rank_share(servers: Sequence[T], world: World) -> tuple[list[T], int]:
    """The servers this rank schedules over, and how many ranks share each of them. Each rank
    runs its own scheduler, whose KV reservations the others do not see: with at least as many
    servers as ranks every rank gets servers of its own; with fewer, rank r uses server
    r mod n, whose capacity is split among the ranks that share it."""
    if len(servers) >= world.size or not servers:
        return list(servers[world.rank :: world.size]), 1
    home = world.rank % len(servers)
    return [servers[home]], len(range(home, world.size, len(servers)))


def _servers(cfg: Config) -> list[OpenAIEngine]:
    r = cfg.rollout
    if r.backend != "openai":
        return []
    if not r.endpoints:
        raise ConfigError("rollout.backend = 'openai' needs rollout.endpoints (server base URLs)")
    return servers(r.endpoints, r, r.served_model or cfg.trainer.model)


def _lap(timings: dict[str, float], key: str, since: float) -> float:
    now = time.perf_counter()
    timings[key] = now - since
    return now


def _rollout_metrics(groups: list[Group]) -> dict[str, float]:
    """`rollout/stats.py` over every sampled trajectory (`rollout/...`, `reward/mean`) and the
    kept ones (`reward/kept_mean`); RoC's tool-error ratio among right answers of both."""
    sampled = trajectory_stats([t for g in groups for t in g.sampled])
    kept = trajectory_stats([t for g in groups for t in g.kept])
    metrics = {
        "reward/mean": sampled["accuracy"],
        "reward/kept_mean": kept["accuracy"],
        "roc/tool_error_ratio_correct": sampled["tool_error_ratio_correct"],
        "roc/tool_error_ratio_kept_correct": kept["tool_error_ratio_correct"],
    }
    for key, value in sampled.items():
        if key not in ("accuracy", "tool_error_ratio_correct"):
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
            records.append({"prompt_id": t.prompt_id, "sample_index": t.sample_index,
                            "position": group.position,
                            "problem": group.problem.problem, "gold": group.problem.answer,
                            "status": str(t.status), "reward": t.reward,
                            "final_answer": t.final_answer,
                            "kept": id(t) in kept, "p_err": p.p_err, "p_format": p.p_format,
                            "num_turns": t.num_turns, "response_tokens": len(t.response_ids),
                            "tool_calls": [r.to_dict() for r in t.tool_calls],
                            "versions": _version_span(t),
                            "text": t.text})  # fmt: skip
    return records


def _version_span(trajectory: Trajectory) -> list[int]:
    """[oldest, newest] policy version of a trajectory's sampled tokens ([] if unknown)."""
    known = trajectory.policy_versions
    return [min(known), max(known)] if known else []
