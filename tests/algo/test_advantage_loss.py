import math

import pytest
import torch

from codeloop.algo.advantage import group_advantages, has_signal
from codeloop.algo.loss import LOSSES, behaviour_weights, policy_loss, sequence_loss, token_entropy


def test_one_correct_of_four() -> None:
    # mean 0.25; sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    assert group_advantages([1, 0, 0, 0]) == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)


def test_half_correct() -> None:
    a = 0.5 / math.sqrt(1 / 3)  # 0.866
    assert group_advantages([1, 1, 0, 0]) == pytest.approx([a, a, -a, -a], rel=1e-5)


def test_eps_keeps_a_tiny_spread_from_exploding() -> None:
    # rewards 1e-6 and 0: mean 5e-7, sample std sqrt(2 * (5e-7)^2) = 7.0711e-7; with the
    # default eps 1e-6 the advantages are +-5e-7 / 1.70711e-6 = +-0.29289 (not +-0.7071)
    assert group_advantages([1e-6, 0.0]) == pytest.approx([0.29289, -0.29289], rel=1e-4)
    # eps 0.5 on rewards 1, 0: +-0.5 / (0.70711 + 0.5)
    assert group_advantages([1.0, 0.0], eps=0.5) == pytest.approx([0.41421, -0.41421], rel=1e-4)


def test_unscaled_advantages_are_the_rewards_minus_their_mean() -> None:
    # Dr. GRPO (algo.adv_scale = "none"): mean 0.25, no division by the std 0.5
    assert group_advantages([1, 0, 0, 0], scale=False) == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert group_advantages([1, 1], scale=False) == [0.0, 0.0]


@pytest.mark.parametrize("rewards", [[1.0] * 4, [0.0] * 4, [1.0]])
def test_groups_without_signal(rewards: list[float]) -> None:
    assert not has_signal(rewards)
    assert group_advantages(rewards) == [0.0] * len(rewards)


def _loss(ratios: list[float], advantage: float, mask: list[int] | None = None, **kw: float):  # type: ignore[no-untyped-def]
    old = torch.zeros(1, len(ratios))
    new = torch.log(torch.tensor([ratios])).requires_grad_()
    mask_t = torch.tensor([mask or [1] * len(ratios)])
    loss, sums = policy_loss(
        new, old, torch.tensor([advantage]), mask_t, denominator=int(mask_t.sum()), **kw
    )
    return loss, sums, new


def test_positive_advantage_clips_above_1_plus_clip_high() -> None:
    # ratios 1.0, 1.5, 0.5 with A = +1: -1, -min(1.5, 1.28), -min(0.5, 0.8) = -2.78 over 3
    loss, sums, new = _loss([1.0, 1.5, 0.5], 1.0)
    assert loss.item() == pytest.approx(-2.78 / 3)
    assert sums.clipped_tokens == 1
    loss.backward()
    # d/dlogp of -r A / 3 is -r / 3 where unclipped; 0 on the clipped token
    assert new.grad[0].tolist() == pytest.approx([-1 / 3, 0.0, -0.5 / 3])  # type: ignore[index]


def test_negative_advantage_clips_below_1_minus_clip_low() -> None:
    # A = -1: max(1, 1), max(1.5, 1.28), max(0.5, 0.8) = 3.3 over 3
    loss, sums, _ = _loss([1.0, 1.5, 0.5], -1.0)
    assert loss.item() == pytest.approx(1.1)
    assert sums.clipped_tokens == 1


def test_dual_clip_caps_negative_advantage_losses() -> None:
    loss, _, _ = _loss([4.0], -1.0)
    assert loss.item() == pytest.approx(4.0)
    capped, _, _ = _loss([4.0], -1.0, dual_clip=3.0)
    assert capped.item() == pytest.approx(3.0)
    positive, _, _ = _loss([4.0], 1.0, dual_clip=3.0)  # A > 0: untouched, -1.28
    assert positive.item() == pytest.approx(-1.28)


def test_dual_clip_caps_at_c_times_the_advantage() -> None:
    # A = -2, ratio 4: max(-r A, -clip(r) A) = max(8, 2.56) = 8, capped at -c A = 6; a positive
    # A below 1 (0.5, ratio 1) is untouched: -0.5
    capped, _, _ = _loss([4.0], -2.0, dual_clip=3.0)
    assert capped.item() == pytest.approx(6.0)
    small, _, _ = _loss([1.0], 0.5, dual_clip=3.0)
    assert small.item() == pytest.approx(-0.5)


def test_token_weights_multiply_each_tokens_loss() -> None:
    # ratios 1, A = +1: per-token -1, weighted 2 and 1: (-2 - 1) / 2
    old = torch.zeros(1, 2)
    loss, _ = policy_loss(
        torch.zeros(1, 2),
        old,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        denominator=2,
        weights=torch.tensor([[2.0, 1.0]]),
    )
    assert loss.item() == pytest.approx(-1.5)


def test_masked_tokens_add_nothing_to_the_metrics() -> None:
    # the masked token's ratio 50 is in neither the KL sum nor the clipped count
    _, sums, _ = _loss([1.5, 50.0], 1.0, mask=[1, 0])
    assert sums.approx_kl == pytest.approx(0.5 - math.log(1.5))
    assert sums.clipped_tokens == 1


def test_clip_ratios_are_configurable() -> None:
    loss, _, _ = _loss([1.5], 1.0, clip_high=0.4)
    assert loss.item() == pytest.approx(-1.4)


def test_tool_tokens_are_masked() -> None:
    loss, sums, new = _loss([1.0, 50.0, 1.0], 1.0, mask=[1, 0, 1])
    assert loss.item() == pytest.approx(-1.0)  # (-1 - 1) / 2 policy tokens
    loss.backward()
    assert new.grad[0, 1] == 0  # type: ignore[index]
    assert sums.ratio == pytest.approx(2.0)


def test_micro_batches_accumulate_to_the_token_mean() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, -2.0]])
    old = torch.tensor([[-1.1, -1.5, -0.5], [-0.2, -0.4, -1.0]])
    adv, mask = torch.tensor([0.7, -1.2]), torch.tensor([[1, 1, 0], [1, 1, 1]])
    whole, _ = policy_loss(logprobs, old, adv, mask, denominator=5)
    parts = sum(
        float(
            policy_loss(
                logprobs[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], denominator=5
            )[0]
        )
        for i in range(2)
    )
    assert whole.item() == pytest.approx(parts)


def test_approximate_kl() -> None:
    _, sums, _ = _loss([1.5], 1.0)
    assert sums.approx_kl == pytest.approx(0.5 - math.log(1.5))  # r - 1 - log r
    _, same, _ = _loss([1.0, 1.0], 1.0)
    assert same.approx_kl == 0


def test_entropy_of_uniform_and_certain_distributions() -> None:
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    assert token_entropy(logits)[0].tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)


def test_the_denominator_must_be_positive() -> None:
    with pytest.raises(ValueError, match="denominator"):
        policy_loss(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.zeros(1, 1), denominator=0
        )


def test_gspo_clips_the_geometric_mean_ratio_of_each_sequence() -> None:
    # A (advantage +1): token ratios 1.5, 1.0 -> s = sqrt(1.5) = 1.2247, inside [0.8, 1.28]:
    # -1.2247. B (advantage -1): ratios 0.5, 1.1 and a tool token (mask 0, ratio 50) ->
    # s = sqrt(0.55) = 0.7416, below 0.8: max(0.7416, 0.8) = 0.8. Over the step's 2 sequences.
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[1.5, 1.0, 1.0], [0.5, 50.0, 1.1]])).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    loss, sums = sequence_loss(
        new, old, torch.tensor([1.0, -1.0]), mask, denominator=2, clip_low=0.2, clip_high=0.28
    )
    assert loss.item() == pytest.approx((-math.sqrt(1.5) + 0.8) / 2, rel=1e-5)
    assert sums.clipped_tokens == 2  # B's two tokens
    loss.backward()
    # d/dlogp_t of -s A / 2 with s = exp(mean of 2 log ratios): -s / (2 * 2) on A's tokens;
    # B is clipped: no gradient
    a = -math.sqrt(1.5) / 4
    grad = new.grad.flatten().tolist()  # type: ignore[union-attr]
    assert grad == pytest.approx([a, a, 0.0, 0.0, 0.0, 0.0], abs=1e-6)


def test_gspo_differs_from_the_token_loss_where_ratios_spread() -> None:
    # one sequence, ratios 2.0 and 0.5, A = +1, clip [0.8, 1.28]: token-level
    # (-1.28 - 0.5) / 2 = -0.89; sequence-level s = sqrt(2 * 0.5) = 1: -1
    new, old = torch.log(torch.tensor([[2.0, 0.5]])), torch.zeros(1, 2)
    mask, adv = torch.ones(1, 2), torch.tensor([1.0])
    assert policy_loss(new, old, adv, mask, denominator=2, clip_low=0.2, clip_high=0.28)[
        0
    ].item() == pytest.approx(-0.89)
    assert sequence_loss(new, old, adv, mask, denominator=1, clip_low=0.2, clip_high=0.28)[
        0
    ].item() == pytest.approx(-1.0)
    assert (LOSSES["token"].per, LOSSES["gspo"].per) == ("token", "sequence")


def test_gspo_refuses_token_weights_and_skips_empty_rows() -> None:
    with pytest.raises(ValueError, match="per-token weights"):
        sequence_loss(
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.ones(1),
            torch.ones(1, 1),
            denominator=1,
            weights=torch.ones(1, 1),
        )
    # a row with no policy token (all masked) adds nothing, whatever its advantage
    loss, _ = sequence_loss(
        torch.zeros(2, 2),
        torch.zeros(2, 2),
        torch.tensor([1.0, 5.0]),
        torch.tensor([[1, 1], [0, 0]]),
        denominator=1,
    )
    assert loss.item() == pytest.approx(-1.0)


def test_gspo_dual_clip_caps_a_negative_advantage_at_c_times_it() -> None:
    # s = 4 (both tokens ratio 4), A = -2: max(8, 2.56) = 8, capped at -c A = 6; A = +0.5 with
    # s = 1 is untouched: -0.5
    new = torch.log(torch.tensor([[4.0, 4.0], [1.0, 1.0]]))
    loss, _ = sequence_loss(
        new,
        torch.zeros(2, 2),
        torch.tensor([-2.0, 0.5]),
        torch.ones(2, 2),
        denominator=1,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
    )
    assert loss.item() == pytest.approx(6.0 - 0.5)
    plain, _ = sequence_loss(
        new[:1],
        torch.zeros(1, 2),
        torch.tensor([-2.0]),
        torch.ones(1, 2),
        denominator=1,
        clip_low=0.2,
        clip_high=0.28,
    )
    assert plain.item() == pytest.approx(8.0)


def test_gspo_clips_above_and_counts_a_one_token_sequence() -> None:
    # s = sqrt(2 x 2) = 2 with A = +1: clipped at 1.28; a one-token sequence with ratio 1.1 and
    # A = +1: s = 1.1 (its own ratio), kept: (-1.28 - 1.1) / 2
    new = torch.log(torch.tensor([[2.0, 2.0], [1.1, 1.0]]))
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = sequence_loss(
        new,
        torch.zeros(2, 2),
        torch.tensor([1.0, 1.0]),
        mask,
        denominator=2,
        clip_low=0.2,
        clip_high=0.28,
    )
    assert loss.item() == pytest.approx((-1.28 - 1.1) / 2)


def test_gspo_clips_by_its_own_ranges_unless_told() -> None:
    # s = 1.001 with A = +1 under GSPO's default range [1 - 3e-4, 1 + 4e-4]: -1.0004; with
    # A = -1 and s = 0.999: max(0.999, 0.9997) = 0.9997
    up, _ = sequence_loss(
        torch.log(torch.tensor([[1.001]])),
        torch.zeros(1, 1),
        torch.tensor([1.0]),
        torch.ones(1, 1),
        denominator=1,
    )
    assert up.item() == pytest.approx(-1.0004, abs=1e-7)
    down, _ = sequence_loss(
        torch.log(torch.tensor([[0.999]])),
        torch.zeros(1, 1),
        torch.tensor([-1.0]),
        torch.ones(1, 1),
        denominator=1,
    )
    assert down.item() == pytest.approx(0.9997, abs=1e-7)


def test_behaviour_weights_by_hand() -> None:
    # proximal -0.5, -1.0 against behaviour -1.0, -0.2 (the first token is a prompt token):
    # exp(0.5) = 1.65 capped at 1.5; exp(-0.8) = 0.449
    weights = behaviour_weights([0.0, -0.5, -1.0], [0.0, -1.0, -0.2], [0, 1, 1], cap=1.5)
    assert weights == pytest.approx([0.0, 1.5, math.exp(-0.8)])
    assert behaviour_weights([-3.0], [-1.0], [1], cap=1.5) == pytest.approx([math.exp(-2.0)])
