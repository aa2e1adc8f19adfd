"""`codeloop bench rollout`: trajectories/s of the in-process transformers engine.

A randomly initialised model of the chosen size rolls out `--trajectories` concurrent
trajectories of `--tokens` sampled tokens each (no tool calls: the agent loop stops at the
budget), once with dynamic batching (`--max-batch`) and once one request at a time (the
baseline, `max_batch=1`), in the same run. Prints trajectories/s, sampled tokens/s and the
ratio; writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import torch

from codeloop.config import RolloutConfig
from codeloop.rollout.agent import run_trajectory
from codeloop.rollout.hf_engine import TransformersEngine
from codeloop.rollout.prompt import PromptFormat
from codeloop.types import ExecRequest, ExecResult, ExecStatus


class _NoTools:
    async def execute(self, request: ExecRequest) -> ExecResult:
        return ExecResult(ExecStatus.OK)


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
    parser.add_argument("--tokens", type=int, default=64, help="sampled tokens per trajectory")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=32)
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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args), "rows": rows, "ratio": ratio}
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0
