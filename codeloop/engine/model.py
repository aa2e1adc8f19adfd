"""Policy loading: any causal LM and its tokenizer by path or hub name, or a tiny one for tests."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from codeloop.errors import ModelError


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def require_cuda(what: str, otherwise: str = "") -> None:
    """A ModelError unless torch can use a GPU, which `what` (an option) needs; `otherwise`
    says what to do without one."""
    if torch.cuda.is_available():
        return
    build = (
        "a CPU build"
        if torch.version.cuda is None
        else f"a CUDA {torch.version.cuda} build that finds no GPU"
    )
    raise ModelError(
        f"{what} needs a GPU, and torch {torch.__version__} is {build}: install a "
        f"CUDA build of torch (docs/installation.md){otherwise}"
    )


BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86's AVX512-BF16 and AMX-BF16, Arm's BF16


@functools.cache
def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU has bfloat16 matrix instructions (`BF16_FLAGS` among the flags Linux
    lists). Without them torch computes a bfloat16 matmul through float32 and conversions: 8x
    slower than float32 itself on an AVX2 EPYC (a 2048 x 640 x 2048 product, one thread)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:  # not Linux
        return False
    flags = re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.MULTILINE)
    return flags is not None and bool(BF16_FLAGS & set(flags.group(1).split()))


def resolve_dtype(setting: str) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, float32 on CPU; `native`: bfloat16 on CUDA and on a CPU with
    bfloat16 instructions (`cpu_has_bf16`), else float32."""
    if setting in ("auto", "native"):
        fast = torch.cuda.is_available() or (setting == "native" and cpu_has_bf16())
        return torch.bfloat16 if fast else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[setting]


TURN_ENDS = ("<|im_end|>", "<end_of_turn>")  # ChatML (Qwen, SmolLM2); Gemma


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """Tokens that end an assistant turn: the EOS token and the turn ends of the chat markups
    the vocabulary has (`TURN_ENDS`)."""
    ids = {tokenizer.eos_token_id} - {None}
    for name in TURN_ENDS:
        end = tokenizer.convert_tokens_to_ids(name)
        if isinstance(end, int) and end != tokenizer.unk_token_id:
            ids.add(end)
    return ids


MODEL_FILES = ("config.json", "adapter_config.json")  # a model, or a LoRA policy on a base
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_source(name_or_path: str, what: str = "model") -> None:
    """A clear ModelError for a missing directory or one that holds no model."""
    if not name_or_path:
        raise ModelError(f"no {what} given (a directory or a hub name)")
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if what == "model" and not any((path / f).is_file() for f in MODEL_FILES):
            raise ModelError(
                f"{what} {name_or_path!r}: no model there (no config.json) and no LoRA policy "
                "(no adapter_config.json)"
            )
        if what == "tokenizer" and not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ModelError(
                f"{what} {name_or_path!r}: no tokenizer there (none of "
                f"{', '.join(TOKENIZER_FILES)})"
            )
    elif name_or_path.startswith(("/", ".", "~")) or path.exists():
        raise ModelError(f"{what} {name_or_path!r}: no such directory")


def not_found(name_or_path: str, what: str, err: Exception) -> ModelError:
    """transformers' OSError as a ModelError: a directory it could not read, or a name that is
    neither a directory nor loadable from the hub."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    first = f"{type(err).__name__}: {first}" if not isinstance(err, OSError) else first
    if Path(name_or_path).expanduser().is_dir():
        return ModelError(f"{what} {name_or_path!r}: {first}")
    return ModelError(
        f"{what} {name_or_path!r}: not a directory here, and not loadable as a hub name ({first})"
    )


def load_tokenizer(name_or_path: str) -> Any:
    """The tokenizer of a model directory or hub name (pad token = eos when it has none)."""
    check_source(name_or_path, "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except Exception as err:  # noqa: BLE001 - missing (OSError) or unreadable files: many types
        raise not_found(name_or_path, "tokenizer", err) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_pretrained(name_or_path: str, dtype: str = "auto") -> tuple[Any, Any]:
    """(model, tokenizer) from a directory or a hub name, with `from_pretrained` (a policy with
    its prompt format: `rollout.policy.Policy.load`). A LoRA policy (`engine/adapter.py`)
    loads as its base model with the adapter merged (the base checked by its fingerprint)."""
    from codeloop.engine.adapter import is_adapter_dir, merge_into, read_adapter

    check_source(name_or_path)
    tokenizer = load_tokenizer(name_or_path)
    if is_adapter_dir(name_or_path):
        base = read_adapter(name_or_path)[1]["base"]
        if not base:
            raise ModelError(f"LoRA policy {name_or_path!r}: it does not name its base model")
        try:
            model, _ = load_pretrained(base, dtype)
        except ModelError as err:
            raise ModelError(f"LoRA policy {name_or_path!r}: its base model: {err}") from None
        merge_into(model, name_or_path)
        return model, tokenizer
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=resolve_dtype(dtype))
    except Exception as err:  # noqa: BLE001 - missing (OSError) or unreadable files: many types
        raise not_found(name_or_path, "model", err) from err
    return model, tokenizer


def tiny_model(
    vocab_size: int,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    *,
    max_positions: int = 4096,
    seed: int = 0,
) -> Any:
    """A randomly initialised Llama-style model, small enough for CPU tests and the demo."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config)
