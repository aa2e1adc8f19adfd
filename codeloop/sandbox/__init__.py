"""Code execution for model-written Python (placeholder docstring, rewritten below)."""
