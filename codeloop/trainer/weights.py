"""Where new weights go after an update: a `WeightSink`.

- `EngineSink`: the in-process engine of each rank copies the gathered weights in place
  (`TransformersEngine.update_weights`); every rank needs the full weights.
- `ServerSink`: OpenAI-compatible servers (`codeloop serve`, vLLM, SGLang). Rank 0 saves the
  weights (model and tokenizer, in the compute dtype: half the bytes in bfloat16) to a
  directory and asks every server to reload it (`OpenAIEngine.reload`); then, when
  `rollout.kv_capacity_tokens` is unset, each rank reads its servers' KV capacity, and with a
  `ReloadCheck` each rank checks that its servers serve the new weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from codeloop.rollout.engine import SamplingParams, WeightUpdatable
from codeloop.rollout.openai_engine import EngineError, OpenAIEngine
from codeloop.trainer.batch import Sample, collate, on_device, token_logprobs
from codeloop.trainer.distributed import World, barrier

RELOAD_PROBE_TOKENS = 16  # greedy tokens a server is checked on after a reload


class WeightSink(Protocol):
    everywhere: bool  # every rank needs the full weights (else rank 0 alone)

    async def publish(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Make the rollout sample with `state` (empty on ranks that do not need it), policy
        version `version` (the RL step that produced it)."""
        ...


class EngineSink:
    everywhere = True

    def __init__(self, engine: WeightUpdatable) -> None:
        self.engine = engine

    async def publish(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.engine.update_weights(state, version)


class ReloadCheck:
    """After a reload each rank asks its servers for a greedy continuation of a probe prompt and
    scores the same tokens with the trainer's model (one forward per rank, as FSDP needs): a
    server whose logprobs stray from the trainer's by more than `tol` nats per token still
    serves old weights (vLLM has had reloads that silently kept them, vllm-project/vllm#32718)."""

    def __init__(self, probe: list[int], tol: float, pad_id: int) -> None:
        self.probe, self.tol, self.pad_id = probe, tol, pad_id

    async def __call__(self, mine: Sequence[OpenAIEngine], model: Any, world: World) -> None:
        probe = self.probe
        params = SamplingParams(RELOAD_PROBE_TOKENS, temperature=0.0, seed=0)
        served = await asyncio.gather(*(server.generate(probe, params) for server in mine))
        samples = [Sample(probe + g.token_ids, [0] * len(probe) + [1] * len(g.token_ids),
                          [0.0] * (len(probe) + len(g.token_ids))) for g in served]  # fmt: skip
        batch = on_device(collate(samples, self.pad_id), model)
        with torch.no_grad(), world.autocast():
            trained = token_logprobs(model, batch)[0]
        for row, (server, generation) in enumerate(zip(mine, served, strict=True)):
            start, n = len(probe) - 1, len(generation.token_ids)
            theirs = torch.tensor(generation.logprobs, device=trained.device)
            gap = float((trained[row, start : start + n] - theirs).abs().mean()) if n else 0.0
            if gap > self.tol:
                raise EngineError(
                    f"{server.base_url}: after reloading the weights its logprobs differ from "
                    f"the trainer's by {gap:.4f} nats per token (> rollout.reload_check_tol "
                    f"{self.tol}): the server still serves other weights (a stale reload?)"
                )


class ServerSink:
    everywhere = False

    def __init__(self, servers: Sequence[OpenAIEngine], mine: Sequence[OpenAIEngine],
                 path: Path, model: Any, tokenizer: Any, world: World,
                 read_capacity: bool, check: ReloadCheck | None = None) -> None:  # fmt: skip
        """`servers`: all of them (rank 0 reloads every one); `mine`: this rank's; `model`: the
        policy the learner trains (sharded in place by it), saved with the published weights
        and scoring `check`'s probe."""
        self.servers, self.mine, self.path = list(servers), list(mine), path
        self.model, self.tokenizer, self.world = model, tokenizer, world
        self.read_capacity, self.check = read_capacity, check

    async def publish(self, state: dict[str, torch.Tensor], version: int) -> None:
        if self.world.is_main:
            dtype = self.world.compute_dtype
            cast = {name: value.to(dtype) for name, value in state.items()}
            self.model.save_pretrained(self.path, state_dict=cast)
            self.tokenizer.save_pretrained(self.path)
            where = str(self.path.resolve())
            await asyncio.gather(*(server.reload(where) for server in self.servers))
        barrier(self.world)
        if self.read_capacity:  # each server says what it holds
            await asyncio.gather(*(s.refresh_kv() for s in self.mine), return_exceptions=True)
        if self.check is not None:
            await self.check(self.mine, self.model, self.world)
