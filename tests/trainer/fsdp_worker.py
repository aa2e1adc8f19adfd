"""Run under torchrun by test_distributed.py: SFT steps, then RL updates, on fixed data.

With one process nothing is sharded; with several, FSDP2 shards the model and each rank takes
its share of every step. Rank 0 writes the final full weights and the metrics to OUT.
"""

import asyncio
import json
import random
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from codeloop.config import Config, SFTConfig
from codeloop.data.problems import Problem
from codeloop.engine.model import tiny_model
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer import distributed
from codeloop.trainer.batch import Sample
from codeloop.trainer.logs import RunLogger
from codeloop.trainer.rl import build_run
from codeloop.trainer.sft import train_sft


def conversations(fmt: PromptFormat) -> list:
    rng = random.Random(0)
    out = []
    for _ in range(12):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        answer = f"<reason>Add.</reason><answer>\\boxed{{{a + b}}}</answer>"
        out.append([*fmt.messages(f"What is {a} + {b}?"), {"role": "assistant", "content": answer}])
    return out


def rl_samples(vocab: int) -> list[Sample]:
    rng = random.Random(1)
    samples = []
    for _ in range(10):
        length = rng.randint(12, 40)
        prompt = rng.randint(4, 8)
        mask = [0] * prompt + [1 if rng.random() < 0.8 else 0 for _ in range(length - prompt)]
        old = [-rng.uniform(0.5, 4.0) if m else 0.0 for m in mask]
        ids = [rng.randrange(vocab) for _ in range(length)]
        samples.append(Sample(ids, mask, old, rng.uniform(-1.5, 1.5)))
    return samples


def main(tokenizer_dir: str, out: Path) -> None:
    torch.use_deterministic_algorithms(True)
    world = distributed.init()
    fmt = PromptFormat(AutoTokenizer.from_pretrained(tokenizer_dir))
    model = tiny_model(len(fmt.tokenizer), hidden_size=32, layers=2, heads=4, seed=0)
    engine_model = tiny_model(len(fmt.tokenizer), hidden_size=32, layers=2, heads=4, seed=0)
    sharded = distributed.shard(model, world)
    sft = train_sft(
        sharded,
        fmt,
        conversations(fmt),
        SFTConfig(epochs=2, lr=1e-2, warmup_steps=1, conversations_per_step=6),
        world=world,
    )
    cfg = Config()
    cfg.trainer.lr, cfg.trainer.warmup_steps, cfg.trainer.updates_per_step = 1e-2, 0, 2
    cfg.trainer.micro_batch_tokens = 80  # rank 0 gets 3 micro-batches, rank 1 2: padding runs
    cfg.trainer.prompts_per_step, cfg.trainer.recompute_old_logprobs = 2, True
    cfg.reward.workers = 1
    from codeloop.engine.hf_engine import TransformersEngine

    engine = TransformersEngine(engine_model, fmt.tokenizer, fmt.end_of_turn_ids)
    logger = RunLogger(out / f"rl{world.rank}")
    run = build_run(
        cfg,
        sharded,
        fmt,
        [Problem("p", "x", "1")],
        tools=None,
        logger=logger,
        engine=engine,
        world=world,
    )  # type: ignore[arg-type]
    # each optimiser step takes every 2nd sample (updates_per_step = 2); deal pairs to the ranks
    # so that the union of the ranks' mini-batches is the one-process mini-batch
    samples = [
        s
        for j, s in enumerate(rl_samples(len(fmt.tokenizer)))
        if (j // 2) % world.size == world.rank
    ]
    rl = [run.learner.update(samples) for _ in range(2)]
    asyncio.run(run.sync_weights())  # the engine gets the gathered weights
    run.rollout.verifier.close()
    logger.close()
    weights = distributed.full_state_dict(sharded, world)
    if world.is_main:
        engine_weights = engine.model.state_dict()
        same = all(torch.equal(engine_weights[k], v) for k, v in weights.items())
        torch.save(weights, out / "weights.pt")
        (out / "metrics.json").write_text(json.dumps({"sft": sft, "rl": rl, "engine_synced": same}))
    distributed.barrier(world)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
