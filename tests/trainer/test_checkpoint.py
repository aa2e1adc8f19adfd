"""Checkpoints: how many are kept, a resumed process draws the random numbers the saved one
would have drawn next (Python, NumPy, torch), and the policy in one loads on its own."""

import random
from pathlib import Path

import numpy as np
import torch

from codeloop.engine.model import tiny_model
from codeloop.rollout.policy import Policy
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    read_state,
    save_checkpoint,
)


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = tiny_model(16, hidden_size=16, layers=1, heads=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def _save(
    run_dir: Path, step: int, state: tuple, fmt: PromptFormat, extra: dict | None = None
) -> Path:
    model, optimizer, schedule = state
    return save_checkpoint(
        run_dir,
        step,
        Policy(model, fmt),
        optimizer=optimizer,
        lr_schedule=schedule,
        extra=extra or {},
        keep=2,
    )


def test_the_newest_checkpoints_are_kept(tmp_path: Path, trainer_fmt: PromptFormat) -> None:
    state = _state()
    for step in range(1, 5):
        _save(tmp_path, step, state, trainer_fmt)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step_000003", "step_000004"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000004"


def test_a_resumed_process_draws_the_numbers_the_saved_one_would_have(
    tmp_path: Path, trainer_fmt: PromptFormat
) -> None:
    state = _state()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    _draws()
    path = _save(tmp_path, 7, state, trainer_fmt, {"data_position": 11})
    expected = [_draws() for _ in range(3)]
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # a fresh process's own state
    step, extra = load_checkpoint(path, *_state())
    assert (step, extra) == (7, {"data_position": 11})
    assert [_draws() for _ in range(3)] == expected


def test_the_state_and_the_policy_come_back(tmp_path: Path, trainer_fmt: PromptFormat) -> None:
    model, optimizer, schedule = _state()
    optimizer.step()  # no gradients: nothing changes, but the schedule may step after it
    schedule.step()
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # weights of its own, not a fresh model's
    path = _save(tmp_path, 3, (model, optimizer, schedule), trainer_fmt, {"pending": [7]})
    state = read_state(path)
    assert state["step"] == 3 and state["extra"] == {"pending": [7]}
    assert state["lr_schedule"]["last_epoch"] == 1
    fresh_model, fresh_optimizer, fresh_schedule = _state()
    assert load_checkpoint(path, fresh_model, fresh_optimizer, fresh_schedule)[0] == 3
    assert fresh_schedule.last_epoch == 1
    for mine, back in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(mine, back)
    policy = Policy.load(path / "model")  # prompted as it was trained, without a config
    problem = "What is 2 + 2?"
    assert policy.fmt.prompt_ids(problem) == trainer_fmt.prompt_ids(problem)
