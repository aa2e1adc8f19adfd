"""The one protocol every inference backend implements, and its value types.

`generate(prompt_ids, params)` continues a token sequence and returns the sampled tokens with
the engine's logprob of each, and why it stopped: `stop` (a stop string or an end-of-turn
token, which is included in the output) or `length` (`max_tokens` reached). Engines are async
so that one trajectory waiting on its tool call never holds the others back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from codeloop.types import ExecRequest, ExecResult


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


class Engine(Protocol):
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...


class ToolExecutor(Protocol):
    """What runs tool calls: `SandboxClient`, or a `WorkerPool` in the same process."""

    async def execute(self, request: ExecRequest) -> ExecResult: ...
