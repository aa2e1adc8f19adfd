"""Training: model loading (`model`), token batches and logprobs (`batch`), SFT (`sft`), the
GRPO-RoC RL loop (`rl`), checkpoints with exact resume (`checkpoint`), logs (`logs`)."""
