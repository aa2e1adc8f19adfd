"""`codeloop bench rollout --against vllm`: the bench's workloads again through a live vLLM
(`make vllm`), on the same model, prompts and sampling settings, in the same run.

The model the bench measured (its float32 weights; a tied output layer written as its own
tensor, as RL's reloads write it) is saved beside `--out` and served by vLLM in `--dtype`, with
`--max-batch` sequences at most, its model's threads on every core the bench may use (as
codeloop's; `--vllm-cores auto`: vLLM's own choice, which keeps one core of two for its API
server) and vLLM's own defaults otherwise (its compiled model; `--vllm-eager` leaves
compilation out). vLLM runs only after codeloop's rows are measured, and
codeloop's engine is idle while vLLM's are, so neither runs beside the other. Rows:

- `vllm`: plain generation, the same requests as `continuous` (the same seeds: vLLM's sampler
  draws its own numbers, so the tokens differ, their count does not: no stop strings, and
  `ignore_eos`, as codeloop's engine in the bench stops at no token);
- `vllm_tools`: the agent workload as `tools_overlapped`, through codeloop's agent loop and
  sandbox, the requests sent as token ids (`rollout.server = "vllm"`);
- first token: one request of one token at a time on an idle server (the median of
  FIRST_TOKEN_RUNS distinct prompts): the prefill of a prompt alone, for each engine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from codeloop.engine.openai_engine import OpenAIEngine
from codeloop.engine.protocol import Engine, SamplingParams
from codeloop.engine.vllm_server import all_cores, running_vllm, vllm_python
from codeloop.rollout.prompt import PromptFormat

FIRST_TOKEN_RUNS = 5
WARM_UP_REQUESTS = 4  # short requests before vLLM's rows: its first ones pay lazy set-up


async def first_token_s(engine: Engine, fmt: PromptFormat) -> float:
    """The median seconds to one sampled token for FIRST_TOKEN_RUNS distinct prompts, one at a
    time (see the module docstring)."""
    times = []
    for i in range(FIRST_TOKEN_RUNS):
        prompt = fmt.prompt_ids(f"What is {91 * i + 7} divided by {i + 3}? Explain.")
        began = time.perf_counter()
        await engine.generate(prompt, SamplingParams(1, 0.6, 0.95, [], i))
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def save_served(model: Any, fmt: PromptFormat, path: Path) -> Path:
    """The model and tokenizer where vLLM serves them from (an untied output layer)."""
    from codeloop.trainer.weights import write_output_layer

    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    embedding = next((v for k, v in state.items() if k.endswith("embed_tokens.weight")), None)
    tied = bool(model.config.get_text_config().tie_word_embeddings)
    model.save_pretrained(path, state_dict=dict(state))
    fmt.tokenizer.save_pretrained(path)
    if tied and embedding is not None:
        write_output_layer(path, embedding)
    return path


def measure_vllm(
    model: Any,
    fmt: PromptFormat,
    prompts: list[list[int]],
    args: argparse.Namespace,
    *,
    plain: Callable[[Engine], Awaitable[dict[str, Any]]],
    agent: Callable[[Engine], Awaitable[dict[str, Any]]],
) -> dict[str, Any]:
    """vLLM's rows: `plain(engine)` and `agent(engine)` are the bench's own measurements
    (plain generation, the agent workload) awaited on vLLM; returns them with its first-token
    time, its start time and its log's path."""
    out = Path(args.out).parent
    served = save_served(model, fmt, out / "vllm-model")
    longest = max(len(p) for p in prompts) + args.gen_tokens
    agent_tokens = len(fmt.prompt_ids("What is 123 + 456?")) + (args.tool_turns + 1) * (
        2 * args.tokens + 200  # a turn's tokens and its call and response
    )
    log = out / "vllm.log"
    began = time.perf_counter()
    with running_vllm(
        vllm_python(args.vllm_python),
        served,
        log,
        kv_cache_gib=args.vllm_kv_gib,
        dtype=args.dtype,
        max_model_len=max(longest, agent_tokens, 1024),
        max_num_seqs=args.max_batch,
        eager=args.vllm_eager,
        cores="" if args.vllm_cores == "auto" else all_cores(),
    ) as server:
        url = server.url
        start_s = time.perf_counter() - began
        print(f"vLLM up in {start_s:.0f} s ({url}; its output: {log})", flush=True)
        # as codeloop's engine in the bench, vLLM samples every token asked for: no stop at
        # the end-of-sequence token either
        engine = OpenAIEngine(url, str(served), "vllm", extra_body={"ignore_eos": True})

        async def run() -> tuple[dict[str, Any], float]:
            try:
                params = [SamplingParams(8, 0.6, 0.95, [], i) for i in range(WARM_UP_REQUESTS)]
                await asyncio.gather(*(engine.generate(prompts[0], p) for p in params))
                rows = {"vllm": await plain(engine), "vllm_tools": await agent(engine)}
                return rows, await first_token_s(engine, fmt)
            finally:
                await engine.close()

        rows, first = asyncio.run(run())
    return {"rows": rows, "first_token_s": first, "start_s": start_s, "log": str(log)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--against",
        choices=("vllm",),
        default=None,
        help="also run plain generation and the agent workload through this server, started "
        "by the bench on the same model (vllm: `make vllm`'s environment)",
    )
    parser.add_argument(
        "--vllm-python",
        default="",
        help="the Python of vLLM's environment (default: $CODELOOP_VLLM_PYTHON, else "
        ".venv-vllm/bin/python)",
    )
    parser.add_argument("--vllm-kv-gib", type=float, default=2.0, help="vLLM's KV cache (GiB)")
    parser.add_argument(
        "--vllm-cores",
        choices=("all", "auto"),
        default="all",
        help="the cores vLLM's model runs on: all those the bench may use, as codeloop's "
        "engine, or auto: vLLM's own choice (on two cores it keeps one for its API server)",
    )
    parser.add_argument(
        "--vllm-eager",
        action="store_true",
        help="vLLM without compiling its model (a faster start, its default otherwise)",
    )
