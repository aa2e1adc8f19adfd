"""`codeloop bench ceiling`: what the host can feed a GPU, measured on a CPU.

The sampling phases of the GPU recipe (configs/gsm8k_smollm2_gpu.toml with `codeloop real
--gpu`'s sizes) run as the recipe runs them: an evaluation (`eval` settings, development
problems x samples), the stage-1 screen (its overrides, RL problems x `refilter_samples`) and RL
steps (`prompts_per_step` problems x `group_size` x `oversample` samples each), through the
in-process engine on its slot path (the GPU's: fixed slots, batched joins, next turns fed
through the decoding steps, a worker thread for the steps), with SmolLM2's tokenizer and the
recipe's prompt format, the real sandbox and the real verifier. Only the model is replaced: a
replay answers every turn with the problem's own SFT conversation (built as the recipe builds
it, its tool calls run in the sandbox), at no cost, and `--step-ms` and `--prefill-ms` set the
device time of a decoding step and of a prefill (slept in the engine's worker thread, as a GPU
computes while the host goes on); `--feed-tokens 0` prefills every join instead. Problems whose
solution gives no conversation are left out, and counted.

It reports, over all phases and for each: tokens/s, trajectories/s, tool calls/s and their
latency (p50, p99), the host's milliseconds a decoding step (the engine's time a step less the
device time slept), prefills a step, prompt tokens fed a step, rows a step, and each phase's
seconds. With the device time at zero it shows what the host can feed; with a GPU's step time,
what the recipe's sampling would take. `--scale` runs a share of every phase's problems and
steps. `--json` prints one JSON object as the last line (`tokens_per_s`, `trajectories_per_s`,
`host_ms_per_step`, `prefills_per_step`, `rows_per_step`, ...); `--out` writes it too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from codeloop.config import Config, RolloutConfig, eval_rollout_config, load_config, stage_config
from codeloop.data.problems import GSM8K_TRAIN, Problem, load_problems, split_dev
from codeloop.engine.hf_engine import FEED_TOKENS, JOIN_WAIT_STEPS, TransformersEngine
from codeloop.engine.kv_batch import _common_prefix
from codeloop.engine.model import tiny_model
from codeloop.engine.protocol import SamplingParams
from codeloop.engine.slot_cache import SlotDecoder
from codeloop.helpformat import HelpFormatter, positive_count
from codeloop.recipe.sizes import GPU_CONFIG, GPU_SIZES
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent, collect
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.tools import ToolExecutor
from codeloop.types import ExecRequest, ExecResult

COLUMNS = 2048  # the slots' columns: a prompt and the longest response of the recipe


class Scripts:
    """Each problem's SFT conversation as the turns a policy would sample: token ids a turn,
    flattened into one tensor (`flat`) with an end-of-turn token after every turn, so that a
    turn is a range of it. A prompt is matched to the problem whose first prompt begins it
    (looked up by the few tokens after the prefix that every problem's prompt shares), and to
    its turn by the turn markers (the tokenizer's special tokens) that its earlier turns and
    tool responses added."""

    def __init__(self, fmt: PromptFormat, turns_by_problem: dict[str, list[str]]) -> None:
        end = min(fmt.end_of_turn_ids)
        self.special = set(fmt.tokenizer.all_special_ids)
        prompts = {problem: fmt.prompt_ids(problem) for problem in turns_by_problem}
        self.shared = _common_length(list(prompts.values()))
        self.key_tokens = min(len(p) for p in prompts.values()) - self.shared
        self.base = {problem: self._markers(p) for problem, p in prompts.items()}
        self.per_round = self._markers(fmt.tool_response_ids("x"))
        flat: list[int] = [end]  # position 0: a lone end of turn, for prompts of no script
        self.turns: dict[str, list[tuple[int, int]]] = {}
        for problem, texts in turns_by_problem.items():
            ranges = []
            for text in texts:
                ids = fmt.encode(text)
                ranges.append((len(flat), len(flat) + len(ids)))
                flat += [*ids, end]
            self.turns[problem] = ranges
        self.flat = torch.tensor(flat)  # [total]
        self.by_key: dict[tuple[int, ...], list[tuple[tuple[int, ...], str]]] = {}
        for problem, p in prompts.items():
            self.by_key.setdefault(self._key(p), []).append((tuple(p), problem))

    def _markers(self, ids: Sequence[int]) -> int:
        return sum(token in self.special for token in ids)

    def _key(self, prompt: Sequence[int]) -> tuple[int, ...]:
        return tuple(prompt[self.shared : self.shared + self.key_tokens])

    def start(self, prompt: Sequence[int]) -> tuple[int, int]:
        """The range of `flat` the policy answers `prompt` with: its problem's next turn, or
        a lone end of turn when the prompt is none of theirs (a shared prefix, say)."""
        problem = max(
            (
                (len(first), problem)
                for first, problem in self.by_key.get(self._key(prompt), [])
                if tuple(prompt[: len(first)]) == first
            ),
            default=(0, ""),
        )[1]
        if not problem:
            return 0, 0
        turn = (self._markers(prompt) - self.base[problem]) // max(self.per_round, 1)
        turns = self.turns[problem]
        return turns[turn] if 0 <= turn < len(turns) else (0, 0)


def _common_length(prompts: Sequence[Sequence[int]]) -> int:
    """The length of the prefix every prompt shares (`kv_batch._common_prefix`, pairwise)."""
    first = tuple(prompts[0])
    return min(
        (_common_prefix(first, tuple(p), min(len(first), len(p))) for p in prompts[1:]),
        default=len(first),
    )


class ReplayDecoder(SlotDecoder):
    """A slot decoder whose 'model' replays `Scripts`: a slot holds a cursor into the scripts'
    tokens instead of KV. `prefill` places each prompt's cursor at its turn's first token,
    `decode` moves every row's one token on (never past its turn's end of turn), and both
    return the token ids as [n, 1] logits that `sample` reads back (logprob 0). Device time is
    slept: `step_s` a decoding step, `prefill_s` a prefill."""

    def __init__(self, scripts: Scripts, rows: int, step_s: float, prefill_s: float) -> None:
        self.scripts, self.rows = scripts, rows
        self.step_s, self.prefill_s = step_s, prefill_s
        self.graphs_on, self.captures, self.columns = True, 0, COLUMNS
        self.cursor = torch.zeros(rows, dtype=torch.long)  # [rows] index into scripts.flat
        self.end = torch.zeros(rows, dtype=torch.long)  # [rows] its turn's end of turn
        self.slept_s = 0.0

    def ensure_columns(self, needed: int) -> None:
        self.columns = max(self.columns, needed)

    def refresh(self) -> None:
        pass  # no weights

    def prefill(
        self, prompts: Sequence[Sequence[int]], slots: list[int], cached: list[int], pad_id: int
    ) -> torch.Tensor:
        for prompt, slot in zip(prompts, slots, strict=True):
            self.cursor[slot], self.end[slot] = self.scripts.start(prompt)
        self._sleep(self.prefill_s)
        return self.scripts.flat[self.cursor[slots]].unsqueeze(1).float()  # [n, 1]

    def decode(self, tokens: torch.Tensor, positions: list[int]) -> torch.Tensor:
        n = len(positions)
        self.cursor[:n] = torch.minimum(self.cursor[:n] + 1, self.end[:n])
        self._sleep(self.step_s)
        return self.scripts.flat[self.cursor[:n]].unsqueeze(1).float()  # [n, 1]

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], draws: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return logits[:, 0].long(), torch.zeros(len(logits))

    def feed(self, slots: list[int], prompts: Sequence[Sequence[int]], cached: list[int]) -> None:
        # the cursor starts as many tokens before the turn as the prompt has left to feed, so
        # that it reaches the turn's first token with the prompt's last
        for slot, prompt, count in zip(slots, prompts, cached, strict=True):
            start, self.end[slot] = self.scripts.start(prompt)
            self.cursor[slot] = start - (len(prompt) - count)

    def slot_kv(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return []  # a prefill recomputes a cursor from the whole prompt: nothing to keep

    def load_kv(self, slot: int, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        pass

    def move(self, source: int, target: int, length: int) -> None:
        self.cursor[target], self.end[target] = self.cursor[source], self.end[source]

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)
            self.slept_s += seconds


class TimedTools:
    """A `ToolExecutor` that records each call's seconds."""

    def __init__(self, tools: ToolExecutor) -> None:
        self.tools, self.seconds = tools, list[float]()

    async def execute(self, request: ExecRequest) -> ExecResult:
        began = time.perf_counter()
        result = await self.tools.execute(request)
        self.seconds.append(time.perf_counter() - began)
        return result


@dataclass
class Phase:
    name: str
    problems: list[Problem]
    samples: int
    rollout: RolloutConfig
    repeats: int = 1
    figures: dict[str, Any] = field(default_factory=dict)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    cfg = load_config(args.config or GPU_CONFIG, [])
    report = asyncio.run(run(cfg, args))
    _print(report, args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="codeloop bench ceiling", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--config", help=f"the recipe whose phases run (default {GPU_CONFIG})")
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="device time of a decoding step (ms)"
    )
    parser.add_argument("--prefill-ms", type=float, default=0.0, help="device time of a prefill")
    parser.add_argument(
        "--feed-tokens",
        type=int,
        default=FEED_TOKENS,
        help="a joining request with at most this many prompt tokens not in the prefix cache "
        "goes through decoding steps instead of a prefill (0: every join is prefilled)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="the share of each phase's problems and of the RL steps that runs (1: the recipe's)",
    )
    parser.add_argument(
        "--rl-steps", type=int, help="RL steps sampled (default: the stages' steps, scaled)"
    )
    parser.add_argument(
        "--max-batch", type=positive_count, help="the engine's slots (default the config's)"
    )
    parser.add_argument("--json", action="store_true", help="a JSON object as the last line")
    parser.add_argument("--out", help="also write the JSON report here")
    return parser


async def run(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    """Build the scripts, then run each phase through one engine; the report."""
    from codeloop.data.pretrained import smollm2
    from codeloop.engine.model import load_tokenizer
    from codeloop.recipe import gsm8k_sft
    from codeloop.sandbox.pool import LocalSandbox

    tokenizer = load_tokenizer(str(smollm2()))
    fmt = PromptFormat.from_config(tokenizer, cfg.rollout, cfg.eval)
    sizes = GPU_SIZES
    train, dev = split_dev(load_problems(str(GSM8K_TRAIN), cfg.data), sizes.dev, cfg.trainer.seed)
    scaled = _scale(args.scale)
    dev = dev[: scaled(sizes.eval_problems)]
    rl = train[sizes.sft_problems : sizes.sft_problems + sizes.rl_problems][
        : scaled(sizes.rl_problems)
    ]
    max_batch = args.max_batch or cfg.rollout.engine_max_batch
    async with LocalSandbox(cfg.sandbox) as sandbox:
        began = time.perf_counter()
        built = await gsm8k_sft.build([*dev, *rl], sandbox, fmt, sizes.error_share, seed=0)
        build_s = time.perf_counter() - began
        problem_of = {fmt.messages(p.problem)[1]["content"]: p.problem for p in [*dev, *rl]}
        turns = {
            problem_of[c[1]["content"]]: [m["content"] for m in c if m["role"] == "assistant"]
            for c in built.conversations
        }
        scripts = Scripts(fmt, turns)
        dev, rl = [p for p in dev if p.problem in turns], [p for p in rl if p.problem in turns]
        phases = _phases(
            cfg, dev, rl, scaled, rl_steps=args.rl_steps, eval_samples=sizes.eval_samples
        )
        engine, decoder = _engine(fmt, scripts, max_batch, args)
        tools = TimedTools(sandbox)
        with Verifier(cfg.reward) as verifier:
            for phase in phases:
                phase.figures = await _run_phase(
                    phase, engine, decoder, fmt, tools=tools, verifier=verifier
                )
    total = _totals([p.figures for p in phases])
    return {
        "config": args.config or GPU_CONFIG,
        "step_ms": args.step_ms,
        "prefill_ms": args.prefill_ms,
        "feed_tokens": args.feed_tokens,
        "scale": args.scale,
        "max_batch": max_batch,
        "problems_without_conversation": sum(built.dropped.values()),
        "scripts_s": build_s,
        **total,
        "phases": {p.name: p.figures for p in phases},
    }


def _scale(share: float) -> Any:
    def scaled(count: int) -> int:
        return max(1, round(share * count))

    return scaled


def _phases(
    cfg: Config,
    dev: list[Problem],
    rl: list[Problem],
    scaled: Any,
    *,
    rl_steps: int | None,
    eval_samples: int,
) -> list[Phase]:
    first = stage_config(cfg, 0)
    stage = cfg.recipe.stages[0]
    steps = rl_steps or scaled(sum(s.steps for s in cfg.recipe.stages))
    per_step = cfg.trainer.prompts_per_step
    samples = cfg.algo.group_size * cfg.algo.oversample
    batch = [rl[i % len(rl)] for i in range(per_step)]
    return [
        Phase("evaluation", dev, eval_samples, eval_rollout_config(cfg)),
        Phase("screen", rl, stage.refilter_samples or 1, first.rollout),
        Phase("rl", batch, samples, first.rollout, repeats=steps),
    ]


def _engine(
    fmt: PromptFormat, scripts: Scripts, max_batch: int, args: argparse.Namespace
) -> tuple[TransformersEngine, ReplayDecoder]:
    """The in-process engine on its slot path, with the replay in place of the model's
    forward (a one-layer model stands behind it: nothing of it runs)."""
    stand_in = tiny_model(len(fmt.tokenizer), hidden_size=8, layers=1, heads=1)
    engine = TransformersEngine(
        stand_in,
        fmt.tokenizer,
        fmt.end_of_turn_ids,
        max_batch=max_batch,
        max_kv_tokens=max_batch * COLUMNS,
        slot_cache=True,
        step_in_thread=True,
        join_wait_steps=JOIN_WAIT_STEPS,
        feed_tokens=args.feed_tokens,
    )
    decoder = ReplayDecoder(scripts, max_batch, args.step_ms / 1000, args.prefill_ms / 1000)
    engine.slots = decoder
    return engine, decoder


async def _run_phase(
    phase: Phase,
    engine: TransformersEngine,
    decoder: ReplayDecoder,
    fmt: PromptFormat,
    *,
    tools: TimedTools,
    verifier: Verifier,
) -> dict[str, Any]:
    before, calls_before, slept_before = engine.stats(), len(tools.seconds), decoder.slept_s
    agent = Agent(engine, tools, fmt, phase.rollout)
    began = time.perf_counter()
    trajectories = []
    for repeat in range(phase.repeats):
        groups = await collect(agent, phase.problems, phase.samples, verifier, seed=repeat)
        trajectories += [t for g in groups for t in g]
    seconds = time.perf_counter() - began
    found = engine.stats().since(before).metrics()
    steps = max(found["steps"], 1.0)
    slept = decoder.slept_s - slept_before
    decode_slept = found["steps"] * decoder.step_s
    latencies = sorted(tools.seconds[calls_before:])
    tokens = sum(sum(t.loss_mask) for t in trajectories)
    return {
        "seconds": seconds,
        "trajectories": len(trajectories),
        "tokens": tokens,
        "tool_calls": len(latencies),
        "correct": sum(t.reward == 1.0 for t in trajectories),
        "tokens_per_s": tokens / seconds,
        "trajectories_per_s": len(trajectories) / seconds,
        "tool_calls_per_s": len(latencies) / seconds,
        "tool_call_p50_ms": 1000 * _quantile(latencies, 0.5),
        "tool_call_p99_ms": 1000 * _quantile(latencies, 0.99),
        "steps": found["steps"],
        "host_ms_per_step": 1000 * (found["decode_s"] + found["host_s"] - decode_slept) / steps,
        "prefills_per_step": found["prefills"] / steps,
        "fed_tokens_per_step": found["fed_tokens"] / steps,
        "rows_per_step": found["rows_per_step"],
        "device_s": slept,
    }


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(100 * q) - 1]


def _totals(phases: Sequence[dict[str, Any]]) -> dict[str, Any]:
    seconds = sum(p["seconds"] for p in phases)
    steps = sum(p["steps"] for p in phases)
    per_step = {
        key: sum(p[key] * p["steps"] for p in phases) / max(steps, 1)
        for key in ("host_ms_per_step", "prefills_per_step", "fed_tokens_per_step", "rows_per_step")
    }
    return {
        "seconds": seconds,
        "tokens_per_s": sum(p["tokens"] for p in phases) / seconds,
        "trajectories_per_s": sum(p["trajectories"] for p in phases) / seconds,
        "tool_calls_per_s": sum(p["tool_calls"] for p in phases) / seconds,
        **per_step,
    }


def _print(report: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"bench ceiling: {report['config']} at scale {report['scale']:g}, {report['max_batch']} "
        f"slots, device time {report['step_ms']:g} ms a step and {report['prefill_ms']:g} ms a "
        f"prefill, turns of at most {report['feed_tokens']} new tokens fed; "
        f"{report['problems_without_conversation']} problems left out (no "
        f"conversation); scripts built in {report['scripts_s']:.1f} s"
    )
    for name, p in report["phases"].items():
        print(
            f"  {name:10} {p['seconds']:7.1f} s  {p['trajectories']:6} trajectories "
            f"{p['tokens_per_s']:9.0f} tokens/s {p['trajectories_per_s']:7.1f} traj/s "
            f"{p['tool_calls_per_s']:6.1f} calls/s (p50 {p['tool_call_p50_ms']:.0f} ms, p99 "
            f"{p['tool_call_p99_ms']:.0f} ms)  host {p['host_ms_per_step']:.2f} ms/step  "
            f"{p['prefills_per_step']:.3f} prefills/step  {p['fed_tokens_per_step']:.1f} fed "
            f"tokens/step  {p['rows_per_step']:.0f} rows/step"
        )
    print(
        f"  all        {report['seconds']:7.1f} s  {report['tokens_per_s']:.0f} tokens/s, "
        f"{report['trajectories_per_s']:.1f} trajectories/s, host "
        f"{report['host_ms_per_step']:.2f} ms a step, {report['prefills_per_step']:.3f} "
        f"prefills a step, {report['fed_tokens_per_step']:.1f} tokens fed a step, "
        f"{report['rows_per_step']:.0f} rows a step"
    )
