"""`codeloop bench rollout`'s random models of published shapes."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from codeloop.bench.rollout import _drawn


def test_a_shape_is_drawn_once_with_the_configs_deviation_and_its_norms_as_built() -> None:
    config = Qwen2Config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.05,
        tie_word_embeddings=True,
    )
    model = _drawn(AutoModelForCausalLM, config)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as configured
    params = dict(model.named_parameters())
    weights = [p for p in params.values() if p.dim() >= 2]
    assert len(weights) == 1 + 2 * 7  # the tied embedding, seven matrices a layer
    for weight in (w.detach() for w in weights):  # a uniform on [-b, b], b = 0.05 * sqrt(3)
        assert weight.dtype == torch.float32
        assert float(weight.std()) == pytest.approx(0.05, rel=0.05)
        assert float(weight.abs().max()) <= 0.05 * 3**0.5
    biases = [p for name, p in params.items() if name.endswith("bias")]
    assert len(biases) == 2 * 3 and all(not b.any() for b in biases)  # q, k, v
    norms = [p for name, p in params.items() if name.endswith("norm.weight")]
    assert len(norms) == 2 * 2 + 1 and all(bool((n == 1).all()) for n in norms)
    again = _drawn(AutoModelForCausalLM, config)  # seeded: the same model
    pairs = zip(model.parameters(), again.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
