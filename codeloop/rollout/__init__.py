"""Turning a problem into trajectories.

Built: `toolcall` (parse calls, format observations), `prompt` (chat-template-driven prompt and
tool-response tokens), `engine` (the `Engine` protocol), `agent` (the multi-turn loop),
`hf_engine` (in-process transformers engine with dynamic batching and in-place weight updates),
`openai_engine` (any OpenAI-compatible completions server), `server` (`codeloop serve`),
`scheduler` (static / least outstanding / KV-aware), `bench_scheduler`.
Not built yet (issue 4): `codeloop bench rollout`; vLLM's weight-reload routes; live KV readings
from real servers' /metrics for the scheduler.
"""
