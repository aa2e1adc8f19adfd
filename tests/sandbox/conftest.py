"""The fixtures of sandbox_helpers.py (helpers live there under a unique module name, so that
test files import them whatever directories a pytest run collects)."""

from sandbox_helpers import sandbox  # noqa: F401
