import math

import pytest

from codeloop.eval.metrics import majority_correct, pass_at_k, summarise


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (4, 1, 1, 0.25),  # pass@1 is the fraction correct
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 1, 3, 0.6),  # 1 - C(4,3)/C(5,3) = 1 - 4/10
        (10, 3, 5, 1 - 21 / 252),  # C(7,5) = 21, C(10,5) = 252
        (16, 0, 16, 0.0),
        (16, 1, 16, 1.0),
        (8, 6, 3, 1.0),  # fewer than k wrong samples: some correct one is always drawn
    ],
)
def test_unbiased_pass_at_k(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_matches_the_binomial_formula_on_large_n() -> None:
    n, c, k = 200, 37, 10
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, 1, 0), (4, 1, 5), (3, -1, 1)])
def test_pass_at_k_rejects_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


def test_majority_vote() -> None:
    assert majority_correct(["5", "5", "6"], [True, True, False])
    assert not majority_correct(["6", "5", "6"], [False, True, False])
    assert majority_correct(["5", "6"], [True, False])  # a tie goes to the answer seen first
    assert not majority_correct(["6", "5"], [False, True])
    assert majority_correct([None, None, "5"], [False, False, True])  # no answer, no vote
    assert not majority_correct([None, None], [False, False])


def test_summary() -> None:
    problems = [[True, False, False, False], [True, True, True, True], [False] * 4]
    summary = summarise(problems, k_values=(1, 2))
    assert summary["pass@1"] == pytest.approx((0.25 + 1 + 0) / 3)  # avg@4
    assert summary["pass@2"] == pytest.approx((0.5 + 1 + 0) / 3)
    with pytest.raises(ValueError, match="no problems"):
        summarise([])
