"""Policy losses over tensors, one per `algo.loss`, and decoupled PPO's token weights.

`token` (the report's): a token-level PPO clipped surrogate with clip-higher, no KL, no entropy.
For each policy token t (loss mask 1) with ratio r = exp(logp - old_logp) and its trajectory's
advantage A: loss_t = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A); with dual clip c > 1,
for A < 0 the loss is also capped at -c A. Optional per-token `weights` (detached) multiply
loss_t: decoupled PPO's proximal/behaviour importance weights (`algo.off_policy`). The batch
loss is the sum over policy tokens divided by `denominator`, the policy tokens (with signal) of
the whole optimiser step, so that micro-batches accumulate to the token-level mean.

`gspo` (Group Sequence Policy Optimization, Zheng et al. 2025): one ratio per sequence, the
geometric mean of its tokens' ratios, s = exp(mean_t (logp - old_logp)), clipped as above
(GSPO's own ranges are far narrower: clip_low 3e-4, clip_high 4e-4); loss_i = -min(s A,
clip(s) A), dual clip as above, summed over sequences and divided by `denominator`, the
sequences (with signal) of the optimiser step.

Metrics are sums over the micro-batch's policy tokens (divide by their count): clipped tokens
(for `gspo`, the tokens of clipped sequences), approximate KL (k3: r - 1 - log r), the ratio.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class LossSums:
    clipped_tokens: float
    approx_kl: float
    ratio: float


def policy_loss(
    logprobs: torch.Tensor,  # [B, T] of the current policy
    old_logprobs: torch.Tensor,  # [B, T] of the policy that sampled
    advantages: torch.Tensor,  # [B] one per trajectory
    loss_mask: torch.Tensor,  # [B, T] 1 = a token the policy sampled
    *,
    denominator: int,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float = 0.0,
    weights: torch.Tensor | None = None,  # [B, T] per-token loss weights, no gradient
) -> tuple[torch.Tensor, LossSums]:
    """The token-level clipped surrogate loss of a micro-batch and its metric sums; `denominator`:
    the optimiser step's policy tokens (module docstring)."""
    _check(denominator)
    mask = loss_mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)  # [B, 1]
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    token_loss = torch.maximum(unclipped, clipped)
    if dual_clip > 0:
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -dual_clip * adv), token_loss)
    if weights is not None:
        token_loss = token_loss * weights.to(token_loss.dtype).detach()
    loss = (token_loss * mask).sum() / denominator
    return loss, _sums(clipped > unclipped, ratio, log_ratio, mask)


def sequence_loss(
    logprobs: torch.Tensor,  # [B, T] of the current policy
    old_logprobs: torch.Tensor,  # [B, T] of the policy that sampled
    advantages: torch.Tensor,  # [B] one per trajectory
    loss_mask: torch.Tensor,  # [B, T] 1 = a token the policy sampled
    *,
    denominator: int,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float = 0.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossSums]:
    """GSPO's sequence-level clipped loss of a micro-batch and its metric sums; `denominator`:
    the optimiser step's sequences (module docstring). A row without policy tokens adds 0."""
    _check(denominator)
    if weights is not None:
        raise ValueError(
            "sequence_loss: per-token weights (algo.off_policy decoupled) are not "
            "defined for a sequence-level ratio"
        )
    mask = loss_mask.to(logprobs.dtype)
    lengths = mask.sum(-1)  # [B]
    log_ratio = (logprobs - old_logprobs) * mask
    seq_ratio = torch.exp(log_ratio.sum(-1) / lengths.clamp(min=1))  # [B]
    adv = advantages.to(logprobs.dtype)
    unclipped = -seq_ratio * adv
    clipped = -torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    seq_loss = torch.maximum(unclipped, clipped)
    if dual_clip > 0:
        seq_loss = torch.where(adv < 0, torch.minimum(seq_loss, -dual_clip * adv), seq_loss)
    loss = (seq_loss * (lengths > 0).to(seq_loss.dtype)).sum() / denominator
    token_clipped = (clipped > unclipped).unsqueeze(-1).expand_as(mask)
    return loss, _sums(token_clipped, torch.exp(log_ratio), log_ratio, mask)


def _check(denominator: int) -> None:
    if denominator <= 0:
        raise ValueError(f"policy loss: the denominator must be positive, got {denominator}")


def _sums(
    clipped: torch.Tensor, ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor
) -> LossSums:
    with torch.no_grad():
        return LossSums(
            clipped_tokens=float((clipped.to(mask.dtype) * mask).sum()),
            approx_kl=float(((ratio - 1.0 - log_ratio) * mask).sum()),
            ratio=float((ratio * mask).sum()),
        )


@dataclass(frozen=True)
class Loss:
    """A policy loss and what the denominator of its optimiser step counts."""

    fn: Callable[..., tuple[torch.Tensor, LossSums]]
    per: Literal["token", "sequence"]


LOSSES: dict[str, Loss] = {
    "token": Loss(policy_loss, "token"),
    "gspo": Loss(sequence_loss, "sequence"),
}


def behaviour_weights(
    proximal: Sequence[float], behaviour: Sequence[float], loss_mask: Sequence[int], cap: float
) -> list[float]:
    """Decoupled PPO's weight of each token: pi_proximal / pi_behaviour (the logprobs of the
    weights before the update against the engine's), at most `cap`; 0 where the mask is 0."""
    return [
        min(math.exp(prox - engine), cap) if m else 0.0
        for prox, engine, m in zip(proximal, behaviour, loss_mask, strict=True)
    ]


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each next-token distribution: [..., V] -> [...] (logged, not optimised)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)
