"""Binary answer-only reward: extract the final answer, compare it with the gold answer.

- `extract`: the final answer of the assistant's own text, with reason codes.
- `integer`: plain numbers and ratios, read exactly (no tolerance, no percentage rule).
- `fastpath`: the cheap decisions taken in the caller (numbers, strings, tuples, sets, intervals).
- `symbolic`: equivalence for everything else (math-verify with exact decimals, `\\pm`).
- `workers`, `zygote`: the killable processes that run `symbolic` under a deadline per item.
- `verifier`: `Verifier.score` / `score_batch` and module-level `score` / `score_batch`.
- `agreement`: the labelled cases; `codeloop bench reward` (`codeloop/bench/reward.py`) scores
  them against plain math-verify.
"""

from codeloop.reward.verifier import RewardResult, Verdict, Verifier, score, score_batch

__all__ = ["RewardResult", "Verdict", "Verifier", "score", "score_batch"]
