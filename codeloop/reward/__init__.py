"""Binary answer-only reward: extract the final answer, compare it with the gold answer.

- `extract`: the final answer of the assistant's own text, with reason codes.
- `integer`: the exact fast path for plain numbers (no tolerance, no percentage rule).
- `symbolic`: equivalence for everything else (math-verify with exact decimals, `\\pm`).
- `workers`: the killable processes that run `symbolic` under a hard deadline per item.
- `verifier`: `Verifier.score` / `score_batch` and module-level `score` / `score_batch`.
"""

from codeloop.reward.verifier import RewardResult, Verdict, Verifier, score, score_batch

__all__ = ["RewardResult", "Verdict", "Verifier", "score", "score_batch"]
