"""`codeloop bench scheduler`: the three scheduling policies on simulated engines.

Each simulated engine behaves like a paged-KV server: it starts queued requests while their
contexts fit in its KV capacity, and every decode step emits one token per running request in
`step_ms x (1 + running / 64)`, plus the time of any prefill. A trajectory has a few turns of
heavy-tailed length separated by tool calls of a few milliseconds, and keeps its context in the
engine's KV cache while it lives (an idle prefix stays cached until evicted; a turn that misses
it prefills its whole context again). A running set that outgrows the KV capacity preempts its
newest request, which must prefill again later. The same seeded batch of trajectories is rolled
out under `static`, `least_outstanding` and `kv_aware` (reading the engines' KV use live); the
bench prints each makespan, its ratio to `static`, preemptions and prefilled tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codeloop.rollout.engine import Generation, SamplingParams
from codeloop.rollout.scheduler import POLICIES, Scheduler

PREFILL_PER_STEP = 256  # prompt tokens a prefill processes in the time of one decode step


@dataclass
class _Request:
    key: int  # the trajectory
    context: int  # tokens in the KV cache once prefilled
    tokens_left: int
    done: asyncio.Future[None]


class SimEngine:
    """A toy paged-KV engine: see the module docstring."""

    def __init__(self, capacity_tokens: int, step_ms: float) -> None:
        self.capacity_tokens, self.step_s = capacity_tokens, step_ms / 1000
        self.running: list[_Request] = []
        self.waiting: list[_Request] = []
        self.cached: OrderedDict[int, int] = OrderedDict()  # idle prefixes, least recent first
        self.preemptions = self.prefill_tokens = 0
        self._loop_task: asyncio.Task[None] | None = None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        done = asyncio.get_running_loop().create_future()
        self.waiting.append(_Request(prompt_ids[0], len(prompt_ids), params.max_tokens, done))
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._run())
        await done
        return Generation([0] * params.max_tokens, [0.0] * params.max_tokens, "stop")

    def _used(self) -> int:
        return sum(r.context for r in self.running)

    @property
    def kv_tokens_used(self) -> int:
        """KV demand the scheduler reads live: running contexts and queued prompts."""
        return self._used() + sum(r.context for r in self.waiting)

    def _admit(self) -> int:
        """Start waiting requests that fit; return the tokens they must prefill."""
        prefill = 0
        while self.waiting and self._used() + self.waiting[0].context < self.capacity_tokens:
            request = self.waiting.pop(0)
            prefill += request.context - min(self.cached.pop(request.key, 0), request.context)
            self.running.append(request)
        while self.cached and self._used() + sum(self.cached.values()) > self.capacity_tokens:
            self.cached.popitem(last=False)  # evict the least recent idle prefix
        return prefill

    async def _run(self) -> None:
        while self.running or self.waiting:
            prefill = self._admit()
            self.prefill_tokens += prefill
            step_s = self.step_s * (1 + len(self.running) / 64 + prefill / PREFILL_PER_STEP)
            await asyncio.sleep(step_s)
            for request in self.running:
                request.tokens_left -= 1
                request.context += 1
            while self._used() > self.capacity_tokens:  # out of KV: recompute the newest later
                victim = self.running.pop()
                self.waiting.insert(0, victim)
                self.preemptions += 1
            for request in [r for r in self.running if r.tokens_left <= 0]:
                self.running.remove(request)
                self.cached[request.key] = request.context
                request.done.set_result(None)


def _workload(n: int, seed: int) -> list[list[int]]:
    """Per trajectory, the tokens of each turn (heavy-tailed, as reasoning traces are)."""
    rng = random.Random(seed)
    return [[min(1000, int(rng.paretovariate(1.3) * 60)) for _ in range(rng.randint(1, 4))]
            for _ in range(n)]  # fmt: skip


async def _rollout(
    policy: str, workload: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    engines = [SimEngine(args.capacity, args.step_ms) for _ in range(args.engines)]
    scheduler = Scheduler(engines, policy, capacity_tokens=args.capacity)

    async def trajectory(key: int, turns: list[int]) -> None:
        async with scheduler.lease(args.prompt_tokens, args.budget) as engine:
            context = args.prompt_tokens
            for tokens in turns:
                await engine.generate([key] * context, SamplingParams(tokens))
                context += tokens
                await asyncio.sleep(args.tool_ms / 1000)  # the tool call

    start = time.perf_counter()
    await asyncio.gather(*(trajectory(k, turns) for k, turns in enumerate(workload)))
    return {"policy": policy, "makespan_s": time.perf_counter() - start,
            "preemptions": sum(e.preemptions for e in engines),
            "prefill_tokens": sum(e.prefill_tokens for e in engines)}  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="codeloop bench scheduler",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--capacity", type=int, default=16384, help="KV tokens per engine")
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--budget", type=int, default=4000, help="response budget per trajectory")
    parser.add_argument("--step-ms", type=float, default=0.5)
    parser.add_argument("--tool-ms", type=float, default=5.0)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", default="bench-results/scheduler.json")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'seed':>4} {'policy':18} {'makespan s':>10} {'vs static':>9} {'preempted':>9} "
          f"{'prefilled':>10}")  # fmt: skip
    for seed in range(args.seeds):
        workload = _workload(args.trajectories, seed)
        static_s = 0.0
        for policy in ("static", *[p for p in POLICIES if p != "static"]):
            row = asyncio.run(_rollout(policy, workload, args)) | {"seed": seed}
            static_s = static_s or row["makespan_s"]
            row["vs_static"] = static_s / row["makespan_s"]
            rows.append(row)
            print(f"{seed:>4} {policy:18} {row['makespan_s']:>10.2f} {row['vs_static']:>8.2f}x "
                  f"{row['preemptions']:>9} {row['prefill_tokens']:>10}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0
