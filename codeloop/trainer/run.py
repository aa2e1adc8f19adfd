"""The entry points behind `codeloop sft` and `codeloop train`: config in, run directory out."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from codeloop.config import Config, ConfigError
from codeloop.data.curate import curate
from codeloop.data.problems import Problem, load_problems
from codeloop.rollout.policy import Policy
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer import distributed
from codeloop.trainer.logs import RunLogger
from codeloop.trainer.rl import opened_run
from codeloop.trainer.sft import load_conversations, train_sft


def run_sft(cfg: Config) -> Path:
    """Train `trainer.model` on `sft.data`; save the result to `<output_dir>/sft_model`."""
    if cfg.trainer.lora.rank:
        raise ConfigError(
            "trainer.lora is for RL: codeloop sft trains the full weights (set "
            "trainer.lora.rank = 0 for it, and use the SFT policy as trainer.model of the RL run)"
        )
    world = distributed.init(cfg.trainer.dtype)  # torchrun: FSDP2 over the ranks; else one
    named = load_conversations(cfg.sft.data)
    policy = Policy.load(cfg.trainer.model, cfg)  # trained in float32
    model, fmt = distributed.shard(policy.model, world), policy.fmt
    logger = RunLogger.for_run(cfg, cfg.trainer.output_dir) if world.is_main else None
    try:
        train_sft(
            model,
            fmt,
            [c for _, c in named],
            cfg.sft,
            logger=logger,
            seed=cfg.trainer.seed,
            grad_clip=cfg.trainer.grad_clip,
            world=world,
            sources=[where for where, _ in named],
        )
    finally:
        if logger is not None:
            logger.close()
    out = Path(cfg.trainer.output_dir) / "sft_model"
    weights = distributed.full_state_dict(model, world, everywhere=False)
    if world.is_main:  # the tokenizer, the prompt format and the eval settings beside it
        Policy(model, fmt).save(out, weights=weights)
    distributed.barrier(world)
    return out


def prepare(cfg: Config) -> tuple[Any, PromptFormat, list[Problem]]:
    """The policy, its prompt format and the training problems the config names."""
    problems = load_problems(cfg.data.train, cfg.data)
    benchmarks = [b for path in cfg.data.decontaminate for b in load_problems(path, cfg.data)]
    kept, removed = curate(
        problems,
        cfg.data.integer_answers_only and bool(cfg.data.answer_field),
        False,
        benchmarks,
        n=cfg.data.ngram,
    )
    reasons = Counter(r.reason for r in removed)
    if distributed.launched_main():
        why = ", ".join(f"{n} {reason}" for reason, n in reasons.items())
        print(
            f"data: kept {len(kept)} of {len(problems)} problems"
            + (f" (removed: {why})" * bool(why))
        )
    problems = kept
    policy = Policy.load(cfg.trainer.model, cfg)  # trained in float32
    return policy.model, policy.fmt, problems


async def run_rl(cfg: Config) -> list[dict[str, float]]:
    """GRPO-RoC on `data.train` for `trainer.max_steps`, resuming from the run directory."""
    world = distributed.init(cfg.trainer.dtype)  # torchrun: FSDP2 over the ranks; else one
    model, fmt, problems = prepare(cfg)
    async with (
        tools_for(cfg) as tools,
        opened_run(
            cfg, model, fmt, problems, tools=tools, run_dir=cfg.trainer.output_dir, world=world
        ) as run,
    ):
        if run.resume():
            print(f"resumed from step {run.step_index}")
        return await run.train(max(cfg.trainer.max_steps - run.step_index, 0), "rl")


def tools_for(cfg: Config) -> Any:
    """The sandbox servers in `sandbox.urls`, or a sandbox in this process."""
    if cfg.sandbox.urls:
        from codeloop.sandbox.client import SandboxClient

        return SandboxClient(cfg.sandbox.urls, cfg.sandbox)
    from codeloop.sandbox.pool import LocalSandbox

    return LocalSandbox(cfg.sandbox)
