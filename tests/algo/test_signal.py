"""`expected_signal` and `sampled_per_step`: what a screen says of RL's groups, worked by hand."""

import pytest

from codeloop.algo.group import expected_signal, sampled_per_step


def test_a_screen_as_spread_as_chance_leaves_each_problem_at_the_screens_mean() -> None:
    # 32 problems x 4 samples: 12 never solved, 8 once, 12 twice. Mean 0.25, variance
    # 0.046875 = 0.25 x 0.75 / 4, the binomial's: no spread between problems beyond chance, so
    # a problem kept at 1 in 4 is a problem at 0.25, and a group of 16 lacks signal only when
    # all 16 agree: 0.75^16 + 0.25^16 = 0.0100
    screened = [0.0] * 12 + [0.25] * 8 + [0.5] * 12
    assert expected_signal(screened, [0.25], 4, 16) == pytest.approx(0.9900, abs=1e-3)


def test_a_screen_of_all_or_nothing_problems_keeps_its_kept_rates() -> None:
    # half solved 0 of 4, half 4 of 4: the spread is all between problems (a flat prior), so a
    # problem kept at 2 of 4 has the posterior Beta(2, 2), and E[q^16] = B(18, 2) / B(2, 2) =
    # (1 / 342) / (1 / 6): signal in 1 - 2 x 6 / 342 = 0.9649 of groups
    screened = [0.0] * 50 + [1.0] * 50
    assert expected_signal(screened, [0.5], 4, 16) == pytest.approx(1 - 12 / 342, abs=1e-3)


def test_problems_solved_once_by_chance_are_expected_rarely_solved_again() -> None:
    # 95 of 100 never solved, 5 once in 4: at a 1.25% mean the five are chance; each is near
    # 1.3% after, and a group of 16 has signal in about 1 - 0.987^16 = 0.19 of them (their
    # own rate of 0.25 would say 0.99)
    screened = [0.0] * 95 + [0.25] * 5
    assert expected_signal(screened, [0.25] * 5, 4, 16) == pytest.approx(0.19, abs=0.01)
    assert expected_signal([0.0] * 10, [0.0], 4, 16) == 0.0  # nothing solved: no signal


def test_a_step_samples_the_shortfall_again_for_four_rounds_at_most() -> None:
    assert sampled_per_step(1.0) == 1.0
    assert sampled_per_step(0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert sampled_per_step(0.0) == 4.0
