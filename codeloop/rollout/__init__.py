"""Turning a problem into trajectories.

`toolcall` (parse calls, format observations), `prompt` (chat-template-driven prompt and
tool-response tokens), `engine` (the `Engine` protocol), `agent` (the multi-turn loop),
`hf_engine` (in-process transformers engine with continuous batching and in-place weight
updates), `static_engine` (the static-batch engine it replaced, a benchmark baseline),
`openai_engine` (any OpenAI-compatible completions server), `server` (`codeloop serve`),
`scheduler` (static / least outstanding / KV-aware), `bench_scheduler`, `bench_rollout`.
"""
