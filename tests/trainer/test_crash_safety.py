"""Runs killed with SIGKILL and restarted: every step is logged once, checkpoints are whole,
no process of a killed run survives it, and (synchronous mode) the log equals that of a run that
was never killed."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from leftovers import left_behind
from trainer_helpers import cli_inputs, recipe_config, rl_arguments

from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer.checkpoint import read_state
from codeloop.trainer.logs import read_metrics

KILL_AT = Path(__file__).with_name("kill_at.py")
STEPS = 6
# (point, n): killed right after step 3's metrics are written (not checkpointed: every 2),
# as step 4's update starts, while writing step 4's checkpoint, in the middle of a rollout
POINTS = [("logged", 3), ("update", 2), ("checkpoint", 1), ("rollout", 40)]
RANDOM_STEPS = 16
KILLS = 5
SAME = ("rollout/response_tokens", "rollout/status_no_answer", "reward/mean", "loss/lr")


def _train_args(trainer_fmt: PromptFormat, root: Path, mode: str, steps: int = STEPS) -> list[str]:
    base, _, problems = cli_inputs(trainer_fmt, root)
    args = rl_arguments(base, problems, root / "run", 2)
    return [
        "train",
        *args,
        "--trainer.checkpoint_every",
        "2",
        "--trainer.max_steps",
        str(steps),
        "--trainer.mode",
        mode,
    ]


def _start(command: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def _killed_at(point: str, n: int, args: list[str]) -> int:
    """Runs `codeloop ARGS` until it is killed at the Nth `point` (`kill_at.py`); its pid."""
    run = _start([str(KILL_AT), point, str(n), *args])
    _, err = run.communicate(timeout=300)
    assert run.returncode == -9, f"{point} {n}: not killed: {err[-2000:]}"
    return run.pid


def _finish(args: list[str]) -> None:
    """Runs `codeloop ARGS` to its end."""
    run = _start(["-m", "codeloop", *args])
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]


def _check_whole(run_dir: Path, killed: list[int], steps: int = STEPS) -> list[dict[str, float]]:
    """The run's log has every step once; its last checkpoint loads; nothing is left over."""
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    dumps = sorted(p.name for p in (run_dir / "trajectories").iterdir())
    assert dumps == [f"step_{s:06d}.jsonl" for s in range(1, steps + 1)]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    last_three = [f"step_{s:06d}" for s in range(steps - 4, steps + 1, 2)]
    assert checkpoints == last_three  # trainer.keep_checkpoints, and no scratch copy
    state = read_state(run_dir / "checkpoints" / last_three[-1])
    assert state["step"] == steps
    assert not list(run_dir.rglob(".partial-*"))
    assert left_behind(killed) == []
    return metrics


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_killed_at_chosen_moments_logs_each_step_once(
    trainer_fmt: PromptFormat, tmp_path: Path, mode: str
) -> None:
    args = _train_args(trainer_fmt, tmp_path, mode)
    killed = [_killed_at(point, n, args) for point, n in POINTS]
    _finish(args)
    metrics = _check_whole(tmp_path / "run", killed)
    if mode == "sync":  # exact resume: the same steps as a run never killed
        clean_root = tmp_path / "clean"
        clean_root.mkdir()
        clean = _start(["-m", "codeloop", *_train_args(trainer_fmt, clean_root, mode)])
        assert clean.wait(timeout=300) == 0
        expected = read_metrics(clean_root / "run")
        assert [{k: m[k] for k in SAME} for m in metrics] == [
            {k: m[k] for k in SAME} for m in expected
        ]


def _random_kill(rng: random.Random, run_dir: Path, steps: int) -> tuple[str, int]:
    """A kill point drawn by the run's progress, never by the clock, so that a fast machine is
    killed as often as a slow one: the restarted run resumes at its last checkpoint, so it has
    `left` steps to go, each with at least one update, one log line, one sampled token and (every
    second step) one checkpoint; the Nth of these is drawn among those it will surely reach."""
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    left = steps - (int(checkpoints[-1].name.removeprefix("step_")) if checkpoints else 0)
    point = rng.choice(["rollout", "update", "checkpoint", "logged"])
    reached = {"rollout": left, "update": left, "logged": left, "checkpoint": left // 2}
    return point, rng.randint(1, reached[point])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_killed_at_random_moments_logs_each_step_once(
    trainer_fmt: PromptFormat, tmp_path: Path, mode: str
) -> None:
    args = _train_args(trainer_fmt, tmp_path, mode, steps=RANDOM_STEPS)
    rng = random.Random(f"{mode}-kills")
    killed = [
        _killed_at(*_random_kill(rng, tmp_path / "run", RANDOM_STEPS), args) for _ in range(KILLS)
    ]
    _finish(args)
    _check_whole(tmp_path / "run", killed, RANDOM_STEPS)


@pytest.mark.slow
def test_sft_killed_after_a_step_starts_over_and_logs_each_step_once(
    trainer_fmt: PromptFormat, tmp_path: Path
) -> None:
    base, sft_data, _ = cli_inputs(trainer_fmt, tmp_path)
    args = [
        "sft",
        "--trainer.model",
        str(base),
        "--sft.data",
        str(sft_data),
        "--trainer.output_dir",
        str(tmp_path / "run"),
        "--sft.epochs",
        "3",
    ]
    killed = _start([str(KILL_AT), "logged", "2", *args])
    assert killed.wait(timeout=300) == -9
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]
    assert not (tmp_path / "run" / "sft_model").exists()
    finished = _start(["-m", "codeloop", *args])
    assert finished.wait(timeout=300) == 0
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3]
    assert (tmp_path / "run" / "sft_model" / "model.safetensors").is_file()
    assert left_behind([killed.pid]) == []


@pytest.mark.slow
def test_a_recipe_killed_in_either_stage_logs_each_step_once(
    trainer_fmt: PromptFormat, tmp_path: Path
) -> None:
    base, _, problems = cli_inputs(trainer_fmt, tmp_path)
    run_dir = tmp_path / "recipe"
    stages = """
[[recipe.stages]]
name = "one"
steps = 3
[[recipe.stages]]
name = "two"
steps = 3
"""
    config = recipe_config(
        tmp_path / "recipe.toml", base, problems, run_dir, stages, checkpoint_every=2, refill=False
    )
    args = ["recipe", "--config", str(config)]
    killed = []
    # killed: after stage one's step 3 is logged (its checkpoint is at 2); after stage two's
    # step 1 is logged (the resumed stage one logs its step 3 first); while stage two's
    # checkpoint at step 2 is written
    expected = [("1-one", [1, 2, 3]), ("2-two", [1]), ("2-two", [1, 2])]
    for (point, n), (stage, steps) in zip(
        (("logged", 3), ("logged", 2), ("checkpoint", 1)), expected, strict=True
    ):
        run = _start([str(KILL_AT), point, str(n), *args])
        _, err = run.communicate(timeout=300)
        assert run.returncode == -9, f"{point} {n}: not killed: {err[-2000:]}"
        assert [m["step"] for m in read_metrics(run_dir / stage)] == steps
        killed.append(run.pid)
    assert list((run_dir / "2-two" / "checkpoints").glob(".partial-*"))  # cut short
    finished = _start(["-m", "codeloop", *args])
    _, err = finished.communicate(timeout=300)
    assert finished.returncode == 0, err[-3000:]
    for stage in ("1-one", "2-two"):
        assert [m["step"] for m in read_metrics(run_dir / stage)] == [1, 2, 3]
        dumps = sorted(p.name for p in (run_dir / stage / "trajectories").iterdir())
        assert dumps == [f"step_{s:06d}.jsonl" for s in (1, 2, 3)]
        assert json.loads((run_dir / stage / "stage.json").read_text())["steps"] == 3
    assert not list(run_dir.rglob(".partial-*"))
    assert left_behind(killed) == []
