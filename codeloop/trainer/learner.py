"""The learner: the trainable policy, its loss, optimiser and checkpoints.

`Learner.update(samples)` takes `trainer.updates_per_step` optimiser steps of the policy loss
`algo.loss` names (`algo/loss.py`: token-level or GSPO's sequence-level) over token-budgeted
micro-batches (with `algo.off_policy = "decoupled"`, against recomputed proximal logprobs, each
token weighted by proximal/behaviour); the loss is the mean over the tokens (or sequences) with
signal of each optimiser step, across ranks. The learner computes logprobs and calls the loss.
The model is sharded over the ranks of `world` with FSDP2 (nothing is sharded in a world of one);
parameters, gradients and AdamW state stay float32 and the passes run in `trainer.dtype`. The
learning rate warms up linearly over `trainer.warmup_steps` RL steps, then stays constant (the
report's); `lr_schedule` steps once per RL step, whether or not the step had signal.
`full_state` gathers the weights for a `WeightSink`; `save`/`load` write and read full
(unsharded) checkpoints that any world size resumes from. With `trainer.lora.rank` > 0 the
learner trains LoRA adapters on the frozen policy (`lora.py`, one process): the optimiser and the
checkpoints hold the adapters only, `full_state` is the merged weights and `adapter` the
adapters alone (what a `codeloop serve` is sent).

`update_async` is the same update for a loop that generates meanwhile (`trainer.mode =
"async"`). On a GPU it runs in a worker thread. On a CPU it runs on the event loop's thread and
yields to the loop after every micro-batch, so the in-process engine (which steps on that
thread on a CPU, `engine/hf_engine.py`) takes its decoding steps between them: the two share
one OpenMP team instead of two teams over-subscribing the cores.
"""

from __future__ import annotations

import asyncio
import warnings
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch

from codeloop.algo.loss import LOSSES, behaviour_weights
from codeloop.config import Config, ConfigError
from codeloop.engine.adapter import adapter_state
from codeloop.memory import trim_when_above
from codeloop.rollout.policy import Policy
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer import lora
from codeloop.trainer.batch import (
    Sample,
    budget_tokens,
    collate,
    micro_batches,
    on_device,
    token_logprobs,
)
from codeloop.trainer.checkpoint import load_checkpoint, save_checkpoint
from codeloop.trainer.distributed import (
    World,
    all_max,
    all_sum,
    barrier,
    full_optimizer_state,
    full_state_dict,
    pad_micro_batches,
    shard,
)


class Learner:
    """The policy being trained (see the module docstring)."""

    def __init__(self, model: Any, cfg: Config, world: World, pad_id: int = 0) -> None:
        t = cfg.trainer
        self.cfg, self.world, self.pad_id = cfg, world, pad_id
        if t.lora.rank:
            if world.distributed:
                raise ConfigError(
                    "trainer.lora trains in one process: run it without torchrun, or train the "
                    "full weights (trainer.lora.rank = 0)"
                )
            model = lora.attach(model, t.lora)
        self.lora = lora.attached(model)
        if t.gradient_checkpointing:  # transformers recomputes a layer only while training
            enable = getattr(model, "activation_checkpointing_enable", None)  # 5.2x's name
            (enable or model.gradient_checkpointing_enable)({"use_reentrant": False})
        self.model = shard(model, world)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=t.lr, weight_decay=t.weight_decay)
        warmup = t.warmup_steps  # linear warm-up, then constant (the report's)
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        self._budget = 0  # a micro-batch's tokens, settled at the first update

    @property
    def micro_batch_tokens(self) -> int:
        """`trainer.micro_batch_tokens`, or where it is 0 what the memory free at the first
        update holds (`budget_tokens`; the least of every rank's)."""
        if not self._budget:
            t = self.cfg.trainer
            checkpointed = t.gradient_checkpointing
            self._budget = budget_tokens(t.micro_batch_tokens, self.model, self.world, checkpointed)
        return self._budget

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """`trainer.updates_per_step` optimiser steps over the samples; returns loss metrics."""
        steps = self._update(samples)
        while (metrics := _advance(steps)) is None:
            pass
        return metrics

    async def update_async(
        self, samples: list[Sample], in_thread: bool | None = None
    ) -> dict[str, float]:
        """`update` beside other work on the event loop: in a worker thread (`in_thread`;
        default: on a GPU), else on the loop's thread, yielding after every micro-batch."""
        if in_thread is None:
            in_thread = self.world.device.type != "cpu"
        if in_thread:
            return await asyncio.to_thread(self.update, samples)
        steps = self._update(samples)
        while (metrics := _advance(steps)) is None:
            await asyncio.sleep(0)
        return metrics

    def _update(self, samples: list[Sample]) -> Generator[None, None, dict[str, float]]:
        """`update`, yielding after each micro-batch's backward pass."""
        t, algo, temperature = self.cfg.trainer, self.cfg.algo, self.cfg.rollout.temperature
        pad_id = self.pad_id
        recomputed = t.recompute_old_logprobs or algo.off_policy == "decoupled"
        if recomputed:
            behaviour = [s.old_logprobs for s in samples]
            self._recompute_old_logprobs(samples, pad_id)
            if algo.off_policy == "decoupled":  # clip against the proximal policy, weight
                for sample, engine in zip(samples, behaviour, strict=True):  # by prox/behaviour
                    sample.weights = behaviour_weights(
                        sample.old_logprobs, engine, sample.loss_mask, algo.behaviour_weight_cap
                    )
        sums: dict[str, float] = defaultdict(float)
        self.model.train()
        split = (samples[i :: t.updates_per_step] for i in range(t.updates_per_step))
        chunks, world = [c for c in split if c], self.world
        if all_max(len(chunks), world) != -all_max(-len(chunks), world):
            raise ConfigError("every rank needs trainer.updates_per_step samples or more")
        stepped, policy = 0, LOSSES[algo.loss]
        for chunk in chunks:
            # The denominator: the step's tokens (or sequences) with signal (a zero advantage
            # trains nothing)
            signal = [s for s in chunk if s.advantage]
            tokens = round(all_sum(sum(sum(s.loss_mask[1:]) for s in signal), world))
            if tokens == 0:  # nothing to learn from (every rank agrees): no optimiser step
                continue
            units = tokens if policy.per == "token" else round(all_sum(len(signal), world))
            groups = micro_batches(chunk, self.micro_batch_tokens)
            for group, weight in pad_micro_batches(groups, world):
                batch = on_device(collate(group, pad_id), self.model)
                with world.autocast():
                    logprobs, entropies = token_logprobs(self.model, batch, temperature, True)
                loss, stats = policy.fn(
                    logprobs,
                    batch["old_logprobs"],
                    batch["advantages"],
                    batch["loss_mask"],
                    denominator=units,
                    clip_low=algo.clip_low,
                    clip_high=algo.clip_high,
                    dual_clip=algo.dual_clip,
                    weights=batch.get("weights"),
                )
                (loss * weight * world.size).backward()  # FSDP averages over ranks
                entropy = (entropies * batch["loss_mask"]).sum()  # type: ignore[operator]
                if not stepped and not recomputed:  # the sampled weights: engine vs trainer
                    gap = (logprobs.detach() - batch["old_logprobs"]).abs() * batch["loss_mask"]
                    sums["gap"] += float(gap.sum()) * weight
                    sums["gap_tokens"] += float(batch["loss_mask"].sum()) * weight
                for key, value in (
                    ("loss", float(loss.detach()) * units),
                    ("kl", stats.approx_kl),
                    ("clipped", stats.clipped_tokens),
                    ("entropy", float(entropy)),
                ):
                    sums[key] += value * weight
                yield
            sums["tokens"] += tokens
            sums["units"] += units
            sums["all_tokens"] += all_sum(sum(sum(s.loss_mask[1:]) for s in chunk), world)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
            sums["grad_norm"] += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            trim_when_above()  # a CPU run's freed activations otherwise pile up (memory.py)
            stepped += 1
        lr = float(self.lr_schedule.get_last_lr()[0])  # this step's, before the schedule moves
        with warnings.catch_warnings():  # a step without signal stepped no optimiser: the
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.lr_schedule.step()  # schedule still follows RL steps
        self.model.eval()
        for key in ("loss", "kl", "clipped", "entropy", "gap", "gap_tokens"):
            sums[key] = all_sum(sums[key], world)
        metrics = {"loss/loss": sums["loss"] / max(sums["units"], 1)} | {
            f"loss/{k}": sums[key] / max(sums["all_tokens"], 1)  # over every trained token
            for k, key in (
                ("clip_fraction", "clipped"),
                ("approx_kl", "kl"),
                ("entropy", "entropy"),
            )
        }
        if sums["gap_tokens"]:  # how far the engine's logprobs of its tokens lie from ours
            metrics["loss/sampler_gap"] = sums["gap"] / sums["gap_tokens"]  # nats per token
        return metrics | {
            "loss/grad_norm": sums["grad_norm"] / max(stepped, 1),
            "loss/lr": lr,
            "loss/policy_tokens": float(sums["tokens"]),
        }

    @torch.no_grad()
    def _recompute_old_logprobs(self, samples: list[Sample], pad_id: int) -> None:
        groups = micro_batches(samples, self.micro_batch_tokens)
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

    # -- weights and checkpoints -------------------------------------------------------------

    def full_state(self, everywhere: bool) -> dict[str, torch.Tensor]:
        """The full (unsharded) weights: on every rank, or on rank 0 only (empty elsewhere);
        with LoRA, the weights with the adapters merged."""
        if self.lora is not None:
            return lora.merged_state(self.model)
        return full_state_dict(self.model, self.world, everywhere=everywhere)

    def adapter(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters (`lora.adapter_state`); empty when training the full weights."""
        return adapter_state(self.model) if self.lora is not None else {}

    def optimizer_state(self) -> dict[str, Any]:
        """The optimiser's and the learning-rate schedule's state (what a recipe stage carries
        to the next)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "lr_schedule": self.lr_schedule.state_dict(),
        }

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Go on from `optimizer_state()` (of this policy, in an earlier stage)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_schedule.load_state_dict(state["lr_schedule"])

    def save(
        self, run_dir: str | Path, step: int, extra: dict[str, Any], fmt: PromptFormat
    ) -> None:
        """A full checkpoint of step `step` in `run_dir` (rank 0 writes it), with `extra`; the
        policy (this model prompted with `fmt`) loads on its own from its `model/`."""
        weights = None if self.lora else full_state_dict(self.model, self.world, everywhere=False)
        optimizer_state = full_optimizer_state(self.model, self.optimizer, self.world)
        if self.world.is_main:
            save_checkpoint(
                run_dir,
                step,
                Policy(self.model, fmt),
                optimizer=self.optimizer,
                lr_schedule=self.lr_schedule,
                extra=extra,
                keep=self.cfg.trainer.keep_checkpoints,
                weights=weights,
                optimizer_state=optimizer_state,
            )
        barrier(self.world)

    def load(self, path: str | Path) -> tuple[int, dict[str, Any]]:
        """Restore a checkpoint; returns (its step, its extra)."""
        return load_checkpoint(
            path, self.model, self.optimizer, self.lr_schedule, sharded=self.world.distributed
        )


def _advance(steps: Generator[None, None, dict[str, float]]) -> dict[str, float] | None:
    """Run an update to its next micro-batch: None, or its metrics once it has ended."""
    try:
        next(steps)
    except StopIteration as done:
        metrics: dict[str, float] = done.value
        return metrics
    return None
