"""`codeloop real`: a real pretrained model learns GSM8K with the Python tool, end to end.

1. The model: `trainer.model` in the config: a directory, or a packaged model's name
   (`data/pretrained.py`: `gemma3-270m`, or SmolLM2-135M-Instruct when it is empty) imported
   from its GGUF file on first use.
2. Data: GSM8K's training split in its original format (`data.train`; empty: the copy packaged
   with codeloop, `codeloop/data/gsm8k/train.jsonl`, MIT, OpenAI 2021); a development split
   (`Sizes.dev` problems, drawn with `trainer.seed`) is carved out first and never trained on.
   Both are written to the run directory (`dev.jsonl`, `train.jsonl`, GSM8K's format).
3. Stage 0, non-reasoning SFT (`gsm8k_sft.py`): conversations built from the worked solutions
   of the first `Sizes.sft_problems` training problems, the code run in the real sandbox
   (`sft.jsonl`); the policy is saved to `sft_model/` (a transformers directory).
4. The RL stages of `recipe.stages` (GRPO-RoC, the real sandbox and verifier) on the next
   `Sizes.rl_problems` training problems, which the SFT did not use: stage 1 screens them to
   those the SFT policy solves at all but not always, and stage 3 refilters those to the ones
   the policy still fails; the final policy goes to `final_model/`.
5. After SFT and after the last stage (or where a time limit stopped RL; after each stage
   too with `Sizes.eval_every_stage`): `Sizes.eval_problems` of the development split,
   `Sizes.eval_samples` samples each at the `[eval]` settings: pass@1 (avg@k), the share of
   trajectories that call the tool, the share of calls that are malformed, the tool-error ratio
   among correct trajectories and the mean response length; `summary.json`, `curves.png`.
With `data.rl` set (`tasks.py`; `codeloop real --task gym`), RL trains on another task
instead: a reasoning-gym mix whose held-out problems are the run's points, with the development
split scored beside them.
Every part is skipped when its output exists, so rerunning continues (RL stages resume from their
checkpoints). With a time limit (`minutes`) no RL step starts that would leave too little time
for the last evaluation (EVAL_MARGIN x the longest one so far) and the trained problems' two
scorings (`after_rl_s`) if it took as long as the step before it (a stage's first step, of
unknown length, starts while time is left): the policy where RL stopped is scored (its point is
named `<stage>@<steps>`), and a rerun goes on from there.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from codeloop.config import Config, ConfigError, eval_rollout_config, load_config, stage_config
from codeloop.data.pretrained import PACKAGED, packaged
from codeloop.data.problems import GSM8K_TRAIN, Problem, load_problems, split_dev
from codeloop.engine.hf_engine import TransformersEngine
from codeloop.files import write_atomic
from codeloop.intervals import compare, verdict
from codeloop.memory import (
    available_memory,
    micro_batch_tokens,
    total_bytes,
    training_bytes_per_token,
    trim_when_above,
)
from codeloop.recipe import gsm8k_sft
from codeloop.recipe.gym_sft import build_gym
from codeloop.recipe.plot import plot
from codeloop.recipe.points import first_vs_last, read_points, score_point, score_text
from codeloop.recipe.runner import known_problems, run_recipe
from codeloop.recipe.sizes import Sizes
from codeloop.recipe.tasks import (
    HELD_OUT_FAMILIES,
    by_task,
    paired,
    read_beside,
    report_lines,
    task_data,
)
from codeloop.rollout.policy import Policy
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.score import SCORE
from codeloop.sandbox.pool import LocalSandbox
from codeloop.trainer.distributed import World, one_process
from codeloop.trainer.logs import RunLogger, TensorBoardSink
from codeloop.trainer.rollout_side import local_engine
from codeloop.trainer.sft import train_sft

EVAL_KV_TOKENS = 32768  # prompt + max_tokens reserved by the running requests of an evaluation
# The process before any weights: Python, torch, transformers and reasoning-gym imported
# (measured: 0.41 GiB resident on x86-64 Linux, torch 2.13 CPU)
RUNTIME_BYTES = 440 * 2**20


def disk_needed(parameters: int, stages: int, keep: int) -> int:
    """Bytes a run directory grows to: `keep` checkpoints a stage (float32 weights and AdamW's
    two moments: 12 bytes a parameter) and the SFT and final policies (4 bytes a parameter)."""
    return stages * keep * 12 * parameters + 2 * 4 * parameters


def disk_warning(run_dir: Path, needed: int) -> str | None:
    """A warning when the file system of `run_dir` has less than `needed` bytes free."""
    existing = next(p for p in (run_dir, *run_dir.resolve().parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if free >= needed:
        return None
    return (
        f"codeloop real: {free / 1e9:.1f} GB free under {existing}, and a run takes up to "
        f"{needed / 1e9:.1f} GB (checkpoints with the optimiser's state, the two policies): "
        f"it may stop with 'No space left on device'"
    )


def memory_plan(
    config: Any, parameters: int, cfg: Config, engine_bytes: int = 4, packed: bool = False
) -> dict[str, int]:
    """Bytes of what a run holds at its peak, for a model of `config` (a transformers config)
    with `parameters`: the float32 weights, their gradients and AdamW's two moments; the SFT
    weights kept to score the trained problems; the engine's copy of the weights in the compute
    dtype (`engine_bytes` a parameter), and on a CPU (`packed`) its copies packed for oneDNN
    (`engine/cpu_linear.py`) as many again; the logits and the activations of the larger
    micro-batch (`trainer.micro_batch_tokens`, `sft.micro_batch_tokens`); an evaluation's KV
    cache (EVAL_KV_TOKENS); the process itself (RUNTIME_BYTES)."""
    automatic = micro_batch_tokens(config, available_memory())  # a budget left at 0
    tokens = max(
        cfg.trainer.micro_batch_tokens or automatic, cfg.sft.micro_batch_tokens or automatic
    )
    layers, hidden = config.num_hidden_layers, config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    activations, logits = training_bytes_per_token(config)
    return {
        "weights and AdamW": 16 * parameters,
        "SFT weights": 4 * parameters,
        "engine weights": engine_bytes * parameters * (2 if packed else 1),
        "logits": logits * tokens,
        "activations": activations * tokens,
        "KV cache": EVAL_KV_TOKENS * 2 * layers * kv_heads * head_dim * 4,
        "runtime": RUNTIME_BYTES,
    }


def memory_line(plan: dict[str, int], total: int) -> tuple[str, bool]:
    """The plan in one line against the machine's `total` memory, and whether it fits."""
    need = sum(plan.values())
    parts = ", ".join(f"{name} {size / 2**30:.1f}" for name, size in plan.items())
    line = f"memory: about {need / 2**30:.1f} GiB at the peak ({parts}) of {total / 2**30:.1f} GiB"
    if not total or need <= total:
        return line, True
    return (
        f"{line}: it will not fit; lower trainer.micro_batch_tokens and sft.micro_batch_tokens "
        "(the logits and activations grow with them)",
        False,
    )


def write_problems(path: Path, problems: list[Problem]) -> None:
    """GSM8K's own format, so `codeloop eval --data` reads the file back."""
    lines = [
        json.dumps({"question": p.problem, "answer": f"{p.solution}\n#### {p.answer}"})
        for p in problems
    ]
    path.write_text("\n".join(lines) + "\n")


async def evaluate(
    engine: TransformersEngine,
    fmt: PromptFormat,
    problems: list[Problem],
    tools: Any,
    *,
    cfg: Config,
    samples: int,
    seed: int | None = None,
) -> dict[str, Any]:
    """Development-split point of the policy in `engine` (the run's own) at the `[eval]`
    sampling settings (`score_point`), with what the engine did (`engine`); samples drawn with
    `seed` (default `trainer.seed`)."""
    # On a CPU a reservation cap bounds the batch's KV memory (rollout.kv_capacity_tokens when
    # set): unbounded, 64 rows of up to 1,200 tokens, left-padded, grew a SmolLM2 evaluation
    # past 19 GB on a 24 GB machine. A GPU's slots are allocated for the whole batch, so there
    # the engine admits up to its batch (the cap held an evaluation to ~50 of 256 rows).
    on_gpu = next(engine.model.parameters()).device.type == "cuda"
    before = engine.stats()
    point = await score_point(
        engine,
        fmt,
        problems,
        tools,
        rollout=eval_rollout_config(cfg),
        reward=cfg.reward,
        samples=samples,
        seed=cfg.trainer.seed if seed is None else seed,
        max_kv_tokens=cfg.rollout.kv_capacity_tokens or (0 if on_gpu else EVAL_KV_TOKENS),
        progress="eval",
    )
    return {**point, "engine": engine.stats().since(before).metrics()}


def _splits(cfg: Config, run_dir: Path, sizes: Sizes) -> tuple[list[Problem], list[Problem]]:
    """(train, dev), written to the run directory the first time and read back after."""
    train_file, dev_file = run_dir / "train.jsonl", run_dir / "dev.jsonl"
    if not dev_file.is_file():
        source = cfg.data.train or str(GSM8K_TRAIN)
        train, dev = split_dev(load_problems(source, cfg.data), sizes.dev, seed=cfg.trainer.seed)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_problems(train_file, train)
        write_problems(dev_file, dev)
    return load_problems(str(train_file)), load_problems(str(dev_file))


async def _sft(
    cfg: Config,
    model: Any,
    fmt: PromptFormat,
    train: list[Problem],
    *,
    tools: Any,
    run_dir: Path,
    sizes: Sizes,
    world: World,
    gym_problems: Sequence[Problem] = (),
) -> Any:
    """Stage 0; the SFT policy, loaded when `sft_model/` exists. Its conversations: GSM8K's
    (`gsm8k_sft.py`) and those of `gym_problems` (`gym_sft.py`), kept as `sft.jsonl` (each
    line's problem `id`, and a gym problem's `task`)."""
    saved = run_dir / "sft_model"
    if (saved / "config.json").is_file():
        return Policy.load(saved, cfg).model
    data = run_dir / "sft.jsonl"
    if data.is_file():
        conversations = [json.loads(line)["messages"] for line in data.read_text().splitlines()]
    else:
        built = await gsm8k_sft.build(
            train[: sizes.sft_problems], tools, fmt, sizes.error_share, seed=cfg.trainer.seed
        )
        print(
            f"sft data: {len(built.conversations)} conversations from {sizes.sft_problems} "
            f"solutions; dropped {dict(built.dropped)}",
            flush=True,
        )
        lines = [
            {"id": i, "messages": c} for i, c in zip(built.ids, built.conversations, strict=True)
        ]
        if gym_problems:
            demos = await build_gym(
                gym_problems, tools, fmt, sizes.error_share, seed=cfg.trainer.seed
            )
            tasks = {p.id: p.task for p in gym_problems}
            print(
                f"sft data: {len(demos.conversations)} conversations from "
                f"{len(gym_problems)} gym problems ({_counted(tasks[i] for i in demos.ids)}); "
                f"dropped {dict(demos.dropped)}",
                flush=True,
            )
            lines += [
                {"id": i, "task": tasks[i], "messages": c}
                for i, c in zip(demos.ids, demos.conversations, strict=True)
            ]
        conversations = [line["messages"] for line in lines]
        write_atomic(data, "".join(json.dumps(line) + "\n" for line in lines))
    logger = RunLogger(run_dir / "sft", [TensorBoardSink(run_dir / "sft")])
    try:
        train_sft(
            model.to(world.device),
            fmt,
            conversations,
            cfg.sft,
            logger=logger,
            seed=cfg.trainer.seed,
            grad_clip=cfg.trainer.grad_clip,
            world=world,
        )
    finally:
        logger.close()
    Policy(model, fmt).save(saved)
    trim_when_above(0.0)  # SFT's freed activations go back before the engines take memory
    return model


def _counted(names: Iterable[str]) -> str:
    """`gcd 20, lcm 18, ...`: how many of each name, most first."""
    return ", ".join(f"{name} {n}" for name, n in Counter(names).most_common())


def longest_request(cfg: Config, fmt: PromptFormat, problems: list[Problem]) -> int:
    """The most tokens one request of the recipe can hold: the longest of the problems'
    prompts and the largest response budget, the evaluation's or any stage's (a request
    reserves its prompt and what is left of the budget)."""
    budgets = [cfg.eval.max_response_tokens, cfg.rollout.max_response_tokens]
    budgets += [
        stage_config(cfg, i).rollout.max_response_tokens for i in range(len(cfg.recipe.stages))
    ]
    return max((len(fmt.prompt_ids(p.problem)) for p in problems), default=0) + max(budgets)


FINISH_S = 15.0  # saving the final policy, the summary and the plot, with room to spare
EVAL_MARGIN = 1.25  # the last evaluation, against the longest one so far


async def run_real(cfg: Config, sizes: Sizes | None = None, minutes: float = 0.0) -> dict[str, Any]:
    """The whole recipe (see the module docstring) within `minutes` (0: no limit); returns
    (and writes) the summary."""
    if cfg.trainer.lora.rank:
        raise ConfigError(
            "codeloop real trains the full weights: trainer.lora works with codeloop train and "
            "codeloop recipe (docs/lora.md)"
        )
    sizes = sizes or Sizes()
    start = time.perf_counter()
    end = start + 60 * minutes if minutes else None
    run_dir = Path(cfg.trainer.output_dir)
    # a rerun of a run stopped or done: its `minutes` are this invocation's, not the run's
    resumed = run_dir.is_dir() and any(run_dir.iterdir())
    if not cfg.trainer.model or cfg.trainer.model in PACKAGED:  # imported on first use
        cfg.trainer.model = str(packaged(cfg.trainer.model or "smollm2")())
    train, dev = _splits(cfg, run_dir, sizes)
    pretrained = Policy.load(cfg.trainer.model, cfg)
    model, fmt = pretrained.model, pretrained.fmt
    parameters = sum(p.numel() for p in model.parameters())
    world = one_process(cfg.trainer.dtype)  # SFT, RL's updates and its engine
    engine_bytes = world.compute_dtype.itemsize
    line, fits = memory_line(
        memory_plan(model.config, parameters, cfg, engine_bytes, packed=world.device.type == "cpu"),
        total_bytes(),
    )
    print(line, file=sys.stdout if fits else sys.stderr, flush=True)
    needed = disk_needed(parameters, len(cfg.recipe.stages), cfg.trainer.keep_checkpoints)
    if warning := disk_warning(run_dir, needed):
        print(warning, file=sys.stderr, flush=True)
    points_file, beside_file = run_dir / "points.json", run_dir / "beside.json"
    points, beside = read_points(points_file), read_beside(beside_file)
    data = task_data(cfg, run_dir, sizes, train, dev)
    held_out = data.held_out
    async with LocalSandbox(cfg.sandbox) as tools:

        async def measure(stage: str) -> None:
            if any(p["stage"] == stage for p in points):
                return
            began = time.perf_counter()
            metrics = await evaluate(
                engine, fmt, held_out, tools, cfg=cfg, samples=sizes.eval_samples
            )
            for name, problems in data.beside.items():  # before the point, once a stage
                if any(p["stage"] == stage for p in beside.get(name, [])):
                    continue
                found = await evaluate(engine, fmt, problems, tools, cfg=cfg, samples=1)
                beside.setdefault(name, []).append({"stage": stage, **found})
                write_atomic(beside_file, json.dumps(beside, indent=2))
                _print_point(beside[name][-1], name)
            scored = len(held_out) * sizes.eval_samples + sum(map(len, data.beside.values()))
            seconds = time.perf_counter() - began
            points.append({"stage": stage, **metrics, "seconds": seconds, "scored": scored})
            write_atomic(points_file, json.dumps(points, indent=2))
            _print_point(points[-1], "gym" if data.beside else "dev")

        def rl_deadline(kept: int | None) -> float | None:
            """When RL must stop: the end, less what comes after it (`after_rl_s`; the problems
            RL trains on counted once a stage's screen has kept them)."""
            return None if end is None else end - after_rl_s(points, sizes, kept)

        model = await _sft(
            cfg,
            model,
            fmt,
            train,
            tools=tools,
            run_dir=run_dir,
            sizes=sizes,
            world=world,
            gym_problems=data.sft,
        )
        # the SFT policy's weights, to score the problems RL trains on before and after it
        sft_weights = (
            None
            if (run_dir / TRAINED_FILE).is_file() or not sizes.trained_samples
            else {k: v.detach().clone() for k, v in model.state_dict().items()}
        )
        engine = local_engine(cfg, model, fmt, world)  # the run's one: evaluations and stages
        rl_problems = data.rl
        if engine.slots is not None:  # slots for the longest request now, not grown under graphs
            engine.plan(longest_request(cfg, fmt, [*held_out, *rl_problems]))
        sft_s = time.perf_counter() - start
        await measure("sft")
        if end is not None:
            spent_s = time.perf_counter() - start  # less than SFT and the evaluation on a rerun
            first_s = points[0]["seconds"]
            text = budget(
                cfg, sizes, minutes, sft_s, eval_s=first_s, spent_s=spent_s, points=points
            )
            print(text, flush=True)
        policy = "sft"  # what the model is now: scored at the end, after each stage if asked

        async def after_stage(name: str) -> None:
            nonlocal policy
            policy = name
            if sizes.eval_every_stage:
                await measure(name)

        stages = await run_recipe(
            cfg,
            model,
            fmt,
            rl_problems,
            tools=tools,
            world=world,
            deadline=rl_deadline,
            engine=engine,
            after_stage=after_stage,
        )
        last = stages[-1]
        stopped: dict[str, Any] | None = None
        if "stopped_at" in last:
            stopped = {"stage": last["stage"], "step": last["stopped_at"], "of": last["steps"]}
            if last["stopped_at"]:
                policy = f"{last['stage']}@{last['stopped_at']}"
        await measure(policy)
        trained_ids = _trained_ids(stages)  # the harder problems stages drew included
        trained = [p for p in known_problems(run_dir, rl_problems) if p.id in trained_ids]
        left_s = None if end is None else end - FINISH_S - time.perf_counter()
        trained_result = await _score_trained(
            engine,
            fmt,
            trained,
            tools,
            cfg=cfg,
            sizes=sizes,
            run_dir=run_dir,
            policies=(sft_weights, model),
            left_s=left_s,
            points=points,
        )
        if stopped is not None and "reason" in last:
            stopped["reason"] = last["reason"]
            print(f"RL ended before {stopped['stage']}: {last['reason']}", flush=True)
        elif stopped is not None:
            print(
                f"time limit: RL stopped before step {stopped['step'] + 1} of {stopped['of']} "
                f"of {stopped['stage']}; rerun to go on",
                flush=True,
            )
    Policy(model, fmt).save(run_dir / "final_model")
    summary: dict[str, Any] = {
        "model": cfg.trainer.model,
        "sizes": asdict(sizes),
        "points": points,
        "minutes": (time.perf_counter() - start) / 60,
        "resumed": resumed,
        "stopped": stopped,
        "trained_problems": trained_result,
    }
    if data.beside:  # a gym run: its held-out problems by task, and the sets scored beside
        table = by_task(held_out, points[0], points[-1])
        summary["gym"], summary["gym_by_task"] = table["overall"], table
        summary["beside"] = {
            name: {"points": found, **paired(found[0]["per_problem"], found[-1]["per_problem"])}
            for name, found in beside.items()
            if len(found) > 1
        }
        summary["families"] = data.families
        if len(found := beside.get(HELD_OUT_FAMILIES, [])) > 1:  # in neither SFT nor RL
            table = by_task(data.beside[HELD_OUT_FAMILIES], found[0], found[-1])
            summary[HELD_OUT_FAMILIES] = {**table["overall"], "by_task": table}
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    plot(points, run_dir / "curves.png")
    return summary


def budget(
    cfg: Config,
    sizes: Sizes,
    minutes: float,
    sft_s: float,
    *,
    eval_s: float,
    spent_s: float | None = None,
    points: Sequence[dict[str, Any]] = (),
) -> str:
    """The run's plan in time, from the first evaluation's rate (trajectories a second): the
    screen, an RL step's sampling and the last evaluation at that rate, and at most how many RL
    steps fit in what is left of `minutes` after
    `spent_s` (this process's time so far; by default SFT's and the first evaluation's: a rerun
    that found them done has spent less). An evaluation scores `scored_per_point` trajectories
    (its sets beside the held-out problems included)."""
    rate = scored_per_point(points, sizes) / max(eval_s, 1e-9)
    first = cfg.recipe.stages[0] if cfg.recipe.stages else None
    screened = sizes.rl_problems * first.refilter_samples if first and first.refilter else 0
    screen_s = screened / rate
    step_s = cfg.trainer.prompts_per_step * cfg.algo.group_size * cfg.algo.oversample / rate
    last_s = EVAL_MARGIN * eval_s
    trained_s = 2 * expected_trained(sizes) * sizes.trained_samples / rate
    spent_s = sft_s + eval_s if spent_s is None else spent_s
    left_s = 60 * minutes - spent_s - screen_s - last_s - trained_s - FINISH_S
    planned = sum(stage.steps for stage in cfg.recipe.stages)
    fits = max(0, min(planned, int(left_s // step_s)))
    return (
        f"budget ({minutes:g} min): SFT {sft_s / 60:.1f} min and the first evaluation "
        f"{eval_s / 60:.1f} min ({rate:.1f} trajectories/s); at that rate the screen "
        f"{screen_s / 60:.1f} min, an RL step's sampling {step_s:.0f} s, the last evaluation "
        f"{last_s / 60:.1f} min and the trained problems' two {trained_s / 60:.1f} min: room "
        f"for at most {fits} of the {planned} RL steps (their updates come on top: the first "
        "step says how many fit)"
    )


def after_rl_s(points: list[dict[str, Any]], sizes: Sizes, trained: int | None = None) -> float:
    """The time to keep for what follows RL: the last evaluation (the longest one so far and a
    quarter: a trained policy answers at more length), the problems RL trains on (`trained`,
    once a screen has kept them; else as many as expected) scored twice at the same rate
    (`_score_trained`), and FINISH_S."""
    longest = max((p.get("seconds", 0.0) for p in points), default=0.0)
    count = expected_trained(sizes) if trained is None else trained
    share = count * sizes.trained_samples / scored_per_point(points, sizes)
    return EVAL_MARGIN * longest * (1 + 2 * share) + FINISH_S


def scored_per_point(points: Sequence[dict[str, Any]], sizes: Sizes) -> int:
    """The trajectories an evaluation scores: as the first point recorded them (the held-out
    problems' samples and the sets scored beside), else the held-out problems' samples."""
    recorded = points[0].get("scored", 0) if points else 0
    return max(1, recorded or sizes.eval_problems * sizes.eval_samples)


def expected_trained(sizes: Sizes) -> int:
    """The problems RL is expected to train on before the screen has run: a tenth of those
    screened (the real recipe's screens kept 4-11 of 120 on a CPU, 46 of 600 on a GPU)."""
    return max(1, sizes.rl_problems // 10)


TRAINED_SEED = 1  # added to trainer.seed: samples fresh to the screen's and to RL's
TRAINED_FILE = "trained.json"


def _trained_ids(stages: list[dict[str, Any]]) -> set[str]:
    """The problems of the stages that ran at least one RL step."""
    return {
        pid
        for stage in stages
        if stage.get("stopped_at", stage["steps"])
        for pid in stage.get("problem_ids", [])
    }


async def _score_trained(
    engine: TransformersEngine,
    fmt: PromptFormat,
    trained: list[Problem],
    tools: Any,
    *,
    cfg: Config,
    sizes: Sizes,
    run_dir: Path,
    policies: tuple[dict[str, Any] | None, Any],
    left_s: float | None,
    points: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """The problems RL trained on, scored with the SFT policy (`policies`: its weights, or
    None to read `sft_model/`) and with the final one (the model) on the same fresh samples
    (`sizes.trained_samples` each, the [eval] settings, seeded apart from the screen and RL):
    their pass rates and the paired difference, in points (`trained.json`; a rerun reads it).
    None when RL trained on nothing, or when the time left (`left_s`) cannot hold the two
    evaluations (a rerun scores them)."""
    saved = run_dir / TRAINED_FILE
    if saved.is_file():
        found: dict[str, Any] = json.loads(saved.read_text())
        return found
    if not trained or not sizes.trained_samples:
        return None
    dev_share = len(trained) * sizes.trained_samples / scored_per_point(points, sizes)
    needed_s = 2 * EVAL_MARGIN * dev_share * max(p.get("seconds", 0.0) for p in points)
    if left_s is not None and needed_s > left_s:
        print(
            f"trained problems: not scored ({left_s:.0f} s left, about {needed_s:.0f} s "
            "needed); rerun to score them",
            flush=True,
        )
        return None
    seed = cfg.trainer.seed + TRAINED_SEED
    sft, model = policies
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if sft is None:
        sft = Policy.load(run_dir / "sft_model", cfg).model.state_dict()
    engine.update_weights(sft)
    samples = sizes.trained_samples
    before = await evaluate(engine, fmt, trained, tools, cfg=cfg, samples=samples, seed=seed)
    engine.update_weights(final)
    after = await evaluate(engine, fmt, trained, tools, cfg=cfg, samples=samples, seed=seed)
    paired = compare(before["per_problem"], after["per_problem"])
    print(
        f"trained problems ({sizes.trained_samples} fresh samples each): "
        + verdict(paired, "sft", points[-1]["stage"]),
        flush=True,
    )
    result = {
        "problems": paired["problems"],
        "samples": sizes.trained_samples,
        "before": before[SCORE],
        "before_interval95": [before[SCORE + "_low"], before[SCORE + "_high"]],
        "after": after[SCORE],
        "after_interval95": [after[SCORE + "_low"], after[SCORE + "_high"]],
        "difference": 100 * paired["difference"],
        "interval95": [100 * x for x in paired["interval95"]],
        "p_value": paired["p_value"],
        "per_problem": {"before": before["per_problem"], "after": after["per_problem"]},
    }
    write_atomic(saved, json.dumps(result, indent=2))
    return result


def _print_point(point: dict[str, Any], what: str = "dev") -> None:
    print(
        f"[{point['stage']}] {what} pass@1 {score_text(point)}, "
        f"tool use {100 * point['tool_use']:.0f}%, "
        f"cut off inside a call {100 * point['cut_off_in_call']:.0f}%, "
        f"malformed calls {100 * point['malformed_calls']:.1f}%, "
        f"tool errors among correct {100 * point['tool_error_ratio_correct']:.1f}%, "
        f"a right output answered wrong {100 * point.get('printed_right_answered_wrong', 0):.1f}%, "
        f"response {point['response_tokens']:.0f} tokens",
        flush=True,
    )


def main(config: str, overrides: list[str], sizes: Sizes, minutes: float = 0.0) -> int:
    cfg = load_config(config, overrides)
    torch.manual_seed(cfg.trainer.seed)
    summary = asyncio.run(run_real(cfg, sizes, minutes))
    first, last = summary["points"][0], summary["points"][-1]
    print(
        f"\nreal: {summary['minutes']:.1f} min{' (this rerun)' if summary['resumed'] else ''}; "
        f"{'gym' if 'gym' in summary else 'dev'} pass@1 "
        f"{score_text(first)} after SFT -> "
        f"{score_text(last)} after RL ({last['stage']}); "
        f"{cfg.trainer.output_dir}/summary.json"
    )
    gym = "gym" in summary
    print(first_vs_last(summary["points"], "held-out gym pass@1" if gym else "dev pass@1"))
    if gym:
        print("\n".join(report_lines("gym", summary["gym_by_task"])))
        for name, found in summary["beside"].items():
            print(first_vs_last(found["points"], f"{name} pass@1"))
        if HELD_OUT_FAMILIES in summary:
            by_family = summary[HELD_OUT_FAMILIES]["by_task"]
            print("\n".join(report_lines("held-out family", by_family)))
    return 0
