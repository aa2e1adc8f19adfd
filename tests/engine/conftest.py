"""The fixtures of rollout_helpers.py (a tokenizer trained here and its prompt format)."""

from rollout_helpers import fmt  # noqa: F401
