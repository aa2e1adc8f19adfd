"""Token sequences for training: micro-batches under a token budget, and per-token logprobs.

A `Sample` is one full sequence (prompt + response) with a loss mask over its tokens. Logprobs
and masks are stored per token (position j = token j); the model's logits at position j - 1
score token j, so everything is shifted by one when a batch is made.

Two ways to batch: `micro_batches` + `collate` pad samples to the longest of a micro-batch;
`pack` + `collate_packed` lay several samples end to end in one row under the token budget,
with position ids restarting at each sample and a block-diagonal causal attention mask, so
that no token sees another sample and nothing is spent on padding. Packed rows carry a 4D
boolean mask [rows, 1, T, T] (the `sdpa` and `eager` attentions take it); with a FlashAttention
implementation the mask is left out and the position ids mark the samples.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from codeloop.algo.loss import token_entropy
from codeloop.memory import free_memory, micro_batch_tokens
from codeloop.trainer.distributed import World, all_max
from codeloop.types import Trajectory


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 = a token the loss trains on
    old_logprobs: list[float]  # per token; 0.0 where unused
    advantage: float = 0.0
    weights: list[float] | None = None  # per token, of the loss (algo.off_policy); None = 1


def from_trajectory(trajectory: Trajectory, advantage: float) -> Sample:
    prompt = len(trajectory.prompt_ids)
    return Sample(
        trajectory.prompt_ids + trajectory.response_ids,
        [0] * prompt + trajectory.loss_mask,
        [0.0] * prompt + trajectory.logprobs,
        advantage,
    )


def budget_tokens(configured: int, model: Any, world: World, checkpointed: bool = False) -> int:
    """A micro-batch's token budget: `configured`, or where it is 0 what half of the memory free
    now holds (`memory.micro_batch_tokens`: the GPU's where the model is on one, else the
    machine's; the least of every rank's), so that a default run fits the machine it runs on."""
    if configured:
        return configured
    free = free_memory(next(model.parameters()).device)
    own = micro_batch_tokens(getattr(model, "config", None), free, checkpointed)
    return -all_max(-own, world)


def micro_batches(samples: Sequence[Sample], token_budget: int) -> list[list[Sample]]:
    """Group samples (longest first) so that each padded micro-batch holds <= token_budget
    tokens; a sample longer than the budget gets a micro-batch of its own."""
    ordered = sorted(samples, key=lambda s: len(s.input_ids), reverse=True)
    batches: list[list[Sample]] = []
    for sample in ordered:
        if batches and len(batches[-1][0].input_ids) * (len(batches[-1]) + 1) <= token_budget:
            batches[-1].append(sample)  # the first sample is the longest: it sets the width
        else:
            batches.append([sample])
    return batches


def pack(samples: Sequence[Sample], token_budget: int) -> list[list[Sample]]:
    """Rows of samples laid end to end, each <= token_budget tokens (first fit, longest
    first); a sample longer than the budget gets a row of its own."""
    rows: list[list[Sample]] = []
    room: list[int] = []
    for sample in sorted(samples, key=lambda s: len(s.input_ids), reverse=True):
        size = len(sample.input_ids)
        row = next((i for i, free in enumerate(room) if free >= size), None)
        if row is None:
            rows.append([sample])
            room.append(token_budget - size)
        else:
            rows[row].append(sample)
            room[row] -= size
    return rows


def collate_packed(
    rows: Sequence[Sequence[Sample]], pad_id: int, flash: bool = False
) -> dict[str, torch.Tensor]:
    """Packed rows (see the module docstring) with the fields of `collate` plus
    `position_ids`; the first token of each sample is never a target."""
    width = max(sum(len(s.input_ids) for s in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    segments = torch.full((len(rows), width), -1)
    mask = torch.zeros((len(rows), width))
    old = torch.zeros((len(rows), width))
    for r, row in enumerate(rows):
        start = 0
        for k, sample in enumerate(row):
            end = start + len(sample.input_ids)
            ids[r, start:end] = torch.tensor(sample.input_ids)
            positions[r, start:end] = torch.arange(end - start)
            segments[r, start:end] = k
            mask[r, start:end] = torch.tensor(sample.loss_mask, dtype=torch.float)
            mask[r, start] = 0.0
            old[r, start:end] = torch.tensor(sample.old_logprobs)
            start = end
        segments[r, start:] = len(row)  # padding: a segment of its own, never trained
    batch = {
        "input_ids": ids,
        "position_ids": positions,
        "loss_mask": mask[:, 1:],
        "old_logprobs": old[:, 1:],
    }
    if not flash:
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool))
        batch["attention_mask"] = (segments[:, :, None] == segments[:, None, :]) & causal
        batch["attention_mask"] = batch["attention_mask"][:, None]
    return batch


def collate(samples: Sequence[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors; `loss_mask` and `old_logprobs` are shifted to the targets."""
    width = max(len(s.input_ids) for s in samples)

    def padded(values: list[Any], fill: Any) -> list[Any]:
        return values + [fill] * (width - len(values))

    ids = torch.tensor([padded(s.input_ids, pad_id) for s in samples])  # [B, T]
    attention = torch.tensor([padded([1] * len(s.input_ids), 0) for s in samples])  # [B, T]
    mask = torch.tensor([padded(s.loss_mask, 0) for s in samples])[:, 1:]  # [B, T-1]
    old = torch.tensor([padded(s.old_logprobs, 0.0) for s in samples])[:, 1:]  # [B, T-1]
    advantages = torch.tensor([s.advantage for s in samples])  # [B]
    batch = {
        "input_ids": ids,
        "attention_mask": attention,
        "loss_mask": mask,
        "old_logprobs": old,
        "advantages": advantages,
    }
    if any(s.weights is not None for s in samples):
        weights = [padded(s.weights or [1.0] * len(s.input_ids), 0.0) for s in samples]
        batch["weights"] = torch.tensor(weights)[:, 1:]  # [B, T-1]
    return batch


def on_device(batch: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """The batch on the device of the model's parameters (the CPU, or this rank's GPU)."""
    device = next(model.parameters()).device
    return {key: value.to(device) for key, value in batch.items()}


ENTROPY_CHUNK = 1024  # positions whose entropy is computed at once


@functools.cache
def keeps_by_mask() -> bool:
    """Whether transformers' models take a boolean [B, T] `logits_to_keep` (from 5.2x, with
    `slice_logits_to_keep`); older ones index the sequence axis with a 1-D tensor alone and
    fail on the mask ("too many indices for tensor of dimension 3")."""
    from transformers import modeling_utils

    return hasattr(modeling_utils, "slice_logits_to_keep")


def token_logprobs(
    model: Any, batch: dict[str, torch.Tensor], temperature: float = 1.0, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs of each next token [B, T-1], their entropies [B, T-1] when `entropy`, else
    None) under logits / temperature, where `loss_mask` is set and 0 elsewhere. The output layer
    and the softmax run on those positions alone (`logits_to_keep`): with a 49K vocabulary
    they are a fifth of a small model's FLOPs and most of its activation memory, and prompt
    and tool tokens never need them."""
    inputs: dict[str, Any] = {
        k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch
    }
    inputs["use_cache"] = False  # a scoring pass keeps no KV (gradient checkpointing asks so)
    if inputs.get("attention_mask") is not None and inputs["attention_mask"].dim() == 2:
        # `collate` pads on the right, so under the causal mask no real token sees padding and
        # the padding mask changes no scored position: without it attention runs causal
        # (is_causal, no mask to build; SmolLM2's SFT attention on a 2-core AMD EPYC: 5.7 ->
        # 4.9 s of a step's 18.7 s; on a GPU it also lets SDPA pick its FlashAttention kernel)
        del inputs["attention_mask"]
    keep = batch["loss_mask"] > 0  # [B, T-1]: position j - 1 scores token j
    scored = torch.cat([keep, torch.zeros_like(keep[:, :1])], dim=1)  # [B, T]
    if keeps_by_mask():
        logits = model(**inputs, logits_to_keep=scored).logits  # [N, V]
    else:  # the positions any row scores, the same for every row: [B, P, V]
        columns = scored.any(dim=0).nonzero().squeeze(-1)
        logits = model(**inputs, logits_to_keep=columns).logits
        if logits.shape[1] == len(columns):
            logits = logits[scored[:, columns]]
    if logits.dim() == 3:  # a model that ignores logits_to_keep: every position, then select
        logits = logits[:, :-1][keep]
    logits = logits.float()  # [N, V], N = kept positions
    if temperature not in (0.0, 1.0):  # a division of [N, V] and its backward: ~5% of SFT's step
        logits = logits / temperature
    targets = batch["input_ids"][:, 1:][keep].unsqueeze(-1)  # [N, 1]
    chosen = torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)  # [N]
    logprobs = torch.zeros(keep.shape, device=logits.device).masked_scatter(keep, chosen)
    if not entropy:
        return logprobs, None
    with torch.no_grad():  # in chunks: one more [N, V] float32 copy is what a step can't spare
        spread = torch.cat([token_entropy(c) for c in logits.detach().split(ENTROPY_CHUNK)])
    return logprobs, torch.zeros(keep.shape, device=logits.device).masked_scatter(keep, spread)
