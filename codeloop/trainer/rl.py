"""The GRPO-RoC RL loop: roll out, reward, resample, advantages, update, sync weights, log.

`RLRun.step()` reads top to bottom: sample prompts, roll out oversample x G trajectories per
prompt, score them, keep G per prompt with Resample-on-Correct, compute group advantages (and
refill dropped zero-signal groups when `algo.drop_zero_signal_groups`), take
`trainer.updates_per_step` optimiser steps over token-budgeted micro-batches, push the new
weights to the engine, log, checkpoint. Everything random is seeded from `trainer.seed`, the
step and the sample index, and the checkpoint holds the data position and the RoC generator, so
a run stopped and resumed reproduces the uninterrupted run (with a deterministic engine).
Trajectories go through a `Scheduler` (`rollout.scheduler`) over the engines: the in-process
engine, or one `OpenAIEngine` per `rollout.endpoints` (`rollout.backend = "openai"`: vLLM,
SGLang, `codeloop serve`). New weights reach the in-process engine through `update_weights`;
for servers, rank 0 saves them (model and tokenizer) to `rollout.weights_dir` and asks every
server to reload that directory before the next rollout.
"""

from __future__ import annotations

import asyncio
import copy
import random
import time
import warnings
import zlib
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from codeloop.algo.advantage import group_advantages, has_signal
from codeloop.algo.loss import policy_loss
from codeloop.algo.resample import penalty, resample
from codeloop.config import AlgoConfig, Config
from codeloop.data.problems import Problem
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent, collect
from codeloop.rollout.engine import Engine, ToolExecutor
from codeloop.rollout.hf_engine import TransformersEngine
from codeloop.rollout.openai_engine import OpenAIEngine, servers
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.scheduler import Scheduler
from codeloop.trainer.batch import (
    Sample,
    collate,
    from_trajectory,
    micro_batches,
    on_device,
    token_logprobs,
)
from codeloop.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from codeloop.trainer.distributed import (
    World,
    all_gather,
    all_max,
    all_mean,
    all_sum,
    barrier,
    full_optimizer_state,
    full_state_dict,
    pad_micro_batches,
    shard,
)
from codeloop.trainer.logs import RunLogger
from codeloop.types import RolloutStatus, Trajectory

T = TypeVar("T")
MAX_REFILL_ROUNDS = 4


@dataclass
class Group:
    problem: Problem
    sampled: list[Trajectory]
    kept: list[Trajectory]
    advantages: list[float]
    position: int = 0  # in the data order: the same on every rank


def make_group(problem: Problem, sampled: list[Trajectory], algo: AlgoConfig,
               rng: random.Random, position: int = 0) -> Group:  # fmt: skip
    """The scored samples of one prompt, resampled to the G that train, with advantages. One
    that hit an infrastructure fault is evidence of nothing: never kept, so neither rewarded
    nor penalised."""
    healthy = [t for t in sampled if not t.infra_fault]
    kept = resample(healthy, algo.group_size, algo.resample, rng) if healthy else []
    advantages = group_advantages([t.reward or 0.0 for t in kept], algo.adv_eps)
    return Group(problem, list(sampled), kept, advantages, position)


def problem_digest(problems: Sequence[Problem]) -> int:
    """A checksum of the problems' ids in order: which list a data position indexes."""
    return zlib.crc32("\n".join(p.id for p in problems).encode())


def _seed(*parts: int) -> int:
    return zlib.crc32(" ".join(map(str, parts)).encode()) & 0x7FFFFFFF


class RLRun:
    def __init__(self, cfg: Config, model: Any, fmt: PromptFormat, problems: Sequence[Problem],
                 tools: ToolExecutor, logger: RunLogger, engine: TransformersEngine | None = None,
                 world: World | None = None) -> None:  # fmt: skip
        if not problems:
            raise ValueError("RL needs at least one training problem (data.train)")
        t, world = cfg.trainer, world or World()
        if world.distributed and t.prompts_per_step < world.size:
            raise ValueError(f"{world.size} ranks need trainer.prompts_per_step >= {world.size}")
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
            )
        ]
        self.engine: Any = self.engines[0]
        self.model = model = shard(model, world)  # after the engine's unsharded copy
        self.verifier = Verifier(cfg.reward)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        warmup = t.warmup_steps  # linear warm-up, then constant (the report's)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        self.step_index = 0
        self.data_position = 0
        self.roc_rng = random.Random(t.seed)

    # -- the loop --------------------------------------------------------------------------

    async def step(self) -> dict[str, float]:
        timings: dict[str, float] = {}
        clock = time.perf_counter()
        groups, sampled = await self._groups(self.cfg.trainer.prompts_per_step)
        samples = [
            from_trajectory(t, a) for g in groups for t, a in zip(g.kept, g.advantages, strict=True)
        ]
        clock = _lap(timings, "timing/rollout_and_reward_s", clock)
        losses = self.update(samples)
        clock = _lap(timings, "timing/update_s", clock)
        await self.sync_weights()
        _lap(timings, "timing/sync_s", clock)
        self.step_index += 1
        metrics = all_mean(_rollout_metrics(sampled) | timings, self.world) | losses
        metrics["rollout/groups_kept"] = all_sum(len(groups), self.world)
        metrics["rollout/groups_dropped"] = all_sum(  # without signal: kept rewards all equal
            sum(not _signal(g) for g in sampled), self.world
        )
        dumps = all_gather(_dump(sampled), self.world)
        if self.world.is_main:
            self.logger.log(self.step_index, metrics)
            self.logger.trajectories(self.step_index, [r for rank in dumps for r in rank])
        self._maybe_checkpoint()
        return metrics

    async def sync_weights(self) -> None:
        """The engines sample with the trained weights (gathered from the shards)."""
        state = full_state_dict(self.model, self.world, everywhere=not self.servers)
        if not self.servers:
            self.engine.update_weights(state)
            return
        if self.world.is_main:
            path = Path(self.cfg.rollout.weights_dir or Path(self.logger.run_dir) / "weights")
            dtype = self.world.compute_dtype  # what the servers sample in: half the bytes in bf16
            self.model.save_pretrained(path, state_dict={k: v.to(dtype) for k, v in state.items()})
            self.fmt.tokenizer.save_pretrained(path)
            await asyncio.gather(*(server.reload(str(path.resolve())) for server in self.servers))
        barrier(self.world)
        if not self.cfg.rollout.kv_capacity_tokens:  # each server says what it holds
            live = [server for server in self.engines if isinstance(server, OpenAIEngine)]
            await asyncio.gather(*(s.refresh_kv() for s in live), return_exceptions=True)

    async def close(self) -> None:
        """Close the verifier's workers and the servers' HTTP sessions."""
        self.verifier.close()
        await asyncio.gather(*(server.close() for server in self.servers))

    async def train(self, steps: int) -> list[dict[str, float]]:
        await self.sync_weights()
        return [await self.step() for _ in range(steps)]

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
                batch = [g for g in batch if _signal(g)]
            if refill and world.distributed:  # everyone's, so that every rank decides alike
                batch = sorted((g for rank in all_gather(batch, world) for g in rank),
                               key=lambda g: g.position)  # fmt: skip
            groups += batch
            if len(groups) >= count or not refill:
                break
        if not (refill and world.distributed):
            return groups, sampled
        if 0 < len(groups) < world.size:
            raise RuntimeError(f"only {len(groups)} groups with signal after {MAX_REFILL_ROUNDS} "
                               f"rounds, fewer than the {world.size} ranks: raise "
                               "trainer.prompts_per_step")  # fmt: skip
        return groups[world.rank :: world.size], sampled

    def _next_problems(self, count: int) -> list[tuple[int, Problem]]:
        chosen = []
        for _ in range(count):
            epoch, index = divmod(self.data_position, len(self.problems))
            order = list(range(len(self.problems)))
            random.Random(_seed(self.cfg.trainer.seed, epoch)).shuffle(order)
            chosen.append((self.data_position, self.problems[order[index]]))
            self.data_position += 1
        return chosen

    async def _rollout(self, problems: list[tuple[int, Problem]]) -> list[Group]:
        algo = self.cfg.algo
        n = algo.group_size * algo.oversample
        scheduler = self.rollout_scheduler(batch_size=len(problems) * n)
        agent = Agent(scheduler, self.tools, self.fmt, self.cfg.rollout)
        positions = [position for position, _ in problems]  # seeds follow the data order
        scored = await collect(agent, [p for _, p in problems], n, self.verifier,
                               self.cfg.trainer.seed, keys=positions)  # fmt: skip
        return [make_group(problem, sampled, algo, self.roc_rng, position)
                for (position, problem), sampled in zip(problems, scored, strict=True)]  # fmt: skip

    def rollout_scheduler(self, batch_size: int = 0) -> Scheduler:
        """A scheduler over this rank's engines, with its share of each server's KV capacity."""
        return Scheduler.for_rollout(self.engines, self.cfg.rollout, batch_size, self.kv_sharing)

    # -- the update ------------------------------------------------------------------------

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """`trainer.updates_per_step` optimiser steps over the samples; returns loss metrics."""
        t, algo, temperature = self.cfg.trainer, self.cfg.algo, self.cfg.rollout.temperature
        pad_id = self.fmt.tokenizer.pad_token_id or 0
        if t.recompute_old_logprobs:
            self._recompute_old_logprobs(samples, pad_id)
        sums: dict[str, float] = defaultdict(float)
        self.model.train()
        split = (samples[i :: t.updates_per_step] for i in range(t.updates_per_step))
        chunks, world = [c for c in split if c], self.world
        if all_max(len(chunks), world) != -all_max(-len(chunks), world):
            raise ValueError("every rank needs trainer.updates_per_step samples or more")
        stepped = 0
        for chunk in chunks:
            # The denominator: the step's tokens with signal (a zero advantage trains nothing)
            tokens = round(all_sum(sum(sum(s.loss_mask[1:]) for s in chunk if s.advantage), world))
            if tokens == 0:  # nothing to learn from (every rank agrees): no optimiser step
                continue
            groups = micro_batches(chunk, t.micro_batch_tokens)
            for group, weight in pad_micro_batches(groups, world):
                batch = on_device(collate(group, pad_id), self.model)
                with world.autocast():
                    logprobs, entropies = token_logprobs(self.model, batch, temperature, True)
                loss, stats = policy_loss(logprobs, batch["old_logprobs"], batch["advantages"],
                                          batch["loss_mask"], max(tokens, 1), algo.clip_low,
                                          algo.clip_high, algo.dual_clip)  # fmt: skip
                (loss * weight * world.size).backward()  # FSDP averages over ranks
                entropy = (entropies * batch["loss_mask"]).sum()  # type: ignore[operator]
                for key, value in (("loss", float(loss.detach()) * tokens),
                                   ("kl", stats.approx_kl), ("clipped", stats.clipped_tokens),
                                   ("entropy", float(entropy))):  # fmt: skip
                    sums[key] += value * weight
            sums["tokens"] += tokens
            sums["all_tokens"] += all_sum(sum(sum(s.loss_mask[1:]) for s in chunk), world)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
            sums["grad_norm"] += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            stepped += 1
        with warnings.catch_warnings():  # a step without signal stepped no optimiser: the
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.scheduler.step()  # schedule still follows RL steps
        self.model.eval()
        for key in ("loss", "kl", "clipped", "entropy"):
            sums[key] = all_sum(sums[key], world)
        metrics = {"loss/loss": sums["loss"] / max(sums["tokens"], 1)} | {
            f"loss/{k}": sums[key] / max(sums["all_tokens"], 1)  # over every trained token
            for k, key in (
                ("clip_fraction", "clipped"),
                ("approx_kl", "kl"),
                ("entropy", "entropy"),
            )
        }
        return metrics | {"loss/grad_norm": sums["grad_norm"] / max(stepped, 1),
                          "loss/lr": float(self.scheduler.get_last_lr()[0]),
                          "loss/policy_tokens": float(sums["tokens"])}  # fmt: skip

    @torch.no_grad()
    def _recompute_old_logprobs(self, samples: list[Sample], pad_id: int) -> None:
        groups = micro_batches(samples, self.cfg.trainer.micro_batch_tokens)
        for group, weight in pad_micro_batches(groups, self.world):  # FSDP: equal forwards
            batch = on_device(collate(group, pad_id), self.model)
            if not weight:
                self.model(input_ids=batch["input_ids"][:1, :1])
                continue
            with self.world.autocast():
                logprobs, _ = token_logprobs(self.model, batch, self.cfg.rollout.temperature)
            for row, sample in enumerate(group):
                values = logprobs[row, : len(sample.input_ids) - 1].tolist()
                sample.old_logprobs = [0.0] + [
                    v if m else 0.0 for v, m in zip(values, sample.loss_mask[1:], strict=True)
                ]

    # -- checkpoints -----------------------------------------------------------------------

    def _maybe_checkpoint(self) -> None:
        every = self.cfg.trainer.checkpoint_every
        if every and self.step_index % every == 0:
            self.save()

    def save(self) -> None:
        extra = {
            "data_position": self.data_position,
            "roc_rng": self.roc_rng.getstate(),
            "problems": problem_digest(self.problems),
        }  # what data_position indexes
        model_state = full_state_dict(self.model, self.world, everywhere=False)
        optimizer_state = full_optimizer_state(self.model, self.optimizer, self.world)
        if self.world.is_main:
            save_checkpoint(self.logger.run_dir, self.step_index, self.model, self.optimizer,
                            self.scheduler, extra, self.cfg.trainer.keep_checkpoints,
                            model_state, optimizer_state)  # fmt: skip
        barrier(self.world)

    def resume(self) -> bool:
        """Continue from the run directory's latest checkpoint, if there is one."""
        path = latest_checkpoint(self.logger.run_dir)
        if path is None:
            return False
        self.step_index, extra = load_checkpoint(path, self.model, self.optimizer, self.scheduler,
                                                 sharded=self.world.distributed)  # fmt: skip
        self.data_position = int(extra["data_position"])
        self.roc_rng.setstate(extra["roc_rng"])
        return True


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
        raise ValueError("rollout.backend = 'openai' needs rollout.endpoints (server base URLs)")
    return servers(r.endpoints, r, r.served_model or cfg.trainer.model)


def _lap(timings: dict[str, float], key: str, since: float) -> float:
    now = time.perf_counter()
    timings[key] = now - since
    return now


def _rollout_metrics(groups: list[Group]) -> dict[str, float]:
    sampled = [t for g in groups for t in g.sampled]
    kept = [t for g in groups for t in g.kept]
    correct = [t for t in sampled if t.reward == 1.0]
    calls = [r for t in sampled for r in t.tool_calls]
    statuses = Counter(str(t.status) for t in sampled)

    def error_ratio(trajectories: list[Trajectory]) -> float:
        records = [r for t in trajectories for r in t.tool_calls]
        return sum(r.failed for r in records) / len(records) if records else 0.0

    metrics = {
        "reward/mean": sum(t.reward or 0.0 for t in sampled) / max(len(sampled), 1),
        "reward/kept_mean": sum(t.reward or 0.0 for t in kept) / max(len(kept), 1),
        "rollout/response_tokens": sum(len(t.response_ids) for t in sampled) / max(len(sampled), 1),
        "rollout/turns": sum(t.num_turns for t in sampled) / max(len(sampled), 1),
        "rollout/tool_calls": len(calls) / max(len(sampled), 1),
        "rollout/tool_error_ratio": error_ratio(sampled),
        "rollout/infra_faults": sum(t.infra_fault for t in sampled) / max(len(sampled), 1),
        "roc/tool_error_ratio_correct": error_ratio(correct),
        "roc/tool_error_ratio_kept_correct": error_ratio([t for t in kept if t.reward == 1.0]),
    }
    for status in RolloutStatus:  # every status, so that ranks average the same keys
        metrics[f"rollout/status_{status}"] = statuses[str(status)] / max(len(sampled), 1)
    return metrics


def _signal(group: Group) -> bool:
    return has_signal([t.reward or 0.0 for t in group.kept])


def _dump(groups: list[Group]) -> list[dict[str, Any]]:
    """Every sampled trajectory; `kept` marks those that trained (none of a group without
    signal)."""
    records = []
    for group in groups:
        kept = {id(t) for t in group.kept} if _signal(group) else set()
        for t in group.sampled:
            p = penalty(t)
            records.append({"prompt_id": t.prompt_id, "sample_index": t.sample_index,
                            "problem": group.problem.problem, "gold": group.problem.answer,
                            "status": str(t.status), "reward": t.reward,
                            "final_answer": t.final_answer,
                            "kept": id(t) in kept, "p_err": p.p_err, "p_format": p.p_format,
                            "num_turns": t.num_turns, "response_tokens": len(t.response_ids),
                            "tool_calls": [r.to_dict() for r in t.tool_calls],
                            "text": t.text})  # fmt: skip
    return records
