"""Merging LoRA adapters on the inference side (codeloop/engine/adapter.py)."""

from __future__ import annotations

import pytest
import torch

from codeloop.engine.adapter import BASE as BASE_KEY
from codeloop.engine.adapter import SCALING, AdapterBase, fingerprint, merged, metadata
from codeloop.engine.model import tiny_model
from codeloop.errors import ModelError


def test_a_merged_weight_is_the_base_plus_the_scaled_product_worked_by_hand() -> None:
    base = {"m.weight": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])}
    adapter = {
        "m.lora_A.weight": torch.tensor([[1.0, 0.0, -1.0]]),  # (rank 1, in 3)
        "m.lora_B.weight": torch.tensor([[0.5], [2.0]]),  # (out 2, rank 1)
    }
    # B @ A = [[0.5, 0, -0.5], [2, 0, -2]]; times 2, plus the base:
    out = merged(base, adapter, scaling=2.0)
    assert out.keys() == {"m.weight"}
    assert torch.equal(out["m.weight"], torch.tensor([[2.0, 2.0, 2.0], [8.0, 5.0, 2.0]]))
    assert torch.equal(base["m.weight"][0], torch.tensor([1.0, 2.0, 3.0]))  # base untouched


@pytest.mark.parametrize(
    ("adapter", "says"),
    [
        (
            {"x.lora_A.weight": torch.ones(1, 3), "x.lora_B.weight": torch.ones(2, 1)},
            "no parameter",
        ),
        ({"m.lora_A.weight": torch.ones(1, 3)}, "only one of lora_A and lora_B"),
        ({"m.lora_A.weight": torch.ones(1, 2), "m.lora_B.weight": torch.ones(2, 1)}, "do not fit"),
        ({"m.lora_A.weight": torch.ones(1, 3), "m.lora_B.weight": torch.ones(3, 1)}, "do not fit"),
        (
            {
                "m.lora_A.weight": torch.ones(1, 3),
                "m.lora_B.weight": torch.full((2, 1), float("inf")),
            },
            "NaN or an infinity",
        ),
        ({"m.bias": torch.ones(2)}, "not a LoRA tensor"),
    ],
)
def test_an_adapter_that_does_not_fit_the_base_is_refused(
    adapter: dict[str, torch.Tensor], says: str
) -> None:
    with pytest.raises(ModelError, match=says):
        merged({"m.weight": torch.zeros(2, 3)}, adapter, 1.0)


def test_a_fingerprint_is_the_same_in_float32_and_bfloat16_and_differs_between_models() -> None:
    model = tiny_model(100, seed=0)
    state = model.state_dict()
    halved = {k: v.to(torch.bfloat16) for k, v in state.items()}
    assert fingerprint(state) == fingerprint(halved)
    assert fingerprint(state) != fingerprint(tiny_model(100, seed=1).state_dict())
    nudged = dict(state) | {"model.norm.weight": state["model.norm.weight"] + 0.5}
    assert fingerprint(state) != fingerprint(nudged)
    with_adapter = dict(state) | {"m.lora_A.weight": torch.ones(1)}  # adapters are not the base
    assert fingerprint(with_adapter) == fingerprint(state)


def test_each_adapter_is_merged_into_the_base_not_into_the_last_merge() -> None:
    model = tiny_model(100, seed=0)
    name = "model.layers.0.self_attn.q_proj"
    original = model.state_dict()[f"{name}.weight"].clone()
    meta = {SCALING: "1.0", BASE_KEY: fingerprint(model.state_dict())}
    keep = AdapterBase()
    for step in (1.0, 3.0):
        adapter = {
            f"{name}.lora_A.weight": torch.full((2, 64), step),
            f"{name}.lora_B.weight": torch.full((64, 2), 0.01),
        }
        out = keep.merge(model.state_dict(), adapter, meta)
        model.state_dict()[f"{name}.weight"].copy_(out[f"{name}.weight"])  # as the server does
        assert torch.allclose(out[f"{name}.weight"], original + 2 * 0.01 * step)
    other = dict(meta) | {BASE_KEY: "0123456789abcdef"}
    with pytest.raises(ModelError, match="trained on the base model 0123456789abcdef"):
        keep.merge(model.state_dict(), adapter, other)
    with pytest.raises(ModelError, match="lacks lora_scaling"):
        keep.merge(model.state_dict(), adapter, {BASE_KEY: meta[BASE_KEY]})


def test_the_metadata_of_safetensors_bytes_is_read_back() -> None:
    from safetensors.torch import save

    body = save({"w": torch.ones(2)}, metadata={SCALING: "2.0", BASE_KEY: "abc"})
    assert metadata(body) == {SCALING: "2.0", BASE_KEY: "abc"}
    assert metadata(save({"w": torch.ones(2)})) == {}
    assert metadata(b"not safetensors") == {}
