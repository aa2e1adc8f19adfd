"""The one protocol every inference backend implements, and its value types.

`generate(prompt_ids, params)` continues a token sequence and returns the sampled tokens with
the engine's logprob of each, and why it stopped: `stop` (a stop string or an end-of-turn
token, which is included in the output) or `length` (`max_tokens` reached). Engines are async
so that one trajectory waiting on its tool call never holds the others back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from codeloop.errors import CodeloopError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # one per token, of the distribution it was sampled from
    finish_reason: Literal["stop", "length"]
    # the policy version that sampled each token, where the engine knows it (see async_rl.py)
    versions: list[int] | None = None


class EngineUnavailable(CodeloopError, RuntimeError):
    """An engine that cannot serve now (a server down, cut off, or holding other weights): the
    scheduler sends the request again, to another engine or later, and raises it when no engine
    could serve for `rollout.server_retry_s` (the message names the servers' faults)."""


class ContextExceeded(CodeloopError, RuntimeError):
    """The prompt does not fit the engine's context (a server's `max_model_len`): the
    trajectory has run out of room, as when its token budget runs out."""


class Engine(Protocol):
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...


# What an engine may declare beyond `generate`, checked with isinstance where it is used:


@runtime_checkable
class Batched(Protocol):
    """Decodes at most `max_batch` requests together (the in-process engine): `collect` runs
    twice as many trajectories at once on it (the other half waits on tools or queues)."""

    @property
    def max_batch(self) -> int: ...


@runtime_checkable
class KVReporting(Protocol):
    """Knows its KV cache in tokens: what it admits, and what is in use (None until known). The
    kv_aware scheduler places calls by them (`engine/scheduler.py`)."""

    @property
    def kv_capacity_tokens(self) -> int: ...

    @property
    def kv_tokens_used(self) -> int | None: ...


@runtime_checkable
class KVPolled(Protocol):
    """Its KV use changes on its own and is read on demand (a server's /metrics)."""

    async def refresh_kv(self) -> None: ...


@runtime_checkable
class WeightUpdatable(Protocol):
    """Takes trained weights in place (`trainer/weights.py`'s `EngineSink`)."""

    def update_weights(self, state_dict: Mapping[str, Any], version: int | None = None) -> None: ...
