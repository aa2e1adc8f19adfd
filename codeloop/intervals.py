"""How sure a score is: 95% intervals for avg@k and for the difference between two policies.

A benchmark score is a mean over problems of each problem's share of correct samples. The k
samples of one problem are not independent draws (they share the problem), so the unit of
resampling is the problem, with its k samples kept together:

- `interval`: percentile bootstrap over problems (problems drawn with replacement, the mean of
  their per-problem scores taken, `RESAMPLES` times, seeded so that a summary is reproducible).
  Unlike mean +- 1.96 standard errors it stays inside [0, 1] and is not symmetric near 0.
- `compare`: the paired difference over the problems both results scored (B - A, each problem's
  score in B minus its score in A): a bootstrap interval as above, and a two-sided p-value from a
  sign-flip permutation test (under "no difference" each problem's difference is as likely to
  have either sign). A difference is called one only when its interval leaves out 0 and p is
  below 0.05; otherwise it is reported as inside the noise. (Over a handful of problems the
  bootstrap interval is too narrow, and the permutation test, exact in small samples, is what
  holds the claim back: five problems all won by B give p = 1/8.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

LEVEL = 0.95
RESAMPLES = 10_000
METHOD = "95% percentile bootstrap over problems (the k samples of a problem kept together)"


def _blocks(n: int) -> list[int]:
    """`RESAMPLES` cut into blocks of at most ~2M values of `n` problems each: a resampling
    matrix of 10,000 x 50,000 problems would take 4 GB at once."""
    size = max(1, 2_000_000 // max(n, 1))
    return [min(size, RESAMPLES - start) for start in range(0, RESAMPLES, size)]


def interval(scores: Sequence[float], seed: int = 0) -> tuple[float, float]:
    """The 95% interval of the mean of per-problem `scores` (shares correct, or differences)."""
    if not scores:
        raise ValueError("interval: no problems")
    values = np.asarray(scores, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.concatenate(
        [
            values[rng.integers(0, len(values), (rows, len(values)))].mean(axis=1)
            for rows in _blocks(len(values))
        ]
    )
    low, high = np.quantile(means, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(low), float(high)


def compare(a: Mapping[str, float], b: Mapping[str, float], seed: int = 0) -> dict[str, Any]:
    """B - A over the problems both scored: means, difference, its 95% interval and p-value."""
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("compare: the two results share no problem")
    diffs = np.array([b[i] - a[i] for i in common])
    low, high = interval(diffs.tolist(), seed)
    rng = np.random.default_rng(seed + 1)
    signs = np.array([-1.0, 1.0])
    flipped = np.concatenate(
        [
            np.abs((rng.choice(signs, (rows, len(common))) * diffs).mean(axis=1))
            for rows in _blocks(len(common))
        ]
    )
    observed = abs(float(diffs.mean()))
    p_value = float((np.count_nonzero(flipped >= observed - 1e-12) + 1) / (RESAMPLES + 1))
    return {
        "problems": len(common),
        "only_in_a": len(set(a) - set(b)),
        "only_in_b": len(set(b) - set(a)),
        "a": float(np.mean([a[i] for i in common])),
        "b": float(np.mean([b[i] for i in common])),
        "difference": float(diffs.mean()),
        "interval95": [float(low), float(high)],
        "p_value": p_value,
        "method": "paired over problems: " + METHOD + "; p from a sign-flip permutation test",
    }


def percent(value: float, bounds: Sequence[float]) -> str:
    """`12.5% [9.0, 16.5]`: a score and its interval, in percent."""
    return f"{100 * value:.1f}% [{100 * bounds[0]:.1f}, {100 * bounds[1]:.1f}]"


def verdict(result: Mapping[str, Any], a_name: str = "A", b_name: str = "B") -> str:
    """One sentence on a `compare` result that never calls noise a result."""
    low, high = result["interval95"]
    points = (
        f"{100 * result['difference']:+.1f} points, 95% interval "
        f"[{100 * low:+.1f}, {100 * high:+.1f}], p = {result['p_value']:.2g}, "
        f"{result['problems']} problems"
    )
    shown = result["p_value"] < 1 - LEVEL
    if shown and low > 0:
        return f"{b_name} is better than {a_name}: {points}"
    if shown and high < 0:
        return f"{b_name} is worse than {a_name}: {points}"
    return f"no difference shown between {a_name} and {b_name} (inside the noise): {points}"
