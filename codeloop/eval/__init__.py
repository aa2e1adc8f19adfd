"""Evaluation. Built: `metrics` (avg@k, unbiased pass@k, maj@k, per-problem summaries).
Not built yet (issue 7): `codeloop eval`, the viewer, entropy analysis."""
