"""Sampling a token for every row of a batch, vectorised, and the draws that make it reproducible.

The logprob returned for a token is under softmax(logits / temperature), before top-p (the
trainer must score with the same temperature); temperature 0 is greedy with raw logprobs. A row's
draw for its i-th token is a hash of (its seed, i) (`uniforms`: the request's seed, or one the
engine draws for it), and it inverts the CDF of its top-p-truncated distribution in descending
probability order, so a seeded request gets the same tokens whatever it was batched with, on any
device, with no per-row work on the host.
"""

from __future__ import annotations

import torch

from codeloop.engine.protocol import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], draws: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of [B, V] logits and its logprob, each row with its own temperature,
    top-p and uniform draw in [0, 1) ([B], `uniforms`; see the module docstring); returns ([B]
    tokens, [B] logprobs). A batch whose rows share their temperature and top-p (an RL run's,
    an evaluation's) is sampled without indexing rows, to the same tokens and logprobs."""
    settings = {(p.temperature, p.top_p) for p in params}
    if len(settings) == 1:
        return _sample_alike(logits, *settings.pop(), draws)
    return _sample_rows(logits, params, draws)


def _sample_alike(
    logits: torch.Tensor, temperature: float, top_p: float, draws: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` with one temperature and top-p for every row: what `_sample_rows` computes."""
    device = logits.device
    divisor = torch.tensor([[temperature if temperature > 0 else 1.0]], device=device)  # [1, 1]
    logprobs = torch.log_softmax(logits / divisor, -1)
    if temperature == 0:
        tokens = logprobs.argmax(-1)
    elif top_p >= 1:
        tokens = _invert_cdf(logprobs.exp(), draws.to(device, non_blocking=True))
    else:
        mass = torch.tensor(top_p, device=device)
        order = _most_likely(logprobs, mass)  # [B, K]
        probs = logprobs.gather(-1, order).exp()
        kept = probs.cumsum(-1) - probs <= mass  # the first token always is
        picked = _invert_cdf(torch.where(kept, probs, 0.0), draws.to(device, non_blocking=True))
        tokens = order.gather(-1, picked.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], draws: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` for rows of different temperatures and top-p."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)  # [B]
    greedy = temperature == 0
    logprobs = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature).unsqueeze(-1), -1)
    draws = draws.to(device, non_blocking=True)
    tokens = logprobs.argmax(-1)  # greedy rows keep it
    nucleus = [i for i, p in enumerate(params) if p.temperature > 0 and p.top_p < 1]
    full = [i for i, p in enumerate(params) if p.temperature > 0 and p.top_p >= 1]
    if full:  # the whole vocabulary in id order: no sort needed
        rows = torch.tensor(full, device=device)
        tokens[rows] = _invert_cdf(logprobs[rows].exp(), draws[rows])
    if nucleus:
        rows = torch.tensor(nucleus, device=device)
        top_p = torch.tensor([params[i].top_p for i in nucleus], device=device)
        order = _most_likely(logprobs[rows], top_p)  # [N, K]
        probs = logprobs[rows].gather(-1, order).exp()
        kept = probs.cumsum(-1) - probs <= top_p.unsqueeze(-1)  # the first token always is
        picked = _invert_cdf(torch.where(kept, probs, 0.0), draws[rows])
        tokens[rows] = order.gather(-1, picked.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


SEEDS = 2**62  # a request's seed is taken modulo this
_LOW32 = 0xFFFFFFFF


def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[B] draws in [0, 1) (float32, 24 bits), each a hash of (seed, counter) ([B] int64 each:
    seeds in [0, SEEDS), counters below 2**32), the same on any device and in any batch: a 32-bit
    integer mixer (C. Wellons' `lowbias32`) over the seed's halves, then over the counter under
    two keys made of them."""
    seeds = seeds.long()
    key = _mix32(_mix32((seeds & _LOW32) ^ 0x9E3779B9) ^ ((seeds >> 32) & _LOW32))
    other = _mix32(key ^ 0x85EBCA6B)
    mixed = _mix32((_mix32((counters.long() & _LOW32) ^ key) + other) & _LOW32)
    return (mixed >> 8).float() / 2**24


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """`lowbias32` of values in [0, 2**32) held in int64."""
    x = x ^ (x >> 16)
    x = _times32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _times32(x: torch.Tensor, factor: int) -> torch.Tensor:
    """(x * factor) mod 2**32 for x in [0, 2**32), in two 16-bit halves of the factor so that no
    product passes 2**49 (int64 never overflows)."""
    low, high = factor & 0xFFFF, factor >> 16
    return (x * low + ((x * high) & 0xFFFF) * 65536) & _LOW32


def _invert_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Per row of [N, K] unnormalised probabilities, the index where the CDF passes the draw."""
    cdf = probs.cumsum(-1)
    index = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return index.clamp(max=probs.shape[-1] - 1)


def _most_likely(logprobs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, token ids in descending probability, as many as top-p can keep ([N, K]): the
    smallest of 64, 1024 or all whose mass exceeds every row's top-p (so no later token is
    kept), which spares most steps a sort of the whole vocabulary."""
    vocab = logprobs.shape[-1]
    for k in (64, 1024):
        if k < vocab:
            top, order = logprobs.topk(k, dim=-1)  # sorted
            if bool((top.exp().sum(-1) > top_p).all()):
                return order
    return logprobs.argsort(dim=-1, descending=True)
