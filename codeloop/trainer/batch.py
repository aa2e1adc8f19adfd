"""Token sequences for training: micro-batches under a token budget, and per-token logprobs.

A `Sample` is one full sequence (prompt + response) with a loss mask over its tokens. Logprobs
and masks are stored per token (position j = token j); the model's logits at position j - 1
score token j, so everything is shifted by one when a batch is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from codeloop.types import Trajectory


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 = a token the loss trains on
    old_logprobs: list[float]  # per token; 0.0 where unused
    advantage: float = 0.0


def from_trajectory(trajectory: Trajectory, advantage: float) -> Sample:
    prompt = len(trajectory.prompt_ids)
    return Sample(
        trajectory.prompt_ids + trajectory.response_ids,
        [0] * prompt + trajectory.loss_mask,
        [0.0] * prompt + trajectory.logprobs,
        advantage,
    )


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
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": mask,
            "old_logprobs": old, "advantages": advantages}  # fmt: skip


def token_logprobs(model: Any, batch: dict[str, torch.Tensor], temperature: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(logprobs of each next token [B, T-1], logits [B, T-1, V]) under logits / temperature."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1].float() / (temperature or 1.0)  # [B, T-1, V]
    targets = batch["input_ids"][:, 1:].unsqueeze(-1)  # [B, T-1, 1]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1), logits
