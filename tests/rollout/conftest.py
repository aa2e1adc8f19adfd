"""The fixtures of tests/rollout_helpers.py (helpers live under a unique module name, so that
test files import them whatever directories a pytest run collects)."""

from rollout_helpers import fmt  # noqa: F401
