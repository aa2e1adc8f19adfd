"""Policy loading: any causal LM and its tokenizer by path or hub name, or a tiny one for tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(setting: str) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, float32 on CPU."""
    if setting == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[setting]


class ModelError(ValueError):
    """A model that cannot be loaded, with the path or name that failed."""


def load_policy(name_or_path: str, dtype: str = "auto") -> tuple[Any, Any]:
    """(model, tokenizer) from a directory or a hub name, with `from_pretrained`."""
    if not name_or_path:
        raise ModelError("no model given (a directory or a hub name)")
    if name_or_path.startswith(("/", ".", "~")) and not Path(name_or_path).expanduser().is_dir():
        raise ModelError(f"model {name_or_path!r}: no such directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=resolve_dtype(dtype))
    except OSError as err:  # transformers' word for "not found here nor on the hub"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"model {name_or_path!r}: {first}") from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def tiny_model(vocab_size: int, hidden_size: int = 64, layers: int = 2, heads: int = 4,
               max_positions: int = 4096, seed: int = 0) -> Any:  # fmt: skip
    """A randomly initialised Llama-style model, small enough for CPU tests and the demo."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 4,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config)
