"""Turning a problem into trajectories.

`toolcall` (parse calls, format observations), `prompt` (chat-template-driven prompt and
tool-response tokens), `engine` (the `Engine` protocol), `agent` (the multi-turn loop),
`hf_engine` (in-process transformers engine with continuous batching and in-place weight
updates), `slot_cache` (its KV cache of fixed slots and CUDA-graph decoding on a GPU),
`openai_engine` (any OpenAI-compatible completions server), `server` (`codeloop serve`),
`scheduler` (static / least outstanding / KV-aware), `tools` (the tools an agent may call),
`collect` (problems to scored trajectories). The benchmarks are in `codeloop/bench/`.
"""
