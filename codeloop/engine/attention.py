"""Attention for the in-process engine's decoding steps on a CPU.

A decoding step has one query token per row. transformers' SDPA attention runs it one of two
ways for a model with grouped-query attention (SmolLM2: 9 query heads over 3 key-value heads):
with a padding mask, the query heads of each key-value head are packed as a [group, dim] query
matrix; with no mask (no row of the batch is padded: the samples of one prompt, a lone
request), torch's kernel is called with `enable_gqa`, which on this project's AMD EPYC
(avx512_bf16, 2 cores) took 7x as long in bfloat16: 1.8 ms against 0.28 ms per layer for 16
rows x 300 tokens (0.26 against 0.24 ms in float32), so that a decoding step of such a batch
took 97 ms instead of 45. `decode_attention` takes the packed way whether or not there is a
mask; everything that is not one query token per row in inference (prefill, training, options
this code does not handle) goes to transformers' SDPA, so a model set to it computes what it
did, within floating-point noise.

`use_decode_attention(model)` sets a model to it where it pays: a model on the CPU whose
attention is SDPA (the default); the engine calls it on the model it is given.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "codeloop_decode"
_UNHANDLED = ("softcap", "sliding_window", "position_bias", "s_aux")  # options left to SDPA


def decode_attention(  # the signature of transformers' attention interface, which calls it
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, H, Q, D], key/value [B, KVH, T, D], mask
    broadcastable to [B, 1, Q, T] (True or 0 where attended); returns [B, Q, H, D]."""
    if (
        query.shape[2] != 1
        or module.training
        or dropout
        or any(kwargs.get(name) is not None for name in _UNHANDLED)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    packed = query.view(rows, kv_heads, heads // kv_heads, dim)  # [B, KVH, G, D]
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, scale=scaling
    )  # the mask [B, 1, 1, T] broadcasts over KVH and G
    return out.view(rows, heads, 1, dim).transpose(1, 2), None


AttentionInterface.register(NAME, decode_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_decode_attention(model: Any) -> bool:
    """Set `model` to `decode_attention` if it is on the CPU with SDPA attention; whether it
    now is."""
    config = getattr(model, "config", None)
    if config is None or next(model.parameters()).device.type != "cpu":
        return False
    if config._attn_implementation == "sdpa":
        model.set_attn_implementation(NAME)
    return bool(config._attn_implementation == NAME)
