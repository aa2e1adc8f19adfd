"""Turning a problem into trajectories: the agent side of sampling.

`toolcall` (parse calls, format observations), `prompt` (chat-template-driven prompt and
tool-response tokens), `tools` (the tools an agent may call, and the `ToolExecutor` that runs
them), `agent` (the multi-turn loop), `collect` (problems to scored trajectories), `stats`
(what a batch of trajectories did). The engines that sample tokens are in `codeloop/engine/`;
the benchmarks in `codeloop/bench/`.
"""
