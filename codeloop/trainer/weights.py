"""Where new weights go after an update: a `WeightSink`.

- `EngineSink`: the in-process engine of each rank copies the gathered weights in place
  (`TransformersEngine.update_weights`); every rank needs the full weights.
- `ServerSink`: OpenAI-compatible servers (`codeloop serve`, vLLM, SGLang). Rank 0 saves the
  weights (model and tokenizer, in the compute dtype: half the bytes in bfloat16) to a
  directory and asks every server to reload it (`OpenAIEngine.reload`); then, when
  `rollout.kv_capacity_tokens` is unset, each rank reads its servers' KV capacity.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from codeloop.rollout.openai_engine import OpenAIEngine
from codeloop.trainer.distributed import World, barrier


class WeightSink(Protocol):
    everywhere: bool  # every rank needs the full weights (else rank 0 alone)

    async def publish(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Make the rollout sample with `state` (empty on ranks that do not need it), policy
        version `version` (the RL step that produced it)."""
        ...


class EngineSink:
    everywhere = True

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def publish(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.engine.update_weights(state, version)


class ServerSink:
    everywhere = False

    def __init__(self, servers: Sequence[OpenAIEngine], mine: Sequence[OpenAIEngine],
                 path: Path, model: Any, tokenizer: Any, world: World,
                 read_capacity: bool) -> None:  # fmt: skip
        """`servers`: all of them (rank 0 reloads every one); `mine`: this rank's."""
        self.servers, self.mine, self.path = list(servers), list(mine), path
        self.model, self.tokenizer, self.world = model, tokenizer, world
        self.read_capacity = read_capacity

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
