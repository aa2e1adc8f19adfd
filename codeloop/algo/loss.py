"""The policy loss: a token-level PPO clipped surrogate with clip-higher, no KL, no entropy.

For each policy token t (loss mask 1) with ratio r = exp(logp - old_logp) and its trajectory's
advantage A: loss_t = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A); with dual clip c > 1,
for A < 0 the loss is also capped at -c A. Optional per-token `weights` (detached) multiply
loss_t: decoupled PPO's proximal/behaviour importance weights (`algo.off_policy`). The batch
loss is the sum over policy tokens divided by `num_tokens`, the policy tokens of the whole
optimiser step, so that micro-batches accumulate to the token-level mean. Metrics are sums over
the micro-batch's policy tokens (divide by the same count): clipped tokens, approximate KL (k3:
r - 1 - log r), the ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    num_tokens: int,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float = 0.0,
    weights: torch.Tensor | None = None,  # [B, T] per-token loss weights, no gradient
) -> tuple[torch.Tensor, LossSums]:
    """The clipped surrogate loss of a micro-batch and its metric sums (module docstring)."""
    if num_tokens <= 0:
        raise ValueError(f"policy_loss: num_tokens must be positive, got {num_tokens}")
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
    loss = (token_loss * mask).sum() / num_tokens
    with torch.no_grad():
        sums = LossSums(
            clipped_tokens=float(((clipped > unclipped).to(mask.dtype) * mask).sum()),
            approx_kl=float(((ratio - 1.0 - log_ratio) * mask).sum()),
            ratio=float((ratio * mask).sum()),
        )
    return loss, sums


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each next-token distribution: [..., V] -> [...] (logged, not optimised)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)
