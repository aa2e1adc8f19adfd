"""The engine's decoding attention computes what transformers' SDPA computes, and hands every
other call to it."""

import copy
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from codeloop.engine.attention import NAME, decode_attention, use_decode_attention


class _Module(torch.nn.Module):
    num_key_value_groups = 3  # 6 query heads over 2 key-value heads
    is_causal = True


def _inputs(rows: int, queries: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    query = torch.randn(rows, 6, queries, 8, dtype=dtype)
    key, value = (torch.randn(rows, 2, 12, 8, dtype=dtype) for _ in range(2))
    mask = torch.ones(rows, 1, queries, 12, dtype=torch.bool)
    mask[0, ..., :5] = False  # row 0 left-padded by 5
    mask[1, ..., 3:7] = False  # row 1 with a hole (a reused prefix, then padding)
    return query, key, value, mask


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_one_query_token_per_row_matches_sdpa(dtype: torch.dtype, atol: float) -> None:
    module = _Module().eval()
    query, key, value, mask = _inputs(3, 1, dtype)
    mine, _ = decode_attention(module, query, key, value, mask, scaling=0.3)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert mine.shape == expected.shape == (3, 1, 6, 8)
    assert torch.allclose(mine.float(), expected.float(), atol=atol)
    # by hand for row 0, query head 4 (key-value head 1): only keys 5.. are attended
    scores = (query[0, 4, 0].float() @ key[0, 1, 5:].float().T) * 0.3
    by_hand = torch.softmax(scores, -1) @ value[0, 1, 5:].float()
    assert torch.allclose(mine[0, 0, 4].float(), by_hand, atol=atol)
    # no mask (no row padded): transformers then calls torch with enable_gqa
    unmasked, _ = decode_attention(module, query, key, value, None, scaling=0.3)
    expected, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.3)
    assert torch.allclose(unmasked.float(), expected.float(), atol=atol)
    float_mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))  # the additive form
    assert torch.allclose(
        decode_attention(module, query, key, value, float_mask, scaling=0.3)[0].float(),
        mine.float(),
        atol=atol,
    )


def test_prefill_and_training_go_to_sdpa() -> None:
    module = _Module().eval()
    query, key, value, mask = _inputs(3, 12, torch.float32)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask)
    assert torch.equal(decode_attention(module, query, key, value, mask)[0], expected)
    module.train()
    query, key, value, mask = _inputs(3, 1, torch.float32)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask)
    assert torch.equal(decode_attention(module, query, key, value, mask)[0], expected)


def _model(attention: str) -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=61,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        attn_implementation=attention,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def test_a_model_set_to_it_decodes_as_with_sdpa() -> None:
    reference = _model("sdpa")
    model = copy.deepcopy(reference)
    assert use_decode_attention(model) and model.config._attn_implementation == NAME
    padded = torch.tensor([[0, 0, 0, 5, 9, 2], [4, 8, 15, 16, 23, 42]])
    unpadded = torch.tensor([[3, 5, 9, 2], [15, 16, 23, 42]])  # decoded with no mask
    for prompts in (padded, unpadded):
        with torch.no_grad():
            ours, theirs = (
                m.generate(
                    prompts,
                    attention_mask=(prompts > 0).long(),
                    max_new_tokens=12,
                    do_sample=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
                for m in (model, reference)
            )
        assert torch.equal(ours.sequences, theirs.sequences)
        for mine, expected in zip(ours.scores, theirs.scores, strict=True):
            assert torch.allclose(mine, expected, atol=1e-5)


def test_only_a_cpu_model_with_sdpa_is_switched() -> None:
    eager = _model("eager")
    assert not use_decode_attention(eager)
    assert eager.config._attn_implementation == "eager"
