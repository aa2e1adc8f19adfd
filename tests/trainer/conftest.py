"""The fixtures of trainer_helpers.py (helpers live there under a unique module name, so that
test files import them whatever directories a pytest run collects)."""

from trainer_helpers import sft_weights, trainer_fmt  # noqa: F401
