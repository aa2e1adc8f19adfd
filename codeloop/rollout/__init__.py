"""Turning a problem into trajectories.

Built: `toolcall` (parse calls, format observations), `prompt` (chat-template-driven prompt and
tool-response tokens), `engine` (the `Engine` protocol), `agent` (the multi-turn loop),
`hf_engine` (in-process transformers engine with dynamic batching and in-place weight updates).
Not built yet (issue 4): the OpenAI-compatible engine, `codeloop serve`, the scheduler.
"""
