"""LoRA RL (`trainer.lora.rank` > 0): adapters trained through peft, the base weights frozen.

`attach` injects peft's LoRA layers into the policy in place (`peft.inject_adapter_in_model`)
and freezes everything else, so the optimiser holds the adapters only. The model keeps its
class and its forward; its adapted layers compute `W x + scaling * B A x`. What leaves the
trainer:
- the in-process engine gets `merged_state`: the plain model's weights, each adapted one
  merged (`engine/adapter.py`), copied in place as full weights are;
- `codeloop serve` gets `adapter_state` (megabytes) with its scaling and the base model's
  fingerprint, and merges it into the base it keeps (`AdapterBase`);
- a checkpoint's `model/` is a LoRA policy (`write_policy`): peft's `adapter_config.json` and
  `adapter_model.safetensors` (`PeftModel.from_pretrained` reads them), the tokenizer and prompt
  format, and `codeloop_lora.json` with the base model's path and fingerprint. Resuming checks
  the fingerprint (`load_adapter`); `codeloop eval --model` and `codeloop serve` load such a
  directory as its base with the adapter merged (`engine/model.load_pretrained`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from codeloop.config import ConfigError, LoraConfig
from codeloop.engine.adapter import (
    ADAPTER,
    BASE,
    SCALING,
    adapted_layers,
    adapter_state,
    fingerprint,
    is_adapter_dir,
    merged,
    read_adapter,
)


@dataclass(frozen=True)
class Attached:
    """What `attach` records on the model: peft's config, the base's fingerprint and path."""

    config: Any
    fingerprint: str
    base: str

    @property
    def scaling(self) -> float:
        return float(self.config.lora_alpha / self.config.r)

    def push_metadata(self) -> dict[str, str]:
        """What a pushed adapter carries for `AdapterBase.merge`."""
        return {SCALING: repr(self.scaling), BASE: self.fingerprint}


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError(
            "trainer.lora needs peft: pip install 'codeloop[lora]' (or pip install peft)"
        ) from None
    return peft


def attached(model: Any) -> Attached | None:
    """What `attach` recorded on `model`; None for a model without adapters."""
    found: Attached | None = getattr(model, "_codeloop_lora", None)
    return found


def attach(model: Any, settings: LoraConfig) -> Any:
    """`model` with LoRA adapters of `settings` injected in place and every other parameter
    frozen (a model that has them already is returned as it is). The adapters start at zero
    (peft zeroes B): the model computes what it did."""
    if attached(model) is not None:
        return model
    peft = _peft()
    base = str(getattr(model, "name_or_path", "") or "")
    if base and Path(base).expanduser().is_dir():
        base = str(Path(base).expanduser().resolve())
    base_print = fingerprint(model.state_dict())
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        target_modules=list(settings.target_modules),
        lora_dropout=settings.dropout,
        base_model_name_or_path=base or None,
    )
    try:
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as err:
        first = str(err).strip().splitlines()[0]
        where = f"trainer.lora.target_modules {settings.target_modules}"
        raise ConfigError(f"{where}: {first}") from None
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".lora_" in name)
    model._codeloop_lora = Attached(config, base_print, base)
    return model


def base_state(model: Any) -> dict[str, torch.Tensor]:
    """The frozen base weights, named as in the plain model."""
    return {
        name.replace(".base_layer.", "."): tensor
        for name, tensor in model.state_dict().items()
        if ".lora_" not in name
    }


@torch.no_grad()
def merged_state(model: Any) -> dict[str, torch.Tensor]:
    """The plain model's weights with the adapters merged (what an engine samples with); a
    model without adapters gives its own state dict."""
    found = attached(model)
    if found is None:
        return dict(model.state_dict())
    state = base_state(model)
    return state | merged(state, adapter_state(model), found.scaling)


def plain_copy(model: Any) -> Any:
    """A copy of `model` without adapters, its weights merged: the model an in-process engine
    samples with (a model without adapters is copied as it is)."""
    copied = copy.deepcopy(model)
    found = attached(model)
    if found is None:
        return copied
    for name in adapted_layers(copied):  # each adapted layer back to the linear layer it wraps
        parent, _, child = name.rpartition(".")
        holder = copied.get_submodule(parent)
        setattr(holder, child, getattr(holder, child).base_layer)
    for extra in ("_codeloop_lora", "peft_config"):
        if extra in vars(copied):
            delattr(copied, extra)
    copied.load_state_dict(merged_state(model))
    return copied


@torch.no_grad()
def load_adapter(model: Any, path: str | Path) -> None:
    """The adapters of the LoRA policy in `path` into `model` (which has adapters of the same
    shapes, attached to the same base: a ConfigError names what differs)."""
    found = attached(model)
    if found is None:
        raise ConfigError(
            f"{path} holds LoRA adapters and this run trains the full weights: resume it with "
            "the trainer.lora it was started with"
        )
    adapter, record = read_adapter(path)
    if record["fingerprint"] != found.fingerprint:
        raise ConfigError(
            f"{path}: its adapters were trained on another base model (fingerprint "
            f"{record['fingerprint']}; trainer.model's is {found.fingerprint})"
        )
    mine = adapter_state(model)
    if set(adapter) != set(mine):
        raise ConfigError(
            f"{path}: its adapters cover other layers than trainer.lora.target_modules "
            f"{list(found.config.target_modules)}"
        )
    for name, tensor in adapter.items():
        if tuple(tensor.shape) != tuple(mine[name].shape):
            raise ConfigError(
                f"{path}: {name} has shape {tuple(tensor.shape)}, this run's "
                f"{tuple(mine[name].shape)} (another trainer.lora.rank?)"
            )
        mine[name].copy_(tensor)


def load_weights(model: Any, path: str | Path, weights: dict[str, Any] | None = None) -> None:
    """A policy's weights into `model`: adapters into a model with adapters, full weights
    (`weights`, read from `path` when not given) into one without; a ConfigError when the
    two kinds are mixed."""
    if is_adapter_dir(path):
        load_adapter(model, path)
        return
    if attached(model) is not None:
        raise ConfigError(
            f"{path} holds full weights and this run trains LoRA adapters: resume it without "
            "trainer.lora, or start a new run directory"
        )
    if weights is None:
        from codeloop.rollout.policy import Policy

        weights = Policy.load(path).model.state_dict()
    model.load_state_dict(weights)
