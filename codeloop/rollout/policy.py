"""A policy: the model and how it is prompted and sampled, saved and loaded one way.

A policy directory (`sft_model/`, a checkpoint's `model/`, `final_model/`) is a transformers model
directory that `from_pretrained` loads, with the tokenizer and, beside them, the prompt format
and the settings the policy was trained with (`PromptFormat.save_pretrained`:
`codeloop.json` and the chat template). `codeloop eval --model`, `codeloop serve`, `codeloop
entropy`, training, the recipes and resuming all load a policy through `Policy.load`; everything
that writes one writes it through `Policy.save` (or `Policy.write`, inside a directory written
whole).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codeloop.config import Config, apply_policy_settings
from codeloop.engine.model import load_pretrained
from codeloop.files import directory_atomic
from codeloop.rollout.prompt import PromptFormat


@dataclass
class Policy:
    """A causal LM (transformers) and its prompt format (which holds the tokenizer)."""

    model: Any
    fmt: PromptFormat

    @property
    def tokenizer(self) -> Any:
        return self.fmt.tokenizer

    @classmethod
    def load(
        cls, directory: str | Path, cfg: Config | None = None, *, dtype: str = "float32"
    ) -> Policy:
        """The policy in `directory` (or a hub name), its weights in `dtype`, prompted as `cfg`
        says (`[rollout]`, with `[eval]` kept to save beside it again); without `cfg`, as the
        policy's own saved settings say (the defaults for a model codeloop did not save)."""
        if cfg is None:
            cfg = Config()
            apply_policy_settings(cfg, directory)
        model, tokenizer = load_pretrained(str(directory), dtype)
        return cls(model, PromptFormat.from_config(tokenizer, cfg.rollout, cfg.eval))

    def write(self, directory: str | Path, *, weights: dict[str, Any] | None = None) -> None:
        """The weights (`weights`: a full state dict gathered from a sharded model, else the
        model's own), the tokenizer and the prompt format into `directory`; a model with LoRA
        adapters writes a LoRA policy (`trainer/lora.py`: the adapters and its base's path)."""
        from codeloop.engine.adapter import write_policy

        if getattr(self.model, "_codeloop_lora", None) is not None:
            write_policy(directory, self.model, self.fmt)
            return
        self.model.save_pretrained(directory, state_dict=weights)
        self.fmt.save_pretrained(directory)

    def save(self, directory: str | Path, *, weights: dict[str, Any] | None = None) -> Path:
        """`write` to `directory`, whole or not at all (a killed run leaves no half-written
        policy)."""
        with directory_atomic(Path(directory)) as partial:
            self.write(partial, weights=weights)
        return Path(directory)
