"""Training: model loading (`model`), token batches and logprobs (`batch`), SFT (`sft`), the
GRPO-RoC RL loop (`rl`: `build_run`, `RLRun`) over a group source (`groups`: synchronous;
`async_rl`: asynchronous), the rollout side it samples with (`rollout_side`) and the weight sinks
that update it (`weights`), the learner (`learner`), the run state (`state`), checkpoints with
exact resume (`checkpoint`), logs (`logs`), torchrun/FSDP2 (`distributed`)."""
