"""Checkpoints for exact resume: model, optimiser, LR schedule, RNG states, data position, step.

`checkpoints/step_NNNNNN/` holds `model/` (the policy: `rollout/policy.py`, a transformers
directory with its tokenizer and prompt format that `codeloop eval --model`, `codeloop serve`
and `from_pretrained` load) and `state.pt` (everything else). A checkpoint is written to a
scratch directory and renamed (`files.directory_atomic`), so a killed run never leaves a
half-written one; the oldest beyond `keep` are removed.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from codeloop.files import directory_atomic
from codeloop.rollout.policy import Policy
from codeloop.trainer.lora import load_weights

STATE = "state.pt"  # beside model/ in a checkpoint: written by save_checkpoint, read by read_state


def _rng_state() -> dict[str, Any]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    policy: Policy,
    *,
    optimizer: Any,
    lr_schedule: Any,
    extra: dict[str, Any],
    keep: int,
    weights: dict[str, Any] | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> Path:
    """Step `step`'s checkpoint: the policy in `model/` (`Policy.write`), the rest in `state.pt`;
    the newest `keep` are kept. `weights`/`optimizer_state`: the full (unsharded) states an FSDP
    run gathered."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    with directory_atomic(final) as partial:
        policy.write(partial / "model", weights=weights)
        state = {
            "step": step,
            "optimizer": optimizer_state or optimizer.state_dict(),
            "lr_schedule": lr_schedule.state_dict(),
            "rng": _rng_state(),
            "extra": extra,
        }
        torch.save(state, partial / STATE)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old)
    return final


def read_state(path: str | Path) -> dict[str, Any]:
    """A checkpoint's `state.pt`: `step`, `optimizer`, `lr_schedule`, `rng`, `extra`."""
    state: dict[str, Any] = torch.load(Path(path) / STATE, map_location="cpu", weights_only=False)
    return state


def read_weights(path: str | Path) -> dict[str, Any]:
    """A checkpoint's policy weights (float32), as a full state dict."""
    state: dict[str, Any] = Policy.load(Path(path) / "model").model.state_dict()
    return state


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = sorted((Path(run_dir) / "checkpoints").glob("step_*"))
    return found[-1] if found else None


def load_checkpoint(
    path: str | Path, model: Any, optimizer: Any, scheduler: Any, *, sharded: bool = False
) -> tuple[int, dict[str, Any]]:
    """Restore everything into the given objects; return (step, extra). `sharded`: the model
    and optimiser are FSDP2's and take the full states through `torch.distributed.checkpoint`."""
    state = read_state(path)
    if sharded:
        weights = read_weights(path)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, weights, options=full)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=full)
    else:
        load_weights(model, Path(path) / "model")  # full weights, or LoRA adapters
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["lr_schedule"])
    _set_rng_state(state["rng"])
    return int(state["step"]), dict(state["extra"])
