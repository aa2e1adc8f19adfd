"""The learner's update against values worked out by hand: the token-mean loss over micro-batches
(the same as one batch), the tokens in its denominator, the learning rate of each step."""

import math

import pytest
import torch

from codeloop.algo.loss import policy_loss
from codeloop.config import Config
from codeloop.engine.model import tiny_model
from codeloop.trainer.batch import Sample, collate, token_logprobs
from codeloop.trainer.distributed import World
from codeloop.trainer.learner import Learner

VOCAB = 32
# A's old logprobs are set for ratios 1.5, 1.0 and B's for 0.5, 1.1 (advantages +1, -1). With
# clip [0.8, 1.28], per token -min(r A, clip(r) A): A1 -1.28, A2 -1.0, B1 +0.8, B2 +1.1.
HAND_LOSS = (-1.28 - 1.0 + 0.8 + 1.1) / 4


def _learner(
    micro_batch_tokens: int = 4096, warmup: int = 0, checkpointing: bool = False
) -> Learner:
    cfg = Config()
    cfg.trainer.gradient_checkpointing = checkpointing
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


def test_the_reported_gradient_norm_is_the_losss() -> None:
    """Against the gradient of the same loss taken directly (policy_loss over one batch)."""
    learner, reference = _learner(), tiny_model(VOCAB, hidden_size=32, layers=2, seed=0)
    samples = _samples(reference)
    batch = collate(samples, 0)
    logprobs, _ = token_logprobs(reference, batch)
    loss, _ = policy_loss(
        logprobs,
        batch["old_logprobs"],
        batch["advantages"],
        batch["loss_mask"],
        denominator=4,
        clip_low=0.2,
        clip_high=0.28,
    )
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    assert learner.update(samples)["loss/grad_norm"] == pytest.approx(float(norm), rel=1e-5)


def test_several_updates_per_step_report_the_mean_of_their_gradient_norms() -> None:
    """trainer.updates_per_step 2 on [A, B, C] steps on [A, C], then on [B]: the same two
    optimiser steps as two updates of one, whose norms it averages."""
    two = _learner()
    two.cfg.trainer.updates_per_step = 2
    a, b, c = _samples(two.model)
    both = two.update([a, b, c])
    one = _learner()
    first, second = one.update([a, c]), one.update([b])
    mean = (first["loss/grad_norm"] + second["loss/grad_norm"]) / 2
    assert both["loss/grad_norm"] == pytest.approx(mean, rel=1e-5)
    for p, q in zip(two.model.parameters(), one.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_a_step_without_signal_leaves_the_weights_and_one_token_with_signal_trains() -> None:
    learner = _learner()
    learner.cfg.trainer.weight_decay = 0.1  # an optimiser step would move every weight
    learner.optimizer.param_groups[0]["weight_decay"] = 0.1
    before = [p.detach().clone() for p in learner.model.parameters()]
    _, _, c = _samples(learner.model)
    metrics = learner.update([c])  # advantage 0: nothing to learn
    assert (metrics["loss/policy_tokens"], metrics["loss/grad_norm"]) == (0, 0)
    assert all(torch.equal(p, q) for p, q in zip(before, learner.model.parameters(), strict=True))
    # one policy token, sampled by these very weights (ratio 1): loss -r A / 1 token = -1, and
    # the entropy of its next-token distribution over that one token
    # (after two prompt tokens, whose positions count in neither)
    single = Sample([5, 6, 7], [0, 0, 1], [0.0, 0.0, 0.0], advantage=1.0)
    with torch.no_grad():
        own, entropy = token_logprobs(learner.model, collate([single], 0), entropy=True)
    single.old_logprobs = [0.0, 0.0, float(own[0, 1])]
    metrics = learner.update([single])
    assert metrics["loss/policy_tokens"] == 1 and metrics["loss/loss"] == pytest.approx(-1.0)
    assert metrics["loss/entropy"] == pytest.approx(float(entropy[0, 1]), rel=1e-5)  # type: ignore[index]
    assert not all(
        torch.equal(p, q) for p, q in zip(before, learner.model.parameters(), strict=True)
    )


def test_the_sampler_gap_is_the_engines_distance_from_the_trainers_logprobs() -> None:
    """The engine's logprobs of two sampled tokens: its own (gap 0), then each 0.3 nats off in
    opposite directions (gap 0.3 per token); with the trainer's recomputed ones: no gap."""
    sample = Sample([5, 6, 7, 8], [0, 0, 1, 1], [0.0] * 4, advantage=1.0)
    learner = _learner()
    with torch.no_grad():
        own, _ = token_logprobs(learner.model, collate([sample], 0))
    sample.old_logprobs = [0.0, 0.0, float(own[0, 1]), float(own[0, 2])]
    assert learner.update([sample])["loss/sampler_gap"] == pytest.approx(0.0, abs=1e-6)
    learner = _learner()
    sample.old_logprobs = [0.0, 0.0, float(own[0, 1]) + 0.3, float(own[0, 2]) - 0.3]
    assert learner.update([sample])["loss/sampler_gap"] == pytest.approx(0.3, abs=1e-5)
    learner = _learner()
    learner.cfg.trainer.recompute_old_logprobs = True
    assert "loss/sampler_gap" not in learner.update([sample])


def test_the_learning_rate_warms_up_linearly_then_stays() -> None:
    learner = _learner(warmup=3)
    rates = [learner.update(_samples(learner.model))["loss/lr"] for _ in range(5)]
    assert rates == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 1e-3])
    constant = _learner(warmup=0)  # no warm-up: the configured rate from the first step
    assert constant.update(_samples(constant.model))["loss/lr"] == pytest.approx(1e-3)


def test_recomputed_old_logprobs_are_the_weights_own_before_the_update() -> None:
    learner = _learner()
    learner.cfg.trainer.recompute_old_logprobs = True
    samples = _samples(learner.model)  # three lengths in one micro-batch: 3, 4, 3 tokens
    with torch.no_grad():
        own = token_logprobs(learner.model, collate(samples, 0))[0]
    expected = [
        [0.0] + [float(own[row, j]) if m else 0.0 for j, m in enumerate(s.loss_mask[1:])]
        for row, s in enumerate(samples)
    ]
    metrics = learner.update(samples)
    for sample, values in zip(samples, expected, strict=True):
        assert sample.old_logprobs == pytest.approx(values, abs=1e-6)
    # every ratio is 1 before the step: the loss is -mean(A) over A's and B's tokens, 0
    assert metrics["loss/loss"] == pytest.approx(0.0, abs=1e-6)


def test_gspo_is_the_mean_over_the_sequences_with_signal_however_micro_batched() -> None:
    """algo.loss gspo on A (s = sqrt(1.5 x 1.0), kept: -1.2247) and B (s = sqrt(0.5 x 1.1) =
    0.742, clipped to 0.8 with A = -1: +0.8); C has no signal and is not counted: / 2."""
    norms = []
    for budget in (4096, 4):  # one micro-batch; one per sample
        learner = _learner(micro_batch_tokens=budget)
        learner.cfg.algo.loss = "gspo"
        metrics = learner.update(_samples(learner.model))
        assert metrics["loss/loss"] == pytest.approx((-math.sqrt(1.5) + 0.8) / 2, abs=1e-5)
        assert metrics["loss/policy_tokens"] == 4
        norms.append(metrics["loss/grad_norm"])
    assert norms[0] == pytest.approx(norms[1], rel=1e-5) and norms[0] > 0


def test_gradient_checkpointing_gives_the_step_of_kept_activations() -> None:
    kept, checkpointed = _learner(), _learner(checkpointing=True)

    def recomputed(learner: Learner) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) for m in learner.model.modules())

    assert recomputed(checkpointed) and not recomputed(kept)
    one = kept.update(_samples(kept.model))
    other = checkpointed.update(_samples(checkpointed.model))
    assert other["loss/loss"] == pytest.approx(HAND_LOSS, abs=1e-5)
    assert other["loss/grad_norm"] == pytest.approx(one["loss/grad_norm"], rel=1e-5)
    for p, q in zip(kept.model.parameters(), checkpointed.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
