"""The rollout side of an RL run, built from the config in one place: `build_rollout`.

What samples and scores trajectories for the trainer: this rank's engines (the in-process
engine, a copy of the policy in the compute dtype, or its share of the OpenAI-compatible servers
in `rollout.endpoints`), the tools, the prompt format, the verifier, and the `WeightSink` that
publishes the trained weights to the engines (with the servers' reload check inside). The RL loop
receives it; `agent` makes the `Agent` a rollout runs through.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from codeloop.config import Config, ConfigError, RolloutConfig
from codeloop.engine.hf_engine import EngineStats, TransformersEngine, engine_from_config
from codeloop.engine.openai_engine import OpenAIEngine, servers
from codeloop.engine.protocol import Engine
from codeloop.engine.scheduler import Scheduler
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.tools import ToolExecutor
from codeloop.trainer import lora
from codeloop.trainer.distributed import World
from codeloop.trainer.weights import EngineSink, ReloadCheck, ServerSink, WeightSink

T = TypeVar("T")


@dataclass
class RolloutSide:
    cfg: Config
    engines: list[Engine]  # this rank's
    kv_sharing: int  # how many ranks share each of them
    tools: ToolExecutor
    fmt: PromptFormat
    verifier: Verifier
    sink: WeightSink
    servers: list[OpenAIEngine]  # all of them (closed at the end)

    def agent(
        self,
        batch_size: int = 0,
        engines: Sequence[Engine] | None = None,
        rollout: RolloutConfig | None = None,
    ) -> Agent:
        """An agent over a scheduler of this rank's engines (or `engines` standing in front of
        them) with its share of each server's KV capacity; `batch_size`: trajectories per
        batch (the static scheduler deals them out by it); `rollout`: settings other than the
        run's (an evaluation's)."""
        scheduler = Scheduler.for_rollout(
            list(engines or self.engines), self.cfg.rollout, batch_size, self.kv_sharing
        )
        return Agent(scheduler, self.tools, self.fmt, rollout or self.cfg.rollout)

    def engine_stats(self) -> EngineStats | None:
        """The in-process engines' counters together; None on servers."""
        local = [e.stats() for e in self.engines if isinstance(e, TransformersEngine)]
        return sum(local, EngineStats()) if local else None

    async def close(self) -> None:
        """Close the verifier's workers, the weight sink and the servers' HTTP sessions."""
        self.verifier.close()
        await self.sink.close()
        await asyncio.gather(*(server.close() for server in self.servers))


def build_rollout(
    cfg: Config,
    model: Any,
    fmt: PromptFormat,
    tools: ToolExecutor,
    *,
    world: World,
    run_dir: str | Path,
    probe: list[int],
    engine: TransformersEngine | None = None,
) -> RolloutSide:
    """The rollout side `cfg` names. `model`: the policy before the learner shards it (the
    in-process engine samples with a copy of it); `probe`: the prompt a server's reload is
    checked on; `engine`: an in-process engine to use instead of a new one."""
    r = cfg.rollout
    every = _servers(cfg)
    mine, sharing = rank_share(every, world)
    sink: WeightSink
    if every:
        check = ReloadCheck(probe, r.reload_check_tol, fmt.tokenizer.pad_token_id or 0)
        sink = ServerSink(
            every,
            mine,
            Path(r.weights_dir or Path(run_dir) / "weights"),
            model,
            tokenizer=fmt.tokenizer,
            world=world,
            read_capacity=not r.kv_capacity_tokens,
            check=check if r.reload_check_tol else None,
        )
        engines: list[Engine] = list(mine)
    else:
        local = engine or local_engine(cfg, model, fmt, world)
        sink, engines = EngineSink(local), [local]
    return RolloutSide(cfg, engines, sharing, tools, fmt, Verifier(cfg.reward), sink, every)


def local_engine(cfg: Config, model: Any, fmt: PromptFormat, world: World) -> TransformersEngine:
    """The in-process engine `cfg.rollout` describes, sampling with a copy of `model` in the
    compute dtype on this rank's device; its KV slots are planned for the response budget now
    (one that cannot fit is refused here, before any step)."""
    copied = lora.plain_copy(model).to(world.device, world.compute_dtype)  # adapters merged
    longest = max(cfg.rollout.max_response_tokens, cfg.eval.max_response_tokens)
    return engine_from_config(copied, fmt.tokenizer, cfg.rollout, longest_response=longest)


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
    if r.server == "vllm" and r.top_p < 1:
        # vLLM's processed logprobs (docs/deployment.md) are renormalised over the nucleus, the
        # trainer's are not: every importance ratio of such a run would be off
        raise ConfigError(
            f"rollout.top_p = {r.top_p:g} with rollout.server = 'vllm': vLLM's logprobs of a "
            "nucleus-sampled token are renormalised over the nucleus and the trainer's are not; "
            "train with rollout.top_p = 1 (evaluations may use eval.top_p)"
        )
    return servers(r.endpoints, r, r.served_model or cfg.trainer.model)
