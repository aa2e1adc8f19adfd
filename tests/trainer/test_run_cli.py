"""`codeloop sft` then `codeloop train` (and a resumed `train`) through the real CLI."""

import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import cli_inputs, rl_arguments

from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer.logs import read_metrics


def _codeloop(*args: str) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([sys.executable, "-m", "codeloop", *args], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.slow
def test_sft_then_train_then_resume(trainer_fmt: PromptFormat, tmp_path: Path) -> None:
    base, sft_data, problems = cli_inputs(trainer_fmt, tmp_path)
    run_dir = tmp_path / "run"
    _codeloop("sft", "--trainer.model", str(base), "--sft.data", str(sft_data),
              "--trainer.output_dir", str(run_dir), "--sft.epochs", "2")  # fmt: skip
    assert len(read_metrics(run_dir)) == 2 and (run_dir / "sft_model" / "config.json").is_file()
    common = rl_arguments(run_dir / "sft_model", problems, run_dir / "rl", 1)
    _codeloop("train", *common, "--trainer.max_steps", "2")
    again = _codeloop("train", *common, "--trainer.max_steps", "3")
    assert "resumed from step 2" in again.stdout
    assert [m["step"] for m in read_metrics(run_dir / "rl")] == [1, 2, 3]
    assert (run_dir / "rl" / "trajectories" / "step_000003.jsonl").is_file()
    assert (run_dir / "rl" / "checkpoints" / "step_000003" / "state.pt").is_file()


def test_config_errors_exit_2(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "codeloop", "train", "--trainer.lr", "-1"],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 2 and "trainer.lr" in run.stderr
