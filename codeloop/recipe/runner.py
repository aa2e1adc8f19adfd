"""Run a multi-stage recipe: each stage continues from the previous policy.

For stage i (`recipe.stages[i]`, its `overrides` applied to the config), in
`<output_dir>/<i>-<name>/`: optionally refilter the problems to those whose pass rate under the
current policy lies in [`refilter_min_pass_rate`, `refilter_max_pass_rate`] (`refilter_samples`
samples each: up to a maximum, the problems it does not solve reliably; from a minimum above 0,
only problems it solves at all), then run `steps` GRPO-RoC steps. A stage trains on the problems
of the stage before it (the refiltered ones, if it refiltered); a refilter's choice is kept in
the stage's `problems.json`, so a resumed or skipped stage reuses it instead of sampling anew.
The optimiser and its schedule carry over from the previous stage unless `reset_optimizer`.
A stage that finished (`stage.json` written) is skipped on a rerun, with its final weights
loaded; an unfinished one resumes from its latest checkpoint.
A stage that trains on the same problems as the one before continues its data order where it
stopped (a refiltered stage starts its own list from the beginning); warm-up runs once, in the
first stage, unless a stage resets the optimiser.

Under torchrun every rank runs the stages (FSDP2 over the ranks, as `codeloop train`): the
refilter samples each rank's share of the problems and gathers the pass rates, rank 0 writes
`stage.json`, and after a stage each rank starts the next from the stage's final (unsharded)
checkpoint. The run directory must be shared by the ranks (one node, or a shared file system).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from codeloop.algo.group import expected_signal, sampled_per_step
from codeloop.config import AlgoConfig, Config, ConfigError, stage_config
from codeloop.data.curate import write_problems
from codeloop.data.problems import DataError, Problem, load_problems
from codeloop.engine.hf_engine import TransformersEngine
from codeloop.errors import RunError
from codeloop.files import write_atomic
from codeloop.recipe.tasks import gym_mix
from codeloop.rollout.policy import Policy
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.tools import ToolExecutor
from codeloop.trainer import lora
from codeloop.trainer.checkpoint import latest_checkpoint, read_state
from codeloop.trainer.distributed import World, barrier, one_process
from codeloop.trainer.logs import read_metrics
from codeloop.trainer.rl import RLRun, opened_run
from codeloop.trainer.state import RunState

# a time.perf_counter() value, or asked before each stage (with None) and before each of its RL
# steps (with the count of problems its screen kept)
Deadline = float | Callable[[int | None], float | None] | None


async def run_recipe(
    cfg: Config,
    model: Any,
    fmt: PromptFormat,
    problems: Sequence[Problem],
    *,
    tools: ToolExecutor,
    world: World | None = None,
    deadline: Deadline = None,
    engine: TransformersEngine | None = None,
    after_stage: Callable[[str], Awaitable[None]] | None = None,
) -> list[dict[str, Any]]:
    """Run every stage; return one summary per stage (also written to its `stage.json`).
    Without a `world`: one process on the default device, computing in `trainer.dtype`.
    `deadline` (a `time.perf_counter()` value, or a function asked before each stage): no RL
    step starts that would end after it (`RLRun.train`), and no stage starts after it; a stage
    cut short is checkpointed but not marked finished (a rerun goes on with it), its summary
    says `stopped_at` (the steps it has), and no later stage runs. `engine`: the in-process
    engine every stage samples with (the run's own, kept up to date with `model`'s weights;
    without one each stage builds its own). `after_stage(name)` runs after each stage that
    ends, one finished on an earlier run included, with `model` (and `engine`) holding its
    final weights: an evaluation, a report."""
    world = world or one_process(cfg.trainer.dtype)
    if not cfg.recipe.stages:
        raise ConfigError("recipe.stages is empty: nothing to run")
    if cfg.trainer.lora.rank and not world.distributed:  # every stage trains these adapters
        model = lora.attach(model, cfg.trainer.lora)
    for index, stage in enumerate(cfg.recipe.stages):  # a bad mix fails now, not at its stage
        gym_mix(stage.harder, f"recipe.stages[{index}].harder")
    summaries: list[dict[str, Any]] = []
    carried: dict[str, Any] | None = None  # optimiser and schedule state of the previous stage
    current = list(problems)  # what the stage before trained on
    for index, stage in enumerate(cfg.recipe.stages):
        scfg = stage_config(cfg, index)
        stage_dir = Path(cfg.trainer.output_dir) / f"{index + 1}-{stage.name or 'stage'}"
        done = stage_dir / "stage.json"
        if done.is_file():
            carried = _load_final_state(stage_dir, model)
            if engine is not None:
                engine.update_weights(lora.merged_state(model))
            summaries.append(json.loads(done.read_text()))
            current = _refiltered(stage_dir, known_problems(stage_dir.parent, problems)) or current
            if after_stage is not None:
                await after_stage(stage.name)
            continue
        until = deadline(None) if callable(deadline) else deadline
        if until is not None and time.perf_counter() >= until:  # not even its refilter
            summaries.append(_stopped(stage, index, len(current), 0))
            break
        async with opened_run(
            scfg, model, fmt, current, tools=tools, run_dir=stage_dir, world=world, engine=engine
        ) as run:
            known = known_problems(Path(cfg.trainer.output_dir), problems)
            kept = _refiltered(stage_dir, known) if stage.refilter else None
            if kept is None:
                kept = list(
                    await _stage_problems(
                        run, stage, current, later=bool(summaries), index=index, where=stage_dir
                    )
                )
                if stage.refilter and world.is_main:
                    write_atomic(stage_dir / PROBLEMS_FILE, json.dumps([p.id for p in kept]))
            if not kept:  # a later stage's screen: the policy solves all it trained on
                summaries.append(_stopped(stage, index, 0, 0, NO_PROBLEMS_LEFT))
                break
            run.use_problems(kept)
            current = kept
            if carried is not None:  # the same problems: go on drawing where it stopped
                run.carry_on_from(carried, stage.reset_optimizer)
            if run.resume():
                print(f"{stage_dir.name}: resumed from step {run.step_index}")
            asked = partial(deadline, len(kept)) if callable(deadline) else until
            history = await run.train(stage.steps - run.step_index, stage_dir.name, deadline=asked)
        if run.step_index < stage.steps:  # out of time
            summaries.append(
                {
                    **_stopped(stage, index, len(kept), run.step_index),
                    "problem_ids": [p.id for p in kept],
                }
            )
            break
        logged = read_metrics(stage_dir)[-1:]  # killed after the stage's last step: no history
        final = (
            history[-1] if history else {k: v for r in logged for k, v in r.items() if k != "step"}
        )
        summary = {
            "stage": stage.name,
            "index": index,
            "steps": stage.steps,
            "problems": len(kept),
            "problem_ids": [p.id for p in kept],
            "final": final,
        }
        if world.is_main:
            write_atomic(done, json.dumps(summary, indent=2))
        barrier(world)
        summaries.append(summary)
        carried = run.carried()
        del run  # without a shared engine, its own and its KV go before the next stage's
        if world.distributed:  # `model` is sharded now: the next stage starts from a full copy
            model = _final_model(stage_dir)
        if after_stage is not None:
            await after_stage(stage.name)
    return summaries


NO_PROBLEMS_LEFT = "its screen kept no problems"  # a later stage's: RL ends before it


def _stopped(
    stage: Any, index: int, problems: int, at: int, reason: str | None = None
) -> dict[str, Any]:
    """The summary of a stage that ended at step `at` of its own: out of time, or (`reason`)
    with nothing left to train on."""
    summary = {
        "stage": stage.name,
        "index": index,
        "steps": stage.steps,
        "problems": problems,
        "stopped_at": at,
    }
    return {**summary, "reason": reason} if reason else summary


async def _stage_problems(
    run: RLRun,
    stage: Any,
    problems: Sequence[Problem],
    later: bool = False,
    *,
    index: int = 0,
    where: Path | None = None,
) -> Sequence[Problem]:
    """The problems a stage trains on: with `refilter`, those whose pass rate over fresh
    samples is in the stage's band (with `stage.harder`, among them the new problems of each
    family the policy solved: `_harder`, kept in `where`). None kept is an error for the first
    stage that trains (nothing to learn from) and the end of RL for a later one (`later`: all
    solved or none)."""
    if not stage.refilter:
        return problems
    samples = stage.refilter_samples
    low, high = stage.refilter_min_pass_rate, stage.refilter_max_pass_rate
    found = await run.score(problems, samples, f"{stage.name or 'stage'} refilter")
    rates = dict(found.per_problem)
    if stage.harder:
        seed = run.cfg.trainer.seed + HARDER_SEED + index
        new = _harder(stage, problems, rates, seed, say=run.world.is_main)
        if new:
            if where is not None and run.world.is_main:
                write_problems(where / HARDER_FILE, new)
            more = await run.score(new, samples, f"{stage.name or 'stage'} harder refilter")
            rates.update(more.per_problem)
            problems = [*problems, *new]
    kept = [p for p in problems if p.id in rates and low <= rates[p.id] <= high]
    band = f"<= {high}" if low == 0 else f"in [{low}, {high}]"
    if run.world.is_main:
        unscored = len(problems) - len(rates)
        print(
            f"refilter: kept {len(kept)} of {len(problems)} problems "
            f"(pass rate {band} over {samples} samples)"
            + (
                f"; {unscored} left out, the infrastructure failed all their samples"
                if unscored
                else ""
            )
            + _signal_outlook(
                run.cfg.algo, list(rates.values()), [rates[p.id] for p in kept], samples
            )
        )
    if not kept and not later:
        too_easy = sum(rates.get(p.id, 0.0) > high for p in problems)
        raise RunError(
            f"refilter kept no problems ({too_easy} of {len(problems)} solved "
            f"more often than {high}, the rest less often than {low}): widen "
            "refilter_min_pass_rate and refilter_max_pass_rate, or add "
            "problems"
        )
    return kept


HARDER_SEED = 5_000_003  # added to trainer.seed and the stage's index: harder problems' draw
HARDER_FILE = "harder.jsonl"  # a stage's harder problems, beside its problems.json


def _harder(
    stage: Any, problems: Sequence[Problem], rates: dict[str, float], seed: int, say: bool = True
) -> list[Problem]:
    """New problems for each family (gym task) of `problems` whose mean pass rate in `rates` is
    above the stage's `refilter_max_pass_rate` and which `stage.harder` (a gym mix) sets: as
    many as the family has, drawn from those settings with `seed`. Printed, one line."""
    from codeloop.data import gym

    settings = {t.task: t for t in gym_mix(stage.harder)}
    by_family: dict[str, list[float]] = {}
    for p in problems:
        if p.task in settings and p.id in rates:
            by_family.setdefault(p.task, []).append(rates[p.id])
    solved = {
        family: found
        for family, found in sorted(by_family.items())
        if sum(found) / len(found) > stage.refilter_max_pass_rate
    }
    new: list[Problem] = []
    for n, (family, found) in enumerate(solved.items()):
        new += gym.generate([settings[family]], len(found), seed + n, split=f"gym-harder-{family}")
    if solved and say:
        print(
            "harder: "
            + ", ".join(
                f"{family} (solved {100 * sum(found) / len(found):.0f}%: {len(found)} new)"
                for family, found in solved.items()
            ),
            flush=True,
        )
    return new


def known_problems(output_dir: Path, problems: Sequence[Problem]) -> list[Problem]:
    """The recipe's problems and the harder ones its stages drew (`harder.jsonl`)."""
    found = list(problems)
    for path in sorted(output_dir.glob(f"*/{HARDER_FILE}")):
        found += load_problems(str(path))
    return found


def _signal_outlook(
    algo: AlgoConfig, screened: list[float], kept: list[float], samples: int
) -> str:
    """What the screen says of RL's groups (`expected_signal`): the share expected to have
    signal and, when those without are refilled, the prompts a step samples for each kept."""
    if not kept:
        return ""
    n = algo.group_size * algo.oversample
    signal = expected_signal(screened, kept, samples, n)
    outlook = f"; expected in RL: signal in about {100 * signal:.0f}% of groups of {n} samples"
    if algo.drop_zero_signal_groups and signal > 0:
        outlook += f", about {sampled_per_step(signal):.1f}x a step's prompts sampled"
    return outlook


PROBLEMS_FILE = "problems.json"  # a refiltered stage's problem ids, in training order


def _refiltered(stage_dir: Path, problems: Sequence[Problem]) -> list[Problem] | None:
    """The problems a stage's refilter kept (`problems.json`), or None when it wrote none."""
    path = stage_dir / PROBLEMS_FILE
    if not path.is_file():
        return None
    by_id = {p.id: p for p in problems}
    ids = json.loads(path.read_text())
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise DataError(
            f"{path}: problems {missing[:3]} are not in the recipe's problems "
            "(the data changed since the refilter: remove the file to "
            "refilter)"
        )
    return [by_id[i] for i in ids]


def _final_checkpoint(stage_dir: Path) -> Path:
    path = latest_checkpoint(stage_dir)
    if path is None:
        raise RunError(
            f"{stage_dir}: stage.json says the stage ended, but it has no checkpoint "
            "to go on from: remove stage.json to run the stage again"
        )
    return path


def _final_model(stage_dir: Path) -> Any:
    """A fresh, unsharded model with a finished stage's final (float32) weights."""
    return Policy.load(_final_checkpoint(stage_dir) / "model").model


def _load_final_state(stage_dir: Path, model: Any) -> dict[str, Any]:
    """Load a finished stage's final weights into `model`; return its optimiser, schedule and
    run state."""
    path = _final_checkpoint(stage_dir)
    lora.load_weights(model, path / "model")
    state = read_state(path)
    return {
        "optimizer": state["optimizer"],
        "lr_schedule": state["lr_schedule"],
        "state": RunState.restored(state["extra"]),
    }


async def run_recipe_from_config(cfg: Config) -> list[dict[str, Any]]:
    """`codeloop recipe`: the policy, problems and sandbox the config names, every stage."""
    from codeloop.trainer import distributed
    from codeloop.trainer.run import prepare, tools_for

    world = distributed.init(cfg.trainer.dtype)  # torchrun: FSDP2 over the ranks; else one
    model, fmt, problems = prepare(cfg)
    async with tools_for(cfg) as tools:
        return await run_recipe(cfg, model, fmt, problems, tools=tools, world=world)
