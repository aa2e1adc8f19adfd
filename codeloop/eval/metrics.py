"""Evaluation metrics over k samples per problem. Pure functions.

- avg@k (pass@1): the mean correctness of the k samples, averaged over problems.
- pass@k, unbiased (Chen et al., 2021): with n samples of which c are correct,
  1 - C(n - c, k) / C(n, k), computed as a product to stay exact and stable.
- maj@k: whether the most frequent extracted answer among the k samples is correct (ties go
  to the answer seen first; samples without an answer do not vote).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    missing = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) = prod (1 - k / i)
        missing *= 1.0 - k / i
    return 1.0 - missing


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """maj@k for one problem: is the most voted answer one of the correct ones?"""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)
    return any(ok for a, ok in zip(answers, correct, strict=True) if a == winner)


def summarise(
    per_problem: Sequence[Sequence[bool]], k_values: Sequence[int] = (1,)
) -> dict[str, float]:
    """pass@k over problems, each given as the correctness of its n samples (pass@1 is avg@n)."""
    if not per_problem:
        raise ValueError("summarise: no problems")
    return {
        f"pass@{k}": sum(pass_at_k(len(s), sum(s), k) for s in per_problem) / len(per_problem)
        for k in k_values
    }
