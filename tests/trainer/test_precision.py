"""Training in bfloat16 keeps float32 parameters: at the report's lr of 1e-6 an AdamW step is
below bfloat16's resolution, so parameters held in bfloat16 would not move at all."""

import copy
import random
from pathlib import Path
from typing import Any

import torch

from codeloop.config import Config
from codeloop.data.problems import Problem
from codeloop.engine.model import tiny_model
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer.batch import Sample
from codeloop.trainer.distributed import World
from codeloop.trainer.logs import RunLogger
from codeloop.trainer.rl import build_run


def _samples(vocab: int) -> list[Sample]:
    rng = random.Random(0)
    out = []
    for advantage in (1.0, -1.0, 0.5, -0.5):
        ids = [rng.randrange(vocab) for _ in range(40)]
        mask = [0] * 8 + [1] * 32
        out.append(Sample(ids, mask, [-2.0 if m else 0.0 for m in mask], advantage))
    return out


def _moved_share(model: Any, world: World, fmt: PromptFormat, tmp_path: Path) -> float:
    cfg = Config()
    cfg.trainer.output_dir, cfg.trainer.warmup_steps = str(tmp_path), 0  # lr: the report's 1e-6
    before = copy.deepcopy(model.state_dict())
    logger = RunLogger(tmp_path)
    run = build_run(
        cfg,
        model,
        fmt,
        [Problem("p", "1+1", "2")],
        tools=None,
        logger=logger,  # type: ignore[arg-type]
        world=world,
    )
    run.learner.update(_samples(len(fmt.tokenizer)))
    logger.close()
    run.rollout.verifier.close()
    after = run.learner.model.state_dict()
    if world.compute_dtype == torch.bfloat16:
        assert (
            next(run.rollout.engines[0].model.parameters()).dtype == torch.bfloat16
        )  # rollout in bf16
    moved = sum(int((after[k] != v).sum()) for k, v in before.items())
    return moved / sum(v.numel() for v in before.values())  # share of the weights a step moved


def test_bf16_compute_keeps_float32_parameters_that_small_steps_move(
    trainer_fmt: PromptFormat, tmp_path: Path
) -> None:
    model = tiny_model(len(trainer_fmt.tokenizer), hidden_size=64, layers=2)
    held_in_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    mixed = _moved_share(model, World(compute_dtype=torch.bfloat16), trainer_fmt, tmp_path / "a")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert mixed > 0.9  # the weights took the 1e-6 step
    # the same step on parameters held in bfloat16 is lost to rounding
    assert _moved_share(held_in_bf16, World(), trainer_fmt, tmp_path / "b") < 0.1
