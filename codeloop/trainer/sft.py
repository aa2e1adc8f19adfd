"""Non-reasoning SFT on multi-turn tool-use conversations (the report's stage 0).

Data: JSONL, one `{"messages": [...]}` per line, roles `system`, `user`, `assistant`, `tool`,
string contents; an assistant turn that calls the tool ends with its `</tool_call>`. Each
conversation is rendered with the rollout's chat template, and the loss covers only the
assistant's own tokens: what the policy will sample at RL time (a tool-calling turn up to its
`</tool_call>`, a final turn up to its end-of-turn token). Batches: conversations per optimiser
step, split into micro-batches under a token budget with gradient accumulation (packed end to
end or padded, `sft.packing`); the loss is the mean over the step's assistant tokens.
Schedule: linear warm-up, then cosine decay.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from codeloop.config import SFTConfig
from codeloop.errors import CodeloopError, read_text_input
from codeloop.memory import trim_when_above
from codeloop.progress import progress_bar
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.toolcall import CALL_CLOSE
from codeloop.trainer.batch import (
    Sample,
    budget_tokens,
    collate,
    collate_packed,
    micro_batches,
    on_device,
    pack,
    token_logprobs,
)
from codeloop.trainer.distributed import World, all_sum, pad_micro_batches
from codeloop.trainer.logs import RunLogger

ROLES = {"system", "user", "assistant", "tool"}
Conversation = list[dict[str, str]]


class SFTDataError(CodeloopError, ValueError):
    pass


def load_conversations(path: str) -> list[tuple[str, Conversation]]:
    """(`file:line`, conversation) from a JSONL file; errors name the file and line."""
    conversations = []
    for number, line in enumerate(read_text_input(path, "sft.data").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise SFTDataError(f"{where}: not JSON ({err.msg})") from err
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages:
            raise SFTDataError(f'{where}: expected {{"messages": [...]}} with at least one message')
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise SFTDataError(f"{where}: message {i}: role must be one of {sorted(ROLES)}")
            if not isinstance(message.get("content"), str):
                raise SFTDataError(f"{where}: message {i}: content must be a string")
        if not any(m["role"] == "assistant" for m in messages):
            raise SFTDataError(f"{where}: no assistant message to train on")
        conversations.append((where, messages))
    return conversations


def encode_conversation(fmt: PromptFormat, messages: Conversation) -> Sample:
    """Token ids with loss mask 1 on the assistant's own tokens (see the module docstring)."""
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = fmt.render(messages[:i], add_generation_prompt=True)
        after = fmt.render(messages[: i + 1], add_generation_prompt=False)
        if not before.startswith(rendered) or not after.startswith(before):
            opening = before[len(rendered) :][-40:]
            raise SFTDataError(
                f"message {i}: not rendered as a continuation of the turns before "
                f"it; the template opens the turn with {opening!r}"
            )
        turn = _trim(after[len(before) :], message["content"], fmt)
        for text, trained in ((before[len(rendered) :], 0), (turn, 1)):
            piece = fmt.encode(text)
            ids += piece
            mask += [trained] * len(piece)
        rendered = before + turn
    return Sample(ids, mask, [0.0] * len(ids))


def _trim(turn: str, content: str, fmt: PromptFormat) -> str:
    """What the policy samples: up to `</tool_call>`, or up to the end-of-turn token."""
    if content.rstrip().endswith(CALL_CLOSE):
        return turn[: turn.rindex(CALL_CLOSE) + len(CALL_CLOSE)]
    for end in fmt.tokenizer.convert_ids_to_tokens(sorted(fmt.end_of_turn_ids)):
        if end in turn:
            return turn[: turn.rindex(end) + len(end)]
    return turn


def warmup_steps(cfg: SFTConfig, total_steps: int) -> int:
    """Warm-up steps: `warmup_ratio` of all steps (rounded up) when set, else `warmup_steps`."""
    return math.ceil(cfg.warmup_ratio * total_steps) if cfg.warmup_ratio else cfg.warmup_steps


def _schedule(optimizer: torch.optim.Optimizer, cfg: SFTConfig, total_steps: int) -> Any:
    warmup = warmup_steps(cfg, total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def sft_step(
    model: Any,
    samples: Sequence[Sample],
    pad_id: int,
    token_budget: int,
    *,
    world: World | None = None,
    packing: str = "auto",
) -> dict[str, float]:
    """Forward and backward over this rank's share of a step; the loss is the token mean over
    the whole step (all ranks). Micro-batches: one packed row each under the token budget, or
    padded samples (`packing`: see `SFTConfig.packing`). Returns loss and token count."""
    world = world or World()
    tokens = all_sum(sum(sum(s.loss_mask[1:]) for s in samples), world)
    total = 0.0
    flash = "flash" in str(getattr(getattr(model, "config", None), "_attn_implementation", ""))
    packed = packing == "on" or (packing == "auto" and flash)
    groups = pack(samples, token_budget) if packed else micro_batches(samples, token_budget)
    for group, weight in pad_micro_batches(groups, world):
        batch = collate_packed([group], pad_id, flash) if packed else collate(group, pad_id)
        batch = on_device(batch, model)
        with world.autocast():
            logprobs, _ = token_logprobs(model, batch)
        loss = -(logprobs * batch["loss_mask"]).sum() / max(tokens, 1)
        (loss * weight * world.size).backward()  # FSDP averages gradients over ranks
        total += float(loss.detach()) * weight
    return {"sft/loss": all_sum(total, world), "sft/tokens": float(tokens)}


def train_sft(
    model: Any,
    fmt: PromptFormat,
    conversations: Sequence[Conversation],
    cfg: SFTConfig,
    *,
    logger: RunLogger | None = None,
    seed: int = 0,
    grad_clip: float = 1.0,
    world: World | None = None,
    first_step: int = 0,
    stop_when: Callable[[int], bool] | None = None,
    sources: Sequence[str] = (),
) -> list[dict[str, float]]:
    """Train `model` in place (sharded over the ranks of `world`); returns per-step metrics,
    logged as steps `first_step + 1`, ... (a later phase of one run continues the numbering;
    what the logger holds past `first_step`, from a killed attempt, is dropped first).
    `stop_when(steps done)`, called after every step, ends training early when it says so.
    `sources` names where each conversation came from (`file:line`) in errors."""
    world = world or World()
    samples = []
    for i, conversation in enumerate(conversations):
        where = sources[i] if sources else f"conversation {i}"
        try:
            sample = encode_conversation(fmt, conversation)
        except SFTDataError as err:
            raise SFTDataError(f"{where}: {err}") from err
        if len(sample.input_ids) > cfg.max_tokens:
            size = len(sample.input_ids)
            raise SFTDataError(f"{where}: {size} tokens > sft.max_tokens {cfg.max_tokens}")
        samples.append(sample)
    per_step = min(cfg.conversations_per_step, len(samples))
    steps_per_epoch = math.ceil(len(samples) / per_step)
    total_steps = cfg.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    scheduler = _schedule(optimizer, cfg, total_steps)
    rng = random.Random(seed)
    pad_id = fmt.tokenizer.pad_token_id or 0
    history = []
    if logger is not None:  # a killed attempt's steps are about to be done again
        logger.rewind(first_step)
    model.train()
    # sft.micro_batch_tokens, or with 0 what the memory free now holds (the least of the ranks')
    budget = budget_tokens(cfg.micro_batch_tokens, model, world)
    with progress_bar(total=total_steps, desc="sft", unit="step", disable=not world.is_main) as bar:
        for chosen in _step_order(len(samples), per_step, cfg.epochs, rng):
            mine = chosen[world.rank :: world.size]
            metrics = sft_step(
                model,
                [samples[i] for i in mine],
                pad_id,
                budget,
                world=world,
                packing=cfg.packing,
            )
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            metrics |= {"sft/grad_norm": float(norm), "sft/lr": scheduler.get_last_lr()[0]}
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            trim_when_above()  # a CPU run's freed activations otherwise pile up (memory.py)
            history.append(metrics)
            if logger is not None:
                logger.log(first_step + len(history), metrics)
            bar.update()
            bar.set_postfix(loss=f"{metrics['sft/loss']:.3f}")
            if stop_when is not None and stop_when(len(history)):
                break
    model.eval()
    return history


def _step_order(count: int, per_step: int, epochs: int, rng: random.Random) -> Iterator[list[int]]:
    """The conversations of each step: every epoch a fresh shuffle, cut into steps."""
    for _ in range(epochs):
        order = list(range(count))
        rng.shuffle(order)
        for start in range(0, count, per_step):
            yield order[start : start + per_step]
