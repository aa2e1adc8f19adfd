"""codeloop: agentic reinforcement learning of language models that reason with a Python tool.

Importing the package has no side effects and imports nothing heavy; see docs/design.md for the map.
"""

from codeloop.errors import CodeloopError

__version__ = "0.1.0"
__all__ = ["CodeloopError", "__version__"]
