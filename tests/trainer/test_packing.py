"""Packed micro-batches: samples end to end, each seeing only itself."""

import copy
import random

import pytest
import torch
from trainer_helpers import conversation

from codeloop.config import SFTConfig
from codeloop.engine.model import tiny_model
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer import batch as batch_module
from codeloop.trainer.batch import Sample, collate, collate_packed, pack, token_logprobs
from codeloop.trainer.sft import train_sft


def _sample(length: int, seed: int = 0) -> Sample:
    rng = random.Random(seed)
    ids = [rng.randrange(100) for _ in range(length)]
    return Sample(ids, [0] * 3 + [1] * (length - 3), [0.0] * length)


def test_pack_fills_rows_first_fit_longest_first() -> None:
    samples = [_sample(n) for n in (3, 7, 5, 4, 12)]
    rows = pack(samples, 10)
    assert [[len(s.input_ids) for s in row] for row in rows] == [[12], [7, 3], [5, 4]]


def test_packed_row_layout() -> None:
    a, b = Sample([5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.25]), Sample([8, 9], [1, 1], [0.0, -1.0])
    batch = collate_packed([[a, b], [b]], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [8, 9, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 0, 0]]
    # targets are tokens 1..: b's first token (8) is never a target, nor padding
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 1], [1, 0, 0, 0]]
    assert batch["old_logprobs"].tolist() == [[-0.5, -0.25, 0.0, -1.0], [-1.0, 0.0, 0.0, 0.0]]
    mask = batch["attention_mask"][0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    assert "attention_mask" not in collate_packed([[a, b]], 0, flash=True)


def test_packed_logprobs_equal_each_sample_alone() -> None:
    torch.manual_seed(0)
    model = tiny_model(100, hidden_size=32, layers=2).eval()
    samples = [_sample(n, seed=n) for n in (9, 14, 6)]
    with torch.no_grad():
        packed, _ = token_logprobs(model, collate_packed([samples], 0))
        start = 0
        for sample in samples:
            alone, _ = token_logprobs(model, collate([sample], 0))
            n = len(sample.input_ids)
            assert packed[0, start : start + n - 1].tolist() == pytest.approx(
                alone[0].tolist(), abs=1e-5
            )
            start += n


def test_sft_with_and_without_packing_takes_the_same_steps(trainer_fmt: PromptFormat) -> None:
    data = [conversation(trainer_fmt, a, b) for a, b in [(1, 2), (3, 4), (10, 20), (7, 8)]]
    torch.manual_seed(0)
    base = tiny_model(len(trainer_fmt.tokenizer), hidden_size=64, layers=2)
    histories = []
    for packing in ("on", "off"):
        model = copy.deepcopy(base)
        cfg = SFTConfig(
            epochs=3,
            lr=3e-3,
            warmup_steps=1,
            conversations_per_step=4,
            micro_batch_tokens=400,
            packing=packing,
        )
        histories.append(train_sft(model, trainer_fmt, data, cfg))
    packed, padded = histories
    for a, b in zip(packed, padded, strict=True):
        assert a["sft/tokens"] == b["sft/tokens"]
        assert a["sft/loss"] == pytest.approx(b["sft/loss"], rel=1e-4)


@pytest.mark.parametrize("by_mask", [True, False])
def test_logprobs_scored_only_where_the_loss_mask_is_set(
    by_mask: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways of asking for the scored positions alone: a boolean [B, T] mask (transformers
    from 5.2x) and, before it, the positions any row scores as a 1-D tensor (transformers 5.17
    on the GPU machine failed on the mask: "too many indices for tensor of dimension 3")."""
    monkeypatch.setattr(batch_module, "keeps_by_mask", lambda: by_mask)
    torch.manual_seed(0)
    model = tiny_model(100, hidden_size=32, layers=2).eval()
    samples = [
        Sample([4, 8, 15, 16, 23, 42], [0, 0, 1, 1, 0, 1], [0.0] * 6),
        Sample([7, 9, 11], [0, 1, 1], [0.0] * 3),
    ]
    batch = collate(samples, pad_id=0)
    logprobs, entropies = token_logprobs(model, batch, temperature=0.5, entropy=True)
    assert entropies is not None
    values = logprobs.detach()
    with torch.no_grad():
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        full = torch.log_softmax(model(**inputs).logits / 0.5, -1)
    targets = batch["input_ids"][:, 1:]
    # targets scored: row 0 tokens 2, 3, 5 (positions 1, 2, 4); row 1 tokens 1, 2 (positions 0, 1)
    kept = [(0, 1), (0, 2), (0, 4), (1, 0), (1, 1)]
    for row in range(2):
        for j in range(5):
            if (row, j) in kept:
                want = float(full[row, j, targets[row, j]])
                assert float(values[row, j]) == pytest.approx(want, abs=1e-5)
                spread = float(-(full[row, j].exp() * full[row, j]).sum())
                assert float(entropies[row, j]) == pytest.approx(spread, abs=1e-4)
            else:
                assert float(values[row, j]) == 0.0 and float(entropies[row, j]) == 0.0
    logprobs.sum().backward()  # gradients flow through the kept positions
    assert model.get_output_embeddings().weight.grad.abs().sum() > 0
