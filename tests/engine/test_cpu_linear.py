"""Weights packed once for oneDNN (`cpu_linear`): the same products as `linear`, and the slot
cache's steps with packed weights equal its steps without them."""

from typing import Any

import pytest
import torch
from engine_helpers import SMALL
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from codeloop.engine import cpu_linear
from codeloop.engine.slot_cache import SlotDecoder

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)


def test_packs_the_engines_dtypes_and_nothing_else() -> None:
    assert cpu_linear.packs(torch.float32)
    assert cpu_linear.packs(torch.bfloat16)
    assert not cpu_linear.packs(torch.float64)
    assert not cpu_linear.packs(torch.float16)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_a_packed_product_equals_linear(rows: int) -> None:
    """Any number of rows (the layout is picked for 64), a bias, a [n, T, in] input; float32
    within rounding, bfloat16 to the same values."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 48, generator=generator)
    bias = torch.randn(96, generator=generator)
    x = torch.randn(rows, 2, 48, generator=generator)
    got = cpu_linear.linear(x, cpu_linear.pack(weight), bias)
    assert got.shape == (rows, 2, 96)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias))
    half = [t.to(torch.bfloat16) for t in (x, weight, bias)]
    got = cpu_linear.linear(half[0], cpu_linear.pack(half[1]), half[2])
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.nn.functional.linear(*half))


def _model(config: Any, scale: float = 1.0) -> Any:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(scale)
    return model


def _mixed_step(decoder: SlotDecoder) -> torch.Tensor:
    """Two decoding rows and a chunk of 6 prompt tokens in a third slot, in one step."""
    tokens = [5, 9, 11, 12, 13, 14, 15, 16]
    slots = [0, 1, 2, 2, 2, 2, 2, 2]
    positions = [0, 0, 0, 1, 2, 3, 4, 5]
    return decoder.step(tokens, slots, positions, [0, 1, 7])


@pytest.mark.parametrize(
    "config", [LlamaConfig(**SMALL), Qwen2Config(**SMALL)], ids=["llama", "qwen2_bias"]
)
def test_a_step_with_packed_weights_equals_one_without(config: Any) -> None:
    model = _model(config)
    packed, plain = SlotDecoder(model, 4, pack=True), SlotDecoder(model, 4, pack=False)
    assert packed.packed and not plain.packed
    torch.testing.assert_close(_mixed_step(packed), _mixed_step(plain), atol=1e-5, rtol=1e-5)


def test_new_weights_are_packed_again() -> None:
    """`refresh` after the model's weights change: the packed copies follow (a decoder that
    kept its old packed weights would give the old model's logits)."""
    config = LlamaConfig(**SMALL)
    model = _model(config)
    decoder = SlotDecoder(model, 4, pack=True)
    before = _mixed_step(decoder)
    doubled = _model(config, 2.0)
    with torch.no_grad():
        for target, source in zip(model.parameters(), doubled.parameters(), strict=True):
            target.copy_(source)
    decoder.refresh()
    after = _mixed_step(decoder)
    expected = _mixed_step(SlotDecoder(model, 4, pack=False))
    assert not torch.allclose(before, expected, atol=1e-3)
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)
