"""The learner's update against values worked out by hand: the token-mean loss over micro-batches
(the same as one batch), the tokens in its denominator, the learning rate of each step."""

import math

import pytest
import torch

from codeloop.config import Config
from codeloop.trainer.batch import Sample, collate, token_logprobs
from codeloop.trainer.distributed import World
from codeloop.trainer.learner import Learner
from codeloop.trainer.model import tiny_model

VOCAB = 32
# A's old logprobs are set for ratios 1.5, 1.0 and B's for 0.5, 1.1 (advantages +1, -1). With
# clip [0.8, 1.28], per token -min(r A, clip(r) A): A1 -1.28, A2 -1.0, B1 +0.8, B2 +1.1.
HAND_LOSS = (-1.28 - 1.0 + 0.8 + 1.1) / 4


def _learner(micro_batch_tokens: int = 4096, warmup: int = 0) -> Learner:
    cfg = Config()
    cfg.trainer.lr, cfg.trainer.warmup_steps, cfg.trainer.updates_per_step = 1e-3, warmup, 1
    cfg.trainer.micro_batch_tokens, cfg.trainer.grad_clip = micro_batch_tokens, 1e9
    cfg.algo.clip_low, cfg.algo.clip_high, cfg.algo.dual_clip = 0.2, 0.28, 0.0
    cfg.rollout.temperature = 1.0
    return Learner(tiny_model(VOCAB, hidden_size=32, layers=2, seed=0), cfg, World())


def _samples(model: torch.nn.Module) -> list[Sample]:
    """A and B (two policy tokens each, after one prompt token), and C: two tokens of a group
    without signal (advantage 0), which train nothing and do not count in the mean."""
    a = Sample([5, 6, 7], [0, 1, 1], [0.0] * 3, advantage=1.0)
    b = Sample([8, 9, 10, 11], [0, 0, 1, 1], [0.0] * 4, advantage=-1.0)  # two prompt tokens
    c = Sample([12, 13, 14], [0, 1, 1], [0.0] * 3, advantage=0.0)
    with torch.no_grad():
        now = token_logprobs(model, collate([a, b, c], 0))[0]
    for row, (sample, ratios) in enumerate(((a, (1.5, 1.0)), (b, (0.5, 1.1)), (c, (1.0, 1.0)))):
        policy = [j for j, m in enumerate(sample.loss_mask[1:]) if m]
        sample.old_logprobs = [0.0] * len(sample.input_ids)
        for j, r in zip(policy, ratios, strict=True):
            sample.old_logprobs[j + 1] = float(now[row, j]) - math.log(r)
    return [a, b, c]


def test_the_loss_is_the_mean_over_the_tokens_with_signal() -> None:
    learner = _learner()
    metrics = learner.update(_samples(learner.model))
    assert metrics["loss/loss"] == pytest.approx(HAND_LOSS, abs=1e-5)
    assert metrics["loss/policy_tokens"] == 4  # C's two tokens and the prompts are not counted
    assert metrics["loss/clip_fraction"] == pytest.approx(2 / 6)  # A1, B1 of all 6 trained


def test_micro_batches_give_the_loss_and_the_step_of_one_batch() -> None:
    whole, split = _learner(), _learner(micro_batch_tokens=4)  # 4: one sample per micro-batch
    one = whole.update(_samples(whole.model))
    three = split.update(_samples(split.model))
    assert three["loss/loss"] == pytest.approx(HAND_LOSS, abs=1e-5)
    assert three["loss/grad_norm"] == pytest.approx(one["loss/grad_norm"], rel=1e-5)
    assert one["loss/grad_norm"] > 0
    for p, q in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_the_learning_rate_warms_up_linearly_then_stays() -> None:
    learner = _learner(warmup=3)
    rates = [learner.update(_samples(learner.model))["loss/lr"] for _ in range(5)]
    assert rates == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 1e-3])
