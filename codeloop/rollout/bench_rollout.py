"""`codeloop bench rollout`: trajectories/s of the in-process transformers engine.

A randomly initialised model of the chosen size rolls out `--trajectories` concurrent
trajectories of `--tokens` sampled tokens each (no tool calls: the agent loop stops at the
budget), once with dynamic batching (`--max-batch`) and once one request at a time (the
baseline, `max_batch=1`), in the same run.

Then tool calls: each trajectory samples `--tool-turns` + 1 turns from the same model, each of
1 to 2 x `--tokens` - 1 tokens (uniform, seeded), and every turn but the last ends in a tool
call (its tokens appended to the sampled ones) that the real local sandbox runs: a
`time.sleep` of 0 to 2 x `--tool-s` seconds (uniform, seeded per trajectory and turn).
Overlapped is the agent loop as it is: a trajectory waiting on its tool call leaves the engine
to the others. Serialised is the baseline where the rollout stops while a tool call runs (as
a loop that calls its sandbox synchronously does): a call waits for the generations in flight
to end, and no generation starts until the calls in flight end.
Prints trajectories/s, sampled tokens/s and the ratios; writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import torch

from codeloop.config import RolloutConfig, SandboxConfig
from codeloop.rollout.agent import run_trajectory
from codeloop.rollout.engine import Engine, Generation, SamplingParams, ToolExecutor
from codeloop.rollout.hf_engine import TransformersEngine
from codeloop.rollout.prompt import PromptFormat
from codeloop.types import ExecRequest, ExecResult, ExecStatus

T = TypeVar("T")
TURN_SEED = 1000  # trajectory i samples turn t with seed i * TURN_SEED + t


class _NoTools:
    async def execute(self, request: ExecRequest) -> ExecResult:
        return ExecResult(ExecStatus.OK)


class _Gate:
    """Serialised: tool calls wait for running generations to end and hold new ones back."""

    def __init__(self, serialised: bool) -> None:
        self.serialised = serialised
        self.generating = self.tools = 0
        self.changed = asyncio.Condition()

    async def run(self, tool: bool, work: Awaitable[T]) -> T:
        if not self.serialised:
            return await work
        async with self.changed:
            await self.changed.wait_for(lambda: not (self.generating if tool else self.tools))
            self.tools, self.generating = self.tools + tool, self.generating + (not tool)
        try:
            return await work
        finally:
            async with self.changed:
                self.tools, self.generating = self.tools - tool, self.generating - (not tool)
                self.changed.notify_all()


class _ToolCalling:
    """The model samples each turn; every turn but the last ends in a fixed tool call."""

    def __init__(self, engine: Engine, fmt: PromptFormat, tool_turns: int, tool_s: float,
                 gate: _Gate) -> None:  # fmt: skip
        self.engine, self.fmt, self.tool_turns, self.tool_s, self.gate = (
            engine, fmt, tool_turns, tool_s, gate)  # fmt: skip
        self.tag_ids = set(fmt.encode("<tool_call>") + fmt.encode("</tool_call>"))

    def call_ids(self, seed: int) -> list[int]:
        """A call that sleeps uniformly 0 to 2 x `tool_s` (seeded by trajectory and turn)."""
        seconds = random.Random(seed).uniform(0, 2 * self.tool_s)
        code = f"import time\ntime.sleep({seconds:.3f})\nprint('done')"
        return self.fmt.encode(
            '<tool_call>{"name": "execute_python_code_with_standard_io", '
            '"arguments": {"code": ' + json.dumps(code) + "}}</tool_call>"
        )

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        tokens = random.Random(-(params.seed or 0)).randint(1, 2 * params.max_tokens - 1)
        plain = SamplingParams(tokens, params.temperature, params.top_p, [], params.seed)
        generation = await self.gate.run(False, self.engine.generate(prompt_ids, plain))
        seed = params.seed or 0
        if seed % TURN_SEED >= self.tool_turns:
            return generation
        ids, logprobs, call = generation.token_ids, generation.logprobs, self.call_ids(seed)
        cut = next((i for i, t in enumerate(ids) if t in self.tag_ids), len(ids))  # a random
        return Generation(ids[:cut] + call,  # model can sample a tag: keep the call whole
                          logprobs[:cut] + [0.0] * len(call), "stop")  # fmt: skip


class _GatedTools:
    def __init__(self, tools: ToolExecutor, gate: _Gate) -> None:
        self.tools, self.gate = tools, gate

    async def execute(self, request: ExecRequest) -> ExecResult:
        result: ExecResult = await self.gate.run(True, self.tools.execute(request))
        return result


async def _measure_tools(engine: TransformersEngine, fmt: PromptFormat, args: argparse.Namespace,
                         serialised: bool) -> dict[str, float]:  # fmt: skip
    from codeloop.sandbox.pool import LocalSandbox

    gate = _Gate(serialised)
    wrapped = _ToolCalling(engine, fmt, args.tool_turns, args.tool_s, gate)
    cfg = RolloutConfig(max_response_tokens=100_000, max_turns=args.tool_turns + 1,
                        max_tokens_per_turn=args.tokens)  # fmt: skip
    prompt = fmt.prompt_ids("What is 123 + 456?")
    sandbox_cfg = SandboxConfig(workers=args.trajectories, timeout_s=2 * args.tool_s + 10,
                                preload=[])  # fmt: skip
    async with LocalSandbox(sandbox_cfg) as sandbox:
        tools = _GatedTools(sandbox, gate)
        start = time.perf_counter()
        runs = [run_trajectory(wrapped, tools, fmt, cfg, "p", i, prompt, seed=i * TURN_SEED)
                for i in range(args.trajectories)]  # fmt: skip
        trajectories = await asyncio.gather(*runs)
        seconds = time.perf_counter() - start
    calls = [r for t in trajectories for r in t.tool_calls]
    expected, ok = args.trajectories * args.tool_turns, sum(not r.failed for r in calls)
    if len(calls) != expected or ok != expected:
        failed = next((r.result for r in calls if r.failed), None)
        raise RuntimeError(f"{ok} of {len(calls)} tool calls succeeded; expected {expected}; "
                           f"a failure: {failed}")  # fmt: skip
    sampled = sum(sum(m and lp != 0.0 for m, lp in zip(t.loss_mask, t.logprobs, strict=True))
                  for t in trajectories)  # fmt: skip
    return {"seconds": seconds, "trajectories_per_s": args.trajectories / seconds,
            "tokens_per_s": sampled / seconds, "tool_calls": len(calls)}  # fmt: skip


async def _measure(
    engine: TransformersEngine, fmt: PromptFormat, n: int, tokens: int
) -> dict[str, float]:
    cfg = RolloutConfig(max_response_tokens=tokens, max_turns=1)
    prompt = fmt.prompt_ids("What is 123 + 456?")
    start = time.perf_counter()
    runs = [run_trajectory(engine, _NoTools(), fmt, cfg, "p", i, prompt, seed=i) for i in range(n)]
    trajectories = await asyncio.gather(*runs)
    seconds = time.perf_counter() - start
    sampled = sum(sum(t.loss_mask) for t in trajectories)
    return {
        "seconds": seconds,
        "trajectories_per_s": n / seconds,
        "tokens_per_s": sampled / seconds,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="codeloop bench rollout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32, help="sampled tokens per turn")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--tool-turns", type=int, default=2, help="tool calls per trajectory")
    parser.add_argument("--tool-s", type=float, default=1.0, help="mean seconds of a tool call")
    parser.add_argument("--out", default="bench-results/rollout.json")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, LlamaConfig

    from codeloop.data.tokenizer import train_tokenizer

    fmt = PromptFormat(train_tokenizer(["What is 123 + 456? print(123 + 456)"] * 50, 300))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fmt.tokenizer), hidden_size=args.hidden,
                         intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)  # random weights: speed, not quality
    rows: dict[str, Any] = {}
    for name, max_batch in (("one_at_a_time", 1), ("batched", args.max_batch)):
        engine = TransformersEngine(model, fmt.tokenizer, set(), max_batch=max_batch)
        with torch.no_grad():
            rows[name] = asyncio.run(_measure(engine, fmt, args.trajectories, args.tokens))
        row = rows[name]
        print(f"{name:14} {row['trajectories_per_s']:8.2f} trajectories/s "
              f"{row['tokens_per_s']:9.1f} tokens/s ({row['seconds']:.1f} s)")  # fmt: skip
    ratio = rows["batched"]["tokens_per_s"] / rows["one_at_a_time"]["tokens_per_s"]
    print(f"batched / one at a time: {ratio:.1f}x")
    print(f"with {args.tool_turns} tool calls per trajectory, {args.tool_s} s each on average:")
    engine = TransformersEngine(model, fmt.tokenizer, set(), max_batch=args.max_batch)
    for name, serialised in (("tools_serialised", True), ("tools_overlapped", False)):
        with torch.no_grad():
            rows[name] = asyncio.run(_measure_tools(engine, fmt, args, serialised))
        row = rows[name]
        print(f"{name:17} {row['trajectories_per_s']:8.2f} trajectories/s "
              f"{row['tokens_per_s']:9.1f} tokens/s ({row['seconds']:.1f} s)")  # fmt: skip
    overlap = (
        rows["tools_overlapped"]["trajectories_per_s"]
        / rows["tools_serialised"]["trajectories_per_s"]
    )
    print(f"overlapped / serialised: {overlap:.1f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args), "rows": rows, "ratio": ratio, "overlap_ratio": overlap}
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0
