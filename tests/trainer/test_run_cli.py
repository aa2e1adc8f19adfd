"""`codeloop sft` then `codeloop train` (and a resumed `train`) through the real CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import conversation

from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer.logs import read_metrics
from codeloop.trainer.model import tiny_model


def _codeloop(*args: str) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([sys.executable, "-m", "codeloop", *args], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.slow
def test_sft_then_train_then_resume(trainer_fmt: PromptFormat, tmp_path: Path) -> None:
    base = tmp_path / "base"
    tiny_model(len(trainer_fmt.tokenizer)).save_pretrained(base)
    trainer_fmt.tokenizer.save_pretrained(base)
    sft_data = tmp_path / "sft.jsonl"
    sft_data.write_text("".join(json.dumps({"messages": conversation(trainer_fmt, a, b)}) + "\n"
                                for a, b in [(1, 2), (3, 4)]))  # fmt: skip
    problems = tmp_path / "train.jsonl"
    rows = [{"id": f"q{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(3)]
    problems.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dir = tmp_path / "run"
    _codeloop("sft", "--trainer.model", str(base), "--sft.data", str(sft_data),
              "--trainer.output_dir", str(run_dir), "--sft.epochs", "2")  # fmt: skip
    assert len(read_metrics(run_dir)) == 2 and (run_dir / "sft_model" / "config.json").is_file()
    common = ["--trainer.model", str(run_dir / "sft_model"), "--data.train", str(problems),
              "--trainer.output_dir", str(run_dir / "rl"), "--trainer.prompts_per_step", "1",
              "--algo.group_size", "2", "--rollout.max_response_tokens", "32",
              "--sandbox.workers", "1", "--reward.workers", "1",
              "--trainer.checkpoint_every", "1"]  # fmt: skip
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
