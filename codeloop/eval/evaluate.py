"""`codeloop eval`: k samples per benchmark problem through the agent loop, scored and summarised.

The report's protocol is the default (`[eval]`: temperature 0.6, top-p 0.95, up to 30 turns, a
32K response budget, k = 16). Output directory:

- `results.jsonl`: one line per finished problem (answers, correctness, statuses, lengths, tool
  counts, and `failed`: its samples the infrastructure failed). A problem's line is written
  after its trajectories, so the line marks it done: a killed evaluation continues with the
  problems that have none.
- `trajectories.jsonl`: every scored trajectory (token ids, masks, logprobs, tool calls, text)
  with its problem and gold answer; `codeloop view` and `codeloop entropy` read it.
- `summary.json`: the score of `rollout/score.py` (`pass@1`: avg@k, with its 95% interval
  `pass@1_low` and `pass@1_high`, `problems`, `infrastructure_failures`), unbiased pass@k for
  k = 2, 4, ... up to the samples every problem kept, maj@k, mean response and policy tokens,
  turns and tool calls per trajectory, tool-error ratio, statuses, the share of trajectories that
  call the tool (`tool_use`) and of those cut off inside a call (`cut_off_in_call`), and the
  share of calls that are malformed (`rollout/stats.py`, as RL logs them).

A trajectory that the infrastructure failed (the engine or server failed, or the sandbox failed a
call: `Trajectory.unscorable`) is left out of its problem's score and counted, as everywhere a
policy is scored (`rollout/score.py`). A problem with no sample left gets no results line, so
running the same command again samples it again.

Samples are seeded by (seed, problem id, sample index), so a resumed run samples what the
uninterrupted one would have.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from codeloop.config import Config, eval_rollout_config
from codeloop.data.problems import DataError, Problem
from codeloop.engine.protocol import Engine
from codeloop.engine.scheduler import Scheduler
from codeloop.errors import RunError
from codeloop.eval.metrics import majority_correct, summarise
from codeloop.files import write_atomic
from codeloop.intervals import METHOD
from codeloop.progress import progress_bar
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent, collect
from codeloop.rollout.policy import Policy
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.score import Scores, score
from codeloop.rollout.stats import sample, stats
from codeloop.rollout.tools import ToolExecutor
from codeloop.types import Trajectory


def open_policy(
    cfg: Config, model: str = "", endpoint: str | Sequence[str] = "", tokenizer: str = ""
) -> tuple[Engine | Scheduler, PromptFormat]:
    """An engine and prompt format: a model run in this process, or a served one.

    `endpoint` is an OpenAI-compatible server (vLLM, SGLang, `codeloop serve`), or several,
    which a `Scheduler` spreads trajectories over (`rollout.scheduler`,
    `rollout.kv_capacity_tokens`); the prompt is rendered here with `tokenizer` (a directory or
    hub name; defaults to `model`).
    """
    from codeloop.engine.model import default_device, load_tokenizer
    from codeloop.errors import ModelError

    endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
    endpoints = [e for e in endpoints if e]
    if endpoints:
        from codeloop.engine.openai_engine import servers

        if not (tokenizer or model):
            raise ModelError("a server (--endpoint) needs its model's tokenizer (--tokenizer)")
        fmt = PromptFormat.from_config(load_tokenizer(tokenizer or model), cfg.rollout)
        engines = servers(endpoints, cfg.rollout, model or tokenizer)
        return Scheduler.for_rollout(engines, cfg.rollout), fmt  # one, to remember failures
    if not model:
        raise ModelError("give a model path (--model) or a server (--endpoint)")
    from codeloop.engine.hf_engine import engine_from_config

    policy = Policy.load(model, cfg, dtype=cfg.trainer.dtype)
    policy.model.to(default_device())
    engine = engine_from_config(
        policy.model, policy.tokenizer, cfg.rollout, longest_response=cfg.eval.max_response_tokens
    )
    return engine, policy.fmt


async def close_policy(engine: Engine | Scheduler) -> None:
    """Close the HTTP sessions of served engines (an in-process engine has none)."""
    from codeloop.engine.openai_engine import OpenAIEngine

    engines = [s.engine for s in engine.slots] if isinstance(engine, Scheduler) else [engine]
    for one in engines:
        if isinstance(one, OpenAIEngine):
            await one.close()


def problem_result(problem: Problem, found: Scores) -> dict[str, Any]:
    """The per-problem line of `results.jsonl`: correctness and answers of the scored samples
    (pass@k, maj@k), each one's record for the statistics (`rollout/stats.py`), and how many
    samples the infrastructure failed."""
    samples = found.trajectories
    return {
        "id": problem.id,
        "gold": problem.answer,
        "correct": [t.reward == 1.0 for t in samples],
        "answers": [t.final_answer for t in samples],
        "samples": [sample(t) for t in samples],
        "failed": found.failed,
    }


def summary(results: Sequence[dict[str, Any]], lost: int = 0) -> dict[str, Any]:
    """Benchmark metrics over per-problem results; `lost`: trajectories of problems left
    without a line (the infrastructure failed all their samples)."""
    found = Scores.merged(Scores.from_result(r) for r in results)
    kept = min(len(r["correct"]) for r in results)
    k_values = [2**i for i in range(1, kept.bit_length()) if 2**i <= kept]
    samples = [s for r in results for s in r["samples"]]
    means = stats(samples)
    statuses = Counter(s["status"] for s in samples)
    k = max(len(r["correct"]) + r["failed"] for r in results)
    return {
        **found.metrics(),
        "infrastructure_failures": found.failed + lost,
        "k": k,
        "interval_method": METHOD,
        **summarise([r["correct"] for r in results], k_values),
        f"maj@{k}": sum(majority_correct(r["answers"], r["correct"]) for r in results)
        / len(results),
        **{key: means[key] for key in STATISTICS},
        "statuses": {s: statuses[s] / len(samples) for s in sorted(statuses)},
    }


STATISTICS = (
    "response_tokens",
    "policy_tokens",
    "turns",
    "tool_calls",
    "tool_error_ratio",
    "tool_use",
    "cut_off_in_call",
    "malformed_calls",
)


def _complete_lines(path: Path) -> list[str]:
    """The file's JSON lines; a half-written last line (a kill) is cut off the file itself so
    that appending starts on a fresh line. A bad line elsewhere is an error."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        try:
            json.loads(line)
        except json.JSONDecodeError as err:
            if number < len(lines):
                raise DataError(f"{path}:{number}: not JSON ({err.msg})") from err
            lines.pop()
            path.write_text("".join(kept + "\n" for kept in lines))
    return lines


RESULT_KEYS = ("id", "correct", "answers", "samples", "failed")


def read_done(out_dir: Path) -> dict[str, dict[str, Any]]:
    """Finished problems of an earlier run, by id."""
    path = out_dir / "results.jsonl"
    done = {}
    for number, line in enumerate(_complete_lines(path), 1):
        record = json.loads(line)
        if missing := [key for key in RESULT_KEYS if key not in record]:
            raise DataError(
                f"{path}:{number}: a line without {', '.join(missing)} (written by an older "
                "codeloop): evaluate into a new directory"
            )
        done[record["id"]] = record
    return done


def _keep_finished_trajectories(path: Path, done: set[str]) -> None:
    """Drop trajectories of problems without a results line (they will be sampled again)."""
    lines = _complete_lines(path)
    path.write_text("".join(line + "\n" for line in lines if json.loads(line)["prompt_id"] in done))


async def evaluate(
    engine: Engine | Scheduler,
    tools: ToolExecutor,
    fmt: PromptFormat,
    problems: Sequence[Problem],
    *,
    cfg: Config,
    out_dir: str | Path,
    concurrency: int = 32,
    seed: int = 0,
) -> dict[str, Any]:
    """Evaluate `problems` with `cfg.eval.k` samples each into `out_dir`; returns the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise DataError("evaluate: problem ids must be unique (set data.id_field)")
    done = read_done(out)
    if any(len(r["correct"]) + r["failed"] != cfg.eval.k for r in done.values()):
        raise DataError(
            f"{out}/results.jsonl: holds results with another k than eval.k = "
            f"{cfg.eval.k}; use a new output directory"
        )
    _keep_finished_trajectories(out / "trajectories.jsonl", set(done))
    verifier = Verifier(cfg.reward)
    agent = Agent(engine, tools, fmt, eval_rollout_config(cfg))
    limit = asyncio.Semaphore(concurrency)

    async def one(problem: Problem) -> tuple[Problem, list[Trajectory]]:
        async with limit:
            groups = await collect(agent, [problem], cfg.eval.k, verifier, seed=seed)
            return problem, groups[0]

    todo = [p for p in problems if p.id not in done]
    lost = 0  # trajectories of problems left without a line
    try:
        with (
            (out / "trajectories.jsonl").open("a") as traj_file,
            (out / "results.jsonl").open("a") as results_file,
            progress_bar(
                total=len(problems), initial=len(problems) - len(todo), desc="eval", unit="problem"
            ) as bar,
        ):
            for finished in asyncio.as_completed([one(p) for p in todo]):
                problem, samples = await finished
                bar.update()
                found = score([samples])
                if not found.per_problem:  # a rerun samples it again
                    lost += found.failed
                    continue
                for t in found.trajectories:
                    record = {**t.to_dict(), "problem": problem.problem, "gold": problem.answer}
                    traj_file.write(json.dumps(record) + "\n")
                traj_file.flush()
                done[problem.id] = problem_result(problem, found)
                results_file.write(json.dumps(done[problem.id]) + "\n")
                results_file.flush()
    finally:
        verifier.close()
    if not done:
        raise RunError(
            f"no problem could be scored: {lost} trajectories "
            "failed in the engine, the server or the sandbox (see the log above)"
        )
    result = summary([done[i] for i in ids if i in done], lost)
    write_atomic(out / "summary.json", json.dumps(result, indent=2) + "\n")
    return result
