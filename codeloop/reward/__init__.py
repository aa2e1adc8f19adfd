"""Binary answer-only reward: extract the final answer, compare it with the gold answer.

Built so far: `extract` (final-answer extraction with reason codes) and `integer` (the exact
integer fast path). Not built yet (issue 3): the symbolic path for non-integer golds in
killable worker processes with deadlines, `score`/batch scoring, and `codeloop bench reward`.
"""
