"""The fixtures of eval_helpers.py (helpers live there under a unique module name, so that
test files import them whatever directories a pytest run collects)."""

from eval_helpers import fmt, scripted_run  # noqa: F401
