"""GRPO-RoC as pure functions: `resample` (Resample-on-Correct), `advantage` (GRPO), `loss`
(token-level clipped surrogate). No engine, no trainer: values and tensors in, values out."""
