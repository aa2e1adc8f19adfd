"""Sampling tokens: the inference engines and what places calls on them.

`protocol` (the `Engine` protocol, its value types and the capabilities an engine may declare),
`hf_engine` (the in-process transformers engine with continuous batching and in-place weight
updates; `engine_from_config` builds it for training, evaluation and `codeloop serve`),
`sampler` (vectorised, seeded sampling), `stops` (end-of-turn tokens and stop strings),
`slot_cache` (its KV cache of fixed slots and CUDA-graph decoding on a GPU), `kv_batch` (the
padded `DynamicCache` batch and the prefix cache), `attention` (decoding attention on a CPU),
`model` (loading a model and its tokenizer), `openai_engine` (any OpenAI-compatible completions
server), `server` (`codeloop serve`), `scheduler` (static / least outstanding / KV-aware over
several engines). The engine knows token ids, not prompts or tools: those are `codeloop/rollout/`'s.
"""
