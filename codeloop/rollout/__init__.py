"""Turning a problem into trajectories.

Built: `toolcall` (parse calls, format observations), `prompt` (chat-template-driven prompt and
tool-response tokens), `engine` (the `Engine` protocol), `agent` (the multi-turn loop).
Not built yet (issue 4): the transformers and OpenAI-compatible engines, `codeloop serve`, the
scheduler.
"""
