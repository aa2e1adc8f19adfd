"""Evaluation: `metrics` (avg@k, unbiased pass@k, maj@k, per-problem summaries), `passrate`
(pass rates of a policy over problems, for refiltering and data curation), `evaluate`
(`codeloop eval`: a model in-process or behind servers, resumable, results and trajectories on
disk), `entropy` (token entropies, after tool responses and elsewhere), `viewer`
(`codeloop view`: one self-contained HTML page of a run's trajectories and curves)."""
