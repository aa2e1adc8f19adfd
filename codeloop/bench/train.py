"""`codeloop bench train`: training throughput, peak memory, and where an RL step's time goes.

1. Update throughput: the RL update (`Learner.update`: micro-batches under a token budget,
   clipped loss, AdamW) on random sequences of a tiny random model, against a baseline measured
   in the same run: one plain forward/backward/step of cross-entropy over the same padded batch.
   The ratio is the trainer's overhead (or gain) over the bare model.
2. Peak memory: the process's peak resident set (and CUDA's peak allocation on a GPU).
   Also the SFT step (`sft_step`) over the same sequences, packed end to end against padded.
3. One RL step end to end (rollout through the agent loop with the local sandbox, reward,
   update, weight sync) split by the step's own timers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from codeloop.config import Config
from codeloop.data.problems import Problem
from codeloop.data.tokenizer import train_tokenizer
from codeloop.engine.model import tiny_model
from codeloop.helpformat import HelpFormatter, positive_count
from codeloop.rollout.prompt import PromptFormat
from codeloop.sandbox.pool import LocalSandbox
from codeloop.trainer.batch import Sample, collate, on_device
from codeloop.trainer.distributed import World, one_process
from codeloop.trainer.logs import RunLogger
from codeloop.trainer.rl import build_run


def _samples(count: int, length: int, vocab: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(length // 2, length)
        mask = [0] * 16 + [1] * (n - 16)
        out.append(
            Sample(
                [rng.randrange(vocab) for _ in range(n)],
                mask,
                [-1.0 if m else 0.0 for m in mask],
                rng.uniform(-1, 1),
            )
        )
    return out


def _baseline(model: Any, samples: list[Sample], steps: int, world: World) -> float:
    """Seconds per step of plain cross-entropy on one padded batch of all samples."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch = on_device(collate(samples, 0), model)
    start = time.perf_counter()
    for i in range(WARMUP_STEPS + steps):
        if i == WARMUP_STEPS:
            _sync()
            start = time.perf_counter()
        with world.autocast():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = logits.logits
        loss = (
            torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(),
                batch["input_ids"][:, 1:].flatten(),
                reduction="none",
            )
            @ batch["loss_mask"].flatten().float()
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _sync()
    return (time.perf_counter() - start) / steps


# Untimed steps before each timer starts: the first on a GPU loads kernels and sets up cuBLAS
# (the first GPU run's baseline paid it: the trainer's update seemed 2.74x faster than it).
WARMUP_STEPS = 1


def _sync() -> None:
    """Wait for queued GPU work, so that a timer measures it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sft(
    model: Any, samples: list[Sample], steps: int, budget: int, *, packing: str, world: World
) -> float:
    """Seconds per SFT step (forward, backward, AdamW) over the samples."""
    from codeloop.trainer.sft import sft_step

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    start = time.perf_counter()
    for i in range(WARMUP_STEPS + steps):
        if i == WARMUP_STEPS:
            _sync()
            start = time.perf_counter()
        sft_step(model, samples, 0, budget, world=world, packing=packing)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _sync()
    return (time.perf_counter() - start) / steps


def _fmt() -> PromptFormat:
    corpus = ["What is 12 + 34? print(12 + 34) <answer>\\boxed{46}</answer>"] * 50
    return PromptFormat(train_tokenizer(corpus, vocab_size=400))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="codeloop bench train",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--hidden", type=positive_count, default=256, help="model width")
    parser.add_argument("--layers", type=positive_count, default=4, help="model layers")
    parser.add_argument("--sequences", type=positive_count, default=32, help="sequences per update")
    parser.add_argument(
        "--length", type=positive_count, default=512, help="longest sequence, tokens"
    )
    parser.add_argument(
        "--micro-batch-tokens", type=positive_count, default=8192, help="tokens per micro-batch"
    )
    parser.add_argument(
        "--steps", type=positive_count, default=3, help="timed steps per measurement"
    )
    parser.add_argument("--out", default="bench-results/train.json", help="JSON report")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    world = one_process("auto")  # GPU: bf16
    fmt = _fmt()
    vocab = len(fmt.tokenizer)
    samples = _samples(args.sequences, args.length, vocab, 0)
    tokens = sum(len(s.input_ids) for s in samples)
    cfg = Config()
    cfg.trainer.micro_batch_tokens, cfg.trainer.warmup_steps = args.micro_batch_tokens, 0
    cfg.reward.workers, cfg.sandbox.workers = 1, 1
    cfg.trainer.prompts_per_step, cfg.algo.group_size, cfg.algo.oversample = 2, 2, 2
    cfg.rollout.max_response_tokens, cfg.rollout.max_turns = 64, 2

    def model() -> Any:
        policy = tiny_model(vocab, hidden_size=args.hidden, layers=args.layers, heads=8)
        return policy.to(world.device)

    base_s = _baseline(model(), samples, args.steps, world)
    sft_s = {
        packing: _sft(
            model(), samples, args.steps, args.micro_batch_tokens, packing=packing, world=world
        )
        for packing in ("off", "on")
    }
    with tempfile.TemporaryDirectory() as tmp:
        problems = [Problem(f"q{i}", f"What is {i} + {i}?", str(2 * i)) for i in range(4)]
        split = asyncio.run(
            _rl(
                cfg,
                model(),
                fmt,
                problems,
                samples=samples,
                steps=args.steps,
                run_dir=tmp,
                world=world,
            )
        )
    update_s = split.pop("update_only_s")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"model: {args.layers} layers x {args.hidden} wide on {world.device} "
        f"({str(world.compute_dtype).removeprefix('torch.')}); {args.sequences} "
        f"sequences, {tokens} tokens per update"
    )
    print(f"{'':28}{'s/update':>10}{'tokens/s':>10}{'vs plain':>10}")
    print(f"{'plain forward/backward':28}{base_s:10.3f}{tokens / base_s:10.0f}{1.0:10.2f}")
    print(
        f"{'RL update (trainer)':28}{update_s:10.3f}{tokens / update_s:10.0f}"
        f"{base_s / update_s:10.2f}"
    )
    for packing, name in (("off", "SFT step, padded"), ("on", "SFT step, packed")):
        print(
            f"{name:28}{sft_s[packing]:10.3f}{tokens / sft_s[packing]:10.0f}"
            f"{base_s / sft_s[packing]:10.2f}"
        )
    print(f"peak resident memory: {peak_mb:.0f} MiB", end="")
    if torch.cuda.is_available():
        print(f"; CUDA peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB", end="")
    total = sum(split.values())
    print(
        f"\nRL step ({total:.2f} s): "
        + ", ".join(f"{k} {v:.2f} s ({100 * v / total:.0f}%)" for k, v in split.items())
    )
    seconds = {
        "plain": base_s,
        "rl_update": update_s,
        "sft_padded": sft_s["off"],
        "sft_packed": sft_s["on"],
    }
    report = {
        "arguments": vars(args),
        "device": str(world.device),
        "tokens_per_update": tokens,
        "seconds_per_update": seconds,
        "peak_rss_mib": peak_mb,
        "rl_step_s": split,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


async def _rl(
    cfg: Config,
    model: Any,
    fmt: PromptFormat,
    problems: list[Problem],
    *,
    samples: list[Sample],
    steps: int,
    run_dir: str,
    world: World,
) -> dict[str, float]:
    cfg.trainer.output_dir = run_dir
    async with LocalSandbox(cfg.sandbox) as tools:
        logger = RunLogger(run_dir)
        run = build_run(cfg, model, fmt, problems, tools=tools, logger=logger, world=world)
        try:
            start = time.perf_counter()
            for _ in range(steps):
                run.learner.update(samples)
            _sync()
            update_only = (time.perf_counter() - start) / steps
            (metrics,) = await run.train(1)
        finally:
            await run.close()
            logger.close()
    return {
        "update_only_s": update_only,
        "rollout+reward": metrics["timing/rollout_and_reward_s"],
        "update": metrics["timing/update_s"],
        "weight sync": metrics["timing/sync_s"],
    }
