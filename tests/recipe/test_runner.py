import asyncio
import gc
import json
import shutil
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from codeloop.config import Config, SandboxConfig, StageConfig
from codeloop.data.problems import Problem
from codeloop.data.tokenizer import train_tokenizer
from codeloop.engine.hf_engine import TransformersEngine
from codeloop.engine.model import default_device, tiny_model
from codeloop.engine.protocol import Generation, SamplingParams
from codeloop.errors import RunError
from codeloop.recipe.runner import _stage_problems, run_recipe
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.score import Scores, score_policy
from codeloop.sandbox.pool import LocalSandbox
from codeloop.trainer import rl
from codeloop.trainer.checkpoint import read_state
from codeloop.trainer.distributed import World
from codeloop.trainer.logs import RunLogger
from codeloop.trainer.rl import build_run

PROBLEMS = [Problem(f"p{i}", f"What is {i} + {i}?", str(2 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def fmt() -> PromptFormat:
    return PromptFormat(train_tokenizer(["What is 1 + 1? print(2) The answer is 2."] * 50, 300))


def _config(run_dir: Path) -> Config:
    cfg = Config()
    cfg.trainer.output_dir = str(run_dir)
    cfg.trainer.prompts_per_step, cfg.trainer.checkpoint_every = 2, 1
    cfg.algo.group_size, cfg.algo.oversample = 2, 1
    cfg.rollout.max_response_tokens = 8
    cfg.reward.workers = 1
    cfg.recipe.stages = [
        StageConfig(name="short", steps=2),
        StageConfig(name="longer", steps=1, overrides={"rollout": {"max_response_tokens": 12}}),
        StageConfig(name="hard", steps=1, refilter=True, refilter_samples=2, reset_optimizer=True),
    ]
    return cfg


def _recipe(fmt: PromptFormat, cfg: Config) -> list[dict]:  # type: ignore[type-arg]
    async def main() -> list[dict]:  # type: ignore[type-arg]
        model = tiny_model(len(fmt.tokenizer), hidden_size=32)
        async with LocalSandbox(SandboxConfig(workers=1)) as sandbox:
            return await run_recipe(cfg, model, fmt, PROBLEMS, tools=sandbox)

    return asyncio.run(main())


@pytest.mark.slow
def test_stages_run_in_order_and_a_rerun_skips_finished_ones(
    fmt: PromptFormat, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engines: list[weakref.ref[TransformersEngine]] = []  # every engine made
    engines_alive: list[int] = []  # when a stage builds its run: the last stage's engine is gone
    make_engine = TransformersEngine.__init__

    def made(self: TransformersEngine, *args: Any, **kwargs: Any) -> None:
        make_engine(self, *args, **kwargs)
        engines.append(weakref.ref(self))

    def build_run(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        engines_alive.append(sum(engine() is not None for engine in engines))
        return runner_build_run(*args, **kwargs)

    runner_build_run = rl.build_run
    monkeypatch.setattr(TransformersEngine, "__init__", made)
    monkeypatch.setattr(rl, "build_run", build_run)  # what each stage's opened_run calls
    cfg = _config(tmp_path)
    summaries = _recipe(fmt, cfg)
    assert engines_alive == [0, 0, 0] and len(engines) == 3  # one engine a stage
    assert [s["stage"] for s in summaries] == ["short", "longer", "hard"]
    assert [s["problems"] for s in summaries] == [4, 4, 4]  # an untrained policy solves nothing
    assert summaries[1]["final"]["rollout/response_tokens"] <= 12
    states = {
        d.name: read_state(sorted((d / "checkpoints").glob("step_*"))[-1])
        for d in tmp_path.iterdir()
    }
    # An untrained policy has no signal: no optimiser step; the schedule advances per RL step
    assert all(not s["optimizer"]["state"] for s in states.values())
    steps = {name: s["lr_schedule"]["last_epoch"] for name, s in states.items()}
    assert steps == {"1-short": 2, "2-longer": 3, "3-hard": 1}  # carried over, then reset
    # No group has signal: each step draws 2 prompts in each of its 4 refill rounds. "longer"
    # goes on from position 16, where "short" stopped; "hard"'s refilter kept the same four
    # problems, so it goes on too (a list that differs would start from 0)
    positions = {name: s["extra"]["data_position"] for name, s in states.items()}
    assert positions == {"1-short": 16, "2-longer": 24, "3-hard": 32}
    assert _recipe(fmt, cfg) == summaries  # everything finished: nothing runs again


@pytest.mark.slow
def test_a_lora_recipe_trains_one_set_of_adapters_through_its_stages(
    fmt: PromptFormat, tmp_path: Path
) -> None:
    """Each stage samples with its own engine, a plain copy with the adapters merged; each
    checkpoints the adapters alone; a rerun loads the finished stages' adapters onto the same
    base and runs nothing."""
    cfg = _config(tmp_path)
    cfg.trainer.lora.rank, cfg.recipe.stages = 2, cfg.recipe.stages[:2]
    summaries = _recipe(fmt, cfg)
    assert [s["stage"] for s in summaries] == ["short", "longer"]
    for stage in ("1-short", "2-longer"):
        saved = sorted((tmp_path / stage / "checkpoints").glob("step_*"))[-1] / "model"
        assert (saved / "adapter_model.safetensors").is_file()
        assert not (saved / "model.safetensors").exists()
    assert _recipe(fmt, cfg) == summaries


@pytest.mark.slow
def test_a_refiltered_stage_hands_its_problems_on_and_keeps_its_choice(
    fmt: PromptFormat, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 1 keeps the problems solved at least half the time (p2 alone, as the pass rates
    below say); stage 2 trains on those, not on all four; a rerun samples no pass rates again."""
    sampled: list[list[str]] = []

    async def rates(agent: object, problems: list[Problem], *args: object, **kw: object) -> Scores:
        sampled.append([p.id for p in problems])
        return Scores({p.id: 1.0 if p.id == "p2" else 0.0 for p in problems})

    monkeypatch.setattr(rl, "score_policy", rates)  # what RLRun.score samples with
    cfg = _config(tmp_path)
    cfg.recipe.stages = [
        StageConfig(
            name="screen",
            steps=1,
            refilter=True,
            refilter_samples=2,
            refilter_min_pass_rate=0.5,
            refilter_max_pass_rate=1.0,
        ),
        StageConfig(name="more", steps=1),
    ]
    summaries = _recipe(fmt, cfg)
    assert sampled == [["p0", "p1", "p2", "p3"]]
    assert [s["problems"] for s in summaries] == [1, 1]  # stage 2 trains on stage 1's choice
    assert (tmp_path / "1-screen" / "problems.json").read_text() == '["p2"]'
    trained = {
        json.loads(line)["prompt_id"]
        for d in ("1-screen", "2-more")
        for f in (tmp_path / d / "trajectories").glob("*.jsonl")
        for line in f.read_text().splitlines()
    }
    assert trained == {"p2"}
    for name in ("1-screen", "2-more"):  # both unfinished again: stage 1 resumes, 2 reruns
        (tmp_path / name / "stage.json").unlink()
    shutil.rmtree(tmp_path / "2-more")
    assert [s["problems"] for s in _recipe(fmt, cfg)] == [1, 1]
    assert len(sampled) == 1  # the refilter's choice was read back, not sampled anew


@pytest.mark.slow
def test_a_later_screen_that_keeps_nothing_ends_rl_and_a_first_one_is_an_error(
    fmt: PromptFormat, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A policy that solves every problem it trained on leaves stage 2's screen (pass rate at
    most 0.75) nothing: RL ends after stage 1 with a summary that says why, not with an error
    that loses the run (Gemma 3 270M's gym recipe solved all 10 of its problems by stage 3).
    The same screen as the first stage has nothing to train on at all: an error naming it."""

    async def rates(agent: object, problems: list[Problem], *args: object, **kw: object) -> Scores:
        return Scores({p.id: 1.0 for p in problems})

    monkeypatch.setattr(rl, "score_policy", rates)
    cfg = _config(tmp_path)
    hard = StageConfig(
        name="hard", steps=1, refilter=True, refilter_samples=2, refilter_max_pass_rate=0.75
    )
    cfg.recipe.stages = [StageConfig(name="first", steps=1), hard]
    summaries = _recipe(fmt, cfg)
    assert [s["stage"] for s in summaries] == ["first", "hard"]
    assert "stopped_at" not in summaries[0] and summaries[0]["problems"] == 4
    assert (
        summaries[1]["stopped_at"] == 0 and summaries[1]["reason"] == "its screen kept no problems"
    )
    assert (tmp_path / "2-hard" / "problems.json").read_text() == "[]"
    assert not (tmp_path / "2-hard" / "stage.json").exists()
    assert _recipe(fmt, cfg) == summaries  # a rerun reads the screen back and ends the same

    cfg = _config(tmp_path / "again")
    cfg.recipe.stages = [hard]
    with pytest.raises(RunError, match="refilter kept no problems \\(4 of 4 solved more often"):
        _recipe(fmt, cfg)


def test_pass_rates_count_correct_samples(fmt: PromptFormat) -> None:
    class Answers:  # answers "4" to everything: right for p2 only
        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
            ids = fmt.encode("<answer>\\boxed{4}</answer><|im_end|>")
            return Generation(ids, [-0.1] * len(ids), "stop")

    class NoTools:
        async def execute(self, request: object) -> object:
            raise AssertionError("no tool call expected")

    with Verifier() as verifier:
        agent = Agent(Answers(), NoTools(), fmt, _config(Path("/tmp")).rollout)  # type: ignore[arg-type]
        rates = asyncio.run(score_policy(agent, PROBLEMS, 3, verifier)).per_problem
    assert rates == {"p0": 0.0, "p1": 0.0, "p2": 1.0, "p3": 0.0}


@pytest.mark.parametrize(
    ("low", "high", "want"), [(0.0, 0.5, ["p0", "p1", "p3"]), (0.5, 1.0, ["p2"])]
)
def test_refilter_keeps_the_problems_within_the_pass_rate_band(
    fmt: PromptFormat, tmp_path: Path, low: float, high: float, want: list[str]
) -> None:
    """The policy masters p2 and never solves the others: a band up to 0.5 keeps what it finds
    hard (stage 3 of the recipes), one from 0.5 what it solves at all (the real recipe's first
    stage: a problem it never solves gives no signal)."""

    class Answers:  # an engine answering "4" to everything: it masters p2 (2 + 2) only
        def __init__(self) -> None:
            self.weights_updates = 0

        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
            ids = fmt.encode("<answer>\\boxed{4}</answer><|im_end|>")
            return Generation(ids, [-0.1] * len(ids), "stop")

        def update_weights(self, state: object, version: int = 0) -> None:
            self.weights_updates += 1

    cfg = _config(tmp_path)
    stage = StageConfig(
        name="hard",
        steps=1,
        refilter=True,
        refilter_samples=3,
        refilter_min_pass_rate=low,
        refilter_max_pass_rate=high,
    )
    engine = Answers()
    logger = RunLogger(tmp_path)
    model = tiny_model(len(fmt.tokenizer), hidden_size=32)
    run = build_run(cfg, model, fmt, PROBLEMS, tools=None, logger=logger, engine=engine)  # type: ignore[arg-type]
    try:
        kept = asyncio.run(_stage_problems(run, stage, PROBLEMS))
    finally:
        run.rollout.verifier.close()
        logger.close()
    assert engine.weights_updates == 1  # the current policy is what the refilter samples
    assert [p.id for p in kept] == want


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_recipe_without_a_world_trains_in_the_configured_dtype(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, dtype: str
) -> None:
    """`make real` runs its stages without a world: they ran in float32 while its config asked
    for bfloat16 (sampling and updates half as fast on a 2-core AMD EPYC)."""
    seen: list[World] = []

    class Built(Exception):
        pass

    def built(*args: object, world: World, **kwargs: object) -> None:
        seen.append(world)
        raise Built

    monkeypatch.setattr(rl, "build_run", built)
    cfg = _config(tmp_path)
    cfg.trainer.dtype = dtype
    with pytest.raises(Built):
        asyncio.run(run_recipe(cfg, None, None, PROBLEMS, tools=None))  # type: ignore[arg-type]
    assert seen[0].compute_dtype == getattr(torch, dtype) and seen[0].device == default_device()


def test_a_finished_stage_without_its_checkpoint_is_named(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    stage_dir = tmp_path / "1-short"
    stage_dir.mkdir()
    (stage_dir / "stage.json").write_text("{}")  # its checkpoints removed by hand
    with pytest.raises(RunError, match="1-short: stage.json says the stage ended, but it has no"):
        asyncio.run(run_recipe(cfg, torch.nn.Linear(1, 1), None, PROBLEMS, tools=None))  # type: ignore[arg-type]
