"""`codeloop bench scheduler`: the scheduling policies in a discrete-event simulation.

The real `Scheduler` drives simulated engines on an asyncio loop whose clock is virtual (time
jumps to the next event), so a rollout of minutes simulates in seconds and every run of a seed
is the same. Each simulated engine is a paged-KV server in the manner of vLLM: it starts queued
requests first come first served while their contexts fit in its KV capacity (evicting idle
cached prefixes, least recent first), and a decode step emits one token per running request in
`max(step_ms, step_ms * running / saturation)` (a fixed cost up to `saturation` requests, then
compute-bound) plus `prefill_ms` per prefilled token. When the running contexts outgrow the
capacity it preempts its newest request, which must prefill its whole context again later (an
overflow). A call whose trajectory's prefix is still cached prefills only the new tokens.

The workload (`--seed`): `--prompts` prompts x `--group` samples, a prompt's samples adjacent
as in a GRPO batch. Each prompt has a difficulty d ~ lognormal(0, 0.8) shared by its samples
(hard problems make every sample long: the heavy tail comes in groups). A trajectory makes
Geometric(mean 1.5 d) tool calls, capped at 30 turns; a turn samples lognormal(median 250 d,
sigma 1.0) tokens, cut at `--turn-cap`, and the trajectory ends when its `--budget` of response
tokens is spent. A tool call takes lognormal(median 0.3 s, sigma 1.2) seconds (p99 about 5 s),
cut at a 10 s timeout, and returns lognormal(median 80, sigma 0.8) tokens, at most 512. Prompts
have 100-400 tokens. Over 2,048 trajectories this gives a mean of about 1,500 response tokens,
a median near 700, and a few percent of trajectories at the budget.

The lower bound is the largest of three: all the decode and prefill work at the engines' peak
rate (`saturation / step_ms` tokens/s) spread evenly; the KV memory that every sampled token
holds for at least one step (its context x `step_ms`) over the engines' total capacity; and
the longest trajectory alone (its tokens at one step each, its prefill and its tool calls).
The bench prints, per policy, the makespan, its ratio to `static` and to the bound, the share
of engine time spent idle, the overflows (preemptions) and the prefilled tokens.

Then the training loop (`--steps` > 0): `--steps` RL steps of `--prompts` groups on kv_aware
engines, where an update takes `--train-share` x its batch's generation work at peak rate (a
trainer on devices of its own, as in disaggregated RL; 0.6 is `bench train`'s 38/62 split).
`sync` rolls out a batch, trains, repeats; `async` follows `trainer/async_rl.py` for each
`--max-staleness` (groups start while taken + outstanding < (version + staleness + 1) x batch,
the first finished groups train, a group whose first token is older than the bound is run
again). It prints seconds per 1,000 trained tokens in the steady state (from the end of the
first step to the end of the last: the pipeline is full), against sync and against the bound
(`training_bound`: the larger of generation at peak rate, KV memory x time, and training, per
sampled token over the whole workload).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import selectors
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from codeloop.engine.protocol import Generation, SamplingParams
from codeloop.engine.scheduler import POLICIES, Scheduler
from codeloop.helpformat import HelpFormatter, positive_count

MAX_TURNS = 30
T = TypeVar("T")
TOOL_TIMEOUT_S = 10.0
MAX_OBSERVATION = 512


class _VirtualSelector(selectors.DefaultSelector):
    """Waiting for `timeout` moves the loop's clock instead of sleeping."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise RuntimeError("simulation stalled: nothing is scheduled and nothing is ready")
        self.now += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now


@dataclass
class Trajectory:
    prompt: int
    turns: list[int]  # sampled tokens per turn
    tools: list[tuple[float, int]]  # (latency s, observation tokens) after each turn but the last


@dataclass
class _Prompt:
    """What a simulated engine is asked: a context of `len()` tokens that continues with
    `tokens` sampled ones; `key` names the trajectory for the prefix cache."""

    key: int
    context: int
    tokens: int
    on_start: Callable[[], None] | None = None  # called when an engine starts decoding it

    def __len__(self) -> int:
        return self.context


@dataclass
class _Request:
    key: int
    context: int  # tokens in the KV cache once running
    tokens_left: int
    done: asyncio.Future[None]
    on_start: Callable[[], None] | None = None


class SimEngine:
    """A toy paged-KV engine: see the module docstring."""

    def __init__(
        self,
        capacity: int,
        step_ms: float,
        saturation: int,
        prefill_ms: float,
        *,
        max_running: int = 256,
    ) -> None:
        self.capacity, self.step_s, self.saturation = capacity, step_ms / 1000, saturation
        self.prefill_s, self.max_running = prefill_ms / 1000, max_running
        self.running: list[_Request] = []
        self.waiting: list[_Request] = []
        self.cached: OrderedDict[int, int] = OrderedDict()  # idle prefixes, least recent first
        self.used = 0  # KV tokens of the running requests
        self.preemptions = self.prefill_tokens = 0
        self.busy_s = 0.0
        self._task: asyncio.Task[None] | None = None

    async def generate(self, prompt_ids: Any, params: SamplingParams) -> Generation:
        prompt: _Prompt = prompt_ids
        done = asyncio.get_running_loop().create_future()
        self.waiting.append(
            _Request(prompt.key, prompt.context, prompt.tokens, done, prompt.on_start)
        )
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        await done
        return Generation([0] * prompt.tokens, [0.0] * prompt.tokens, "stop")

    def _start_waiting(self) -> int:
        """Start queued requests while they fit; return the tokens they prefill."""
        prefill = 0
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting[0]
            hit = min(self.cached.pop(request.key, 0), request.context)
            if self.running and self.used + request.context > self.capacity:
                if hit:
                    self.cached[request.key] = hit
                break
            self.waiting.pop(0)
            self.running.append(request)
            if request.on_start is not None:
                request.on_start()
            self.used += request.context
            prefill += request.context - hit
        while self.cached and self.used + sum(self.cached.values()) > self.capacity:
            self.cached.popitem(last=False)
        return prefill

    async def _run(self) -> None:
        while self.running or self.waiting:
            prefill = self._start_waiting()
            self.prefill_tokens += prefill
            batch = len(self.running)
            step_s = self.step_s * max(1.0, batch / self.saturation) + prefill * self.prefill_s
            await asyncio.sleep(step_s)
            self.busy_s += step_s
            for request in self.running:
                request.tokens_left -= 1
                request.context += 1
            self.used += batch
            while self.used > self.capacity and len(self.running) > 1:  # overflow: recompute
                victim = self.running.pop()
                self.used -= victim.context
                self.waiting.insert(0, victim)
                self.preemptions += 1
            finished = [r for r in self.running if r.tokens_left <= 0]
            for request in finished:
                self.running.remove(request)
                self.used -= request.context
                self.cached[request.key] = request.context
                request.done.set_result(None)


MIXES = {"heavy": (0.8, 1.0), "light": (0.2, 0.4)}  # sigma of difficulty, of turn length


def workload(
    mix: str, prompts: int, group: int, budget: int, *, turn_cap: int, seed: int
) -> list[Trajectory]:
    """See the module docstring."""
    rng = random.Random(seed)
    difficulty_sigma, turn_sigma = MIXES[mix]
    out = []
    for _ in range(prompts):
        difficulty = rng.lognormvariate(0.0, difficulty_sigma)
        for _ in range(group):
            calls = min(MAX_TURNS - 1, _geometric(rng, 1.5 * difficulty))
            turns: list[int] = []
            tools: list[tuple[float, int]] = []
            left = budget
            for turn in range(calls + 1):
                tokens = min(
                    turn_cap,
                    left,
                    max(1, int(rng.lognormvariate(0, turn_sigma) * 250 * difficulty)),
                )
                turns.append(tokens)
                left -= tokens
                if turn == calls or left <= 0:
                    break
                latency = min(TOOL_TIMEOUT_S, rng.lognormvariate(math.log(0.3), 1.2))
                observation = min(MAX_OBSERVATION, int(rng.lognormvariate(math.log(80), 0.8)))
                if observation >= left:
                    break
                tools.append((latency, observation))
                left -= observation
            out.append(Trajectory(rng.randint(100, 400), turns, tools))
    return out


def _geometric(rng: random.Random, mean: float) -> int:
    """Failures before the first success, with the given mean."""
    p = 1.0 / (1.0 + mean)
    return int(math.log(1.0 - rng.random()) / math.log(1.0 - p))


def lower_bound(trajectories: list[Trajectory], args: argparse.Namespace) -> dict[str, float]:
    step_s, prefill_s = args.step_ms / 1000, args.prefill_ms / 1000
    decode = prefill = kv_token_s = 0.0
    longest = 0.0
    for t in trajectories:
        own_prefill = t.prompt + sum(obs for _, obs in t.tools)
        context = t.prompt
        for i, tokens in enumerate(t.turns):
            kv_token_s += (tokens * context + tokens * (tokens + 1) / 2) * step_s
            context += tokens + (t.tools[i][1] if i < len(t.tools) else 0)
        decode += sum(t.turns)
        prefill += own_prefill
        alone = sum(t.turns) * step_s + own_prefill * prefill_s + sum(lat for lat, _ in t.tools)
        longest = max(longest, alone)
    work = (decode * step_s / args.saturation + prefill * prefill_s) / args.engines
    memory = kv_token_s / (args.engines * args.capacity)
    return {
        "work_s": work,
        "memory_s": memory,
        "longest_s": longest,
        "bound_s": max(work, memory, longest),
        "decode_tokens": decode,
    }


def _trajectory_runner(
    scheduler: Scheduler, args: argparse.Namespace
) -> Callable[..., Coroutine[Any, Any, None]]:
    """A coroutine function that runs one simulated trajectory through `scheduler`;
    `on_start` is called when an engine starts decoding its first turn."""

    async def trajectory(
        key: int, t: Trajectory, on_start: Callable[[], None] | None = None
    ) -> None:
        async with scheduler.lease() as engine:
            context, spent = t.prompt, 0
            for i, tokens in enumerate(t.turns):
                cap = min(args.turn_cap, args.budget - spent)
                prompt = _Prompt(key, context, tokens, on_start if i == 0 else None)
                await engine.generate(prompt, SamplingParams(cap))  # type: ignore[arg-type]
                context, spent = context + tokens, spent + tokens
                if i < len(t.tools):
                    latency, observation = t.tools[i]
                    await asyncio.sleep(latency)
                    context, spent = context + observation, spent + observation

    return trajectory


def _engines(args: argparse.Namespace) -> list[SimEngine]:
    return [
        SimEngine(args.capacity, args.step_ms, args.saturation, args.prefill_ms)
        for _ in range(args.engines)
    ]


async def _rollout(
    policy: str, trajectories: list[Trajectory], args: argparse.Namespace
) -> dict[str, Any]:
    engines = _engines(args)
    scheduler = Scheduler(
        engines, policy, capacity_tokens=args.capacity, batch_size=len(trajectories)
    )
    trajectory = _trajectory_runner(scheduler, args)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await asyncio.gather(*(trajectory(k, t) for k, t in enumerate(trajectories)))
    makespan = loop.time() - start
    busy = sum(e.busy_s for e in engines) / len(engines)
    return {
        "policy": policy,
        "makespan_s": makespan,
        "idle": 1 - busy / makespan,
        "preemptions": sum(e.preemptions for e in engines),
        "prefill_tokens": sum(e.prefill_tokens for e in engines),
    }


def _work_s(groups: list[list[Trajectory]], args: argparse.Namespace) -> float:
    """The groups' decode and prefill work at the engines' peak rate, spread over them."""
    decode = sum(sum(t.turns) for g in groups for t in g)
    prefill = sum(t.prompt + sum(obs for _, obs in t.tools) for g in groups for t in g)
    step_s, prefill_s = args.step_ms / 1000, args.prefill_ms / 1000
    work: float = (decode * step_s / args.saturation + prefill * prefill_s) / args.engines
    return work


async def _training(
    mode: str, max_staleness: int, groups: list[list[Trajectory]], args: argparse.Namespace
) -> dict[str, Any]:
    """`args.steps` RL steps of `args.prompts` groups on kv_aware engines, an update taking
    `train_share` x its groups' generation work (a trainer on devices of its own). sync: roll
    out a batch, update, repeat. async: the rule of `trainer/async_rl.py` (groups start while
    taken + outstanding < (version + max_staleness + 1) x batch; the first finished groups
    train; one whose first token is more than max_staleness versions old is run again)."""
    engines, batch = _engines(args), args.prompts
    scheduler = Scheduler(
        engines, "kv_aware", capacity_tokens=args.capacity, batch_size=batch * args.group
    )
    trajectory = _trajectory_runner(scheduler, args)

    version = 0
    started: dict[int, int] = {}  # group -> the version when its first token was sampled

    async def run_group(index: int) -> int:
        key = index * args.group

        def first_token() -> None:
            started.setdefault(index, version)

        await asyncio.gather(
            *(trajectory(key + j, t, first_token) for j, t in enumerate(groups[index]))
        )
        return index

    loop = asyncio.get_running_loop()
    start, regenerated = loop.time(), 0
    trained: list[list[int]] = []  # the groups of each step
    ends: list[float] = []  # when each step's update ended
    if mode == "sync":
        for step in range(args.steps):
            chosen: list[int] = list(range(step * batch, (step + 1) * batch))
            await asyncio.gather(*(run_group(i) for i in chosen))
            await asyncio.sleep(args.train_share * _work_s([groups[i] for i in chosen], args))
            trained.append(chosen)
            ends.append(loop.time())
    else:
        taken = outstanding = drawn = 0
        redo: list[int] = []
        ready: asyncio.Queue[int] = asyncio.Queue()
        wake = asyncio.Event()
        tasks: set[asyncio.Task[Any]] = set()  # referenced until the simulation ends

        def finished(task: asyncio.Task[int]) -> None:
            if not task.cancelled():
                ready.put_nowait(task.result())

        async def produce() -> None:
            nonlocal outstanding, drawn
            while True:
                while taken + outstanding < (version + max_staleness + 1) * batch:
                    if redo:
                        index = redo.pop(0)
                    else:
                        index, drawn = drawn, drawn + 1
                    outstanding += 1
                    task = asyncio.create_task(run_group(index))
                    task.add_done_callback(finished)
                    tasks.add(task)
                wake.clear()
                await wake.wait()

        tasks.add(asyncio.create_task(produce()))
        for _ in range(args.steps):
            chosen = []
            while len(chosen) < batch:
                index = await ready.get()
                if version - started.pop(index) > max_staleness:
                    outstanding, regenerated = outstanding - 1, regenerated + 1
                    redo.append(index)
                    wake.set()
                    continue
                chosen.append(index)
            taken, outstanding = taken + batch, outstanding - batch
            wake.set()
            await asyncio.sleep(args.train_share * _work_s([groups[i] for i in chosen], args))
            version += 1
            wake.set()
            trained.append(chosen)
            ends.append(loop.time())
    tokens = [sum(sum(t.turns) for i in step for t in groups[i]) for step in trained]
    busy = sum(e.busy_s for e in engines) / len(engines)
    return {
        "mode": mode if mode == "sync" else f"async, staleness {max_staleness}",
        "makespan_s": ends[-1] - start,
        "trained_tokens": sum(tokens),
        # steady state: from the end of the first step (the pipeline is full) to the last
        "s_per_token": (ends[-1] - ends[0]) / max(sum(tokens[1:]), 1),
        "idle": 1 - busy / (ends[-1] - start),
        "regenerated": regenerated,
        "preemptions": sum(e.preemptions for e in engines),
    }


def training_bound(groups: list[list[Trajectory]], args: argparse.Namespace) -> float:
    """Seconds per sampled token at best: the largest of generation at peak rate, the KV
    memory x time the tokens need, and training (`train_share` x generation), over all."""
    flat = [t for g in groups for t in g]
    rollout = lower_bound(flat, args)
    work = _work_s(groups, args)
    best: float = max(work, rollout["memory_s"], args.train_share * work)
    return best / rollout["decode_tokens"]


def run_simulated(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run `coroutine` to its end on a fresh loop with the virtual clock."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coroutine)
    finally:  # what is still running (engines, groups in flight) ends with the simulation
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()

        async def cancelled() -> None:
            await asyncio.gather(*left, return_exceptions=True)

        loop.run_until_complete(cancelled())
        loop.close()


def simulate(
    policy: str, trajectories: list[Trajectory], args: argparse.Namespace
) -> dict[str, Any]:
    return run_simulated(_rollout(policy, trajectories, args))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="codeloop bench scheduler",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--mix", nargs="+", choices=sorted(MIXES), default=["heavy", "light"], help="workload mixes"
    )
    parser.add_argument("--engines", type=positive_count, default=4, help="simulated engines")
    parser.add_argument("--prompts", type=positive_count, default=128, help="prompts per batch")
    parser.add_argument("--group", type=positive_count, default=16, help="samples per prompt")
    parser.add_argument(
        "--capacity", type=positive_count, default=262144, help="KV tokens per engine"
    )
    parser.add_argument(
        "--budget", type=positive_count, default=8192, help="response tokens per trajectory"
    )
    parser.add_argument(
        "--turn-cap", type=positive_count, default=2048, help="tokens per turn at most"
    )
    parser.add_argument("--step-ms", type=float, default=20.0, help="decode step, small batch")
    parser.add_argument(
        "--saturation", type=positive_count, default=64, help="batch beyond which steps slow"
    )
    parser.add_argument("--prefill-ms", type=float, default=0.05, help="per prefilled token")
    parser.add_argument("--seeds", type=positive_count, default=2, help="workload seeds per mix")
    parser.add_argument(
        "--steps", type=int, default=6, help="RL steps of the training-loop rows (0: none)"
    )
    parser.add_argument(
        "--train-share",
        type=float,
        default=0.6,
        help="an update's time over its batch's generation work at peak rate",
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        nargs="+",
        default=[1, 2],
        help="the async rows' staleness bounds",
    )
    parser.add_argument("--out", default="bench-results/scheduler.json", help="JSON report")
    args = parser.parse_args(argv)
    rows = []
    print(
        f"{'mix':5} {'seed':>4} {'policy':18} {'makespan s':>10} {'vs static':>9} "
        f"{'vs bound':>8} {'idle':>6} {'overflows':>9} {'prefilled':>10}"
    )
    for mix in args.mix:
        for seed in range(args.seeds):
            trajectories = workload(
                mix, args.prompts, args.group, args.budget, turn_cap=args.turn_cap, seed=seed
            )
            bound = lower_bound(trajectories, args)
            static_s = 0.0
            for policy in ("static", *[p for p in POLICIES if p != "static"]):
                clock = time.perf_counter()
                row = simulate(policy, trajectories, args) | {"mix": mix, "seed": seed}
                row["wall_s"], row["bound"] = time.perf_counter() - clock, bound
                static_s = static_s or row["makespan_s"]
                row["vs_static"] = static_s / row["makespan_s"]
                row["vs_bound"] = row["makespan_s"] / bound["bound_s"]
                rows.append(row)
                print(
                    f"{mix:5} {seed:>4} {policy:18} {row['makespan_s']:>10.1f} "
                    f"{row['vs_static']:>8.2f}x {row['vs_bound']:>7.2f}x {row['idle']:>6.1%} "
                    f"{row['preemptions']:>9} {row['prefill_tokens']:>10}"
                )
            print(
                f"{'':10} bound {bound['bound_s']:.1f} s = max(work {bound['work_s']:.1f}, "
                f"memory {bound['memory_s']:.1f}, longest trajectory "
                f"{bound['longest_s']:.1f}); {len(trajectories)} trajectories, mean "
                f"{bound['decode_tokens'] / len(trajectories):.0f} sampled tokens"
            )
    training = _training_rows(args) if args.steps else []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "rows": rows, "training": training}, indent=2)
    )
    print(f"wrote {args.out}")
    return 0


def _training_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The training loop, sync against async: seconds per 1,000 trained tokens and its ratio
    to the bound (`training_bound`)."""
    rows = []
    print(
        f"\ntraining loop: {args.steps} steps of {args.prompts} prompts x {args.group}, "
        f"an update = {args.train_share} x its generation work"
    )
    print(
        f"{'mix':5} {'seed':>4} {'mode':20} {'makespan s':>10} {'s/1K tokens':>11} "
        f"{'vs sync':>7} {'vs bound':>8} {'idle':>6} {'regenerated':>11} "
        f"{'overflows':>9}"
    )
    for mix in args.mix:
        for seed in range(args.seeds):
            extra = max(args.max_staleness) + 2  # batches the producer may run ahead
            flat = workload(
                mix,
                args.prompts * (args.steps + extra),
                args.group,
                args.budget,
                turn_cap=args.turn_cap,
                seed=seed,
            )
            groups = [flat[i : i + args.group] for i in range(0, len(flat), args.group)]
            bound = training_bound(groups, args)
            sync_rate = 0.0
            for mode, staleness in [("sync", 0)] + [("async", k) for k in args.max_staleness]:
                row = run_simulated(_training(mode, staleness, groups, args))
                rate = row["s_per_token"]
                sync_rate = sync_rate or rate
                row |= {
                    "mix": mix,
                    "seed": seed,
                    "s_per_token": rate,
                    "vs_sync": sync_rate / rate,
                    "vs_bound": rate / bound,
                }
                rows.append(row)
                print(
                    f"{mix:5} {seed:>4} {row['mode']:20} {row['makespan_s']:>10.1f} "
                    f"{rate * 1000:>11.3f} {row['vs_sync']:>6.2f}x {row['vs_bound']:>7.2f}x "
                    f"{row['idle']:>6.1%} {row['regenerated']:>11} "
                    f"{row['preemptions']:>9}"
                )
            print(f"{'':10} bound {bound * 1000:.3f} s per 1K trained tokens")
    return rows
