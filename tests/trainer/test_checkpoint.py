"""Checkpoints: how many are kept, and a resumed process draws the random numbers the saved one
would have drawn next (Python, NumPy, torch)."""

import random
from pathlib import Path

import numpy as np
import torch

from codeloop.engine.model import tiny_model
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


def test_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    model, optimizer, schedule = _state()
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, model, optimizer, schedule, {}, keep=2)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step_000003", "step_000004"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000004"


def test_a_resumed_process_draws_the_numbers_the_saved_one_would_have(tmp_path: Path) -> None:
    model, optimizer, schedule = _state()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    _draws()
    path = save_checkpoint(tmp_path, 7, model, optimizer, schedule, {"data_position": 11}, keep=1)
    expected = [_draws() for _ in range(3)]
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # a fresh process's own state
    step, extra = load_checkpoint(path, *_state())
    assert (step, extra) == (7, {"data_position": 11})
    assert [_draws() for _ in range(3)] == expected


def test_one_reader_for_the_state_of_new_and_older_checkpoints(tmp_path: Path) -> None:
    model, optimizer, schedule = _state()
    optimizer.step()  # no gradients: nothing changes, but the schedule may step after it
    schedule.step()
    path = save_checkpoint(tmp_path, 3, model, optimizer, schedule, {"pending": [7]}, keep=1)
    state = read_state(path)
    assert state["step"] == 3 and state["extra"] == {"pending": [7]}
    assert state["lr_schedule"]["last_epoch"] == 1 and "scheduler" not in state
    older = torch.load(path / "state.pt", weights_only=False)  # as written before the rename
    older["scheduler"] = older.pop("lr_schedule")
    torch.save(older, path / "state.pt")
    assert read_state(path)["lr_schedule"]["last_epoch"] == 1
    fresh_model, fresh_optimizer, fresh_schedule = _state()
    assert load_checkpoint(path, fresh_model, fresh_optimizer, fresh_schedule)[0] == 3
    assert fresh_schedule.last_epoch == 1
