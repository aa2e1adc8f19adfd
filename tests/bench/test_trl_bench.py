"""`codeloop bench trl`: TRL's GRPOTrainer and codeloop's RL run the same steps, each arm in its
own process, and the report holds a row per arm and the ratios."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from codeloop.bench.trl import _consecutive, with_signal
from codeloop.data.tokenizer import train_tokenizer
from codeloop.engine.model import tiny_model

pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[dev]' has it)")


@pytest.mark.slow
def test_bench_trl_runs_every_arm_on_the_same_steps(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(["What is 12 + 34? The answer is 46."] * 20, vocab_size=300)
    model_dir = tmp_path / "model"
    tiny_model(len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "problems.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": str(i), "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
            for i in range(5)
        )
    )
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "codeloop", "bench", "trl", "--model", str(model_dir)]
    sizes = ["--steps", "2", "--prompts", "2", "--group", "2", "--max-tokens", "8"]
    done = subprocess.run(
        [*command, *sizes, "--data", str(data), "--out", str(out), "--last-number"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for arm in ("trl", "codeloop", "codeloop+tool"):
        assert f"| {arm} |" in done.stdout
        steps = json.loads((out / f"{arm}.json").read_text())["steps"]
        assert len(steps) == 2  # --steps
        for step in steps:
            assert len(step["rewards"]) == 2 * 2  # prompts x G
            assert 0 < step["tokens"] <= 2 * 2 * 8  # a response budget of 8 tokens
            assert step["step_s"] >= step["sample_s"] > 0
            assert 0 <= step["signal_groups"] <= 2  # of the step's 2 groups
    assert "the last number scored without an <answer>" in done.stdout
    toml = (out / "codeloop.toml").read_text()
    assert "fallback_last_number = true" in toml and 'dtype = "float32"' in toml
    assert "TRL / codeloop: step" in done.stdout and "TRL / codeloop+tool: step" in done.stdout
    # single-turn as TRL's: one model turn, a tool call left unanswered
    dump = (out / "codeloop" / "trajectories" / "step_000001.jsonl").read_text().splitlines()
    assert {json.loads(line)["num_turns"] for line in dump} == {1}
    # codeloop's arms trained on the first prompts x steps problems, in order
    kept = [json.loads(line)["id"] for line in (out / "problems.jsonl").open()]
    assert kept == ["0", "1", "2", "3"]


def test_a_group_has_signal_when_its_rewards_differ() -> None:
    assert with_signal(_consecutive([1.0, 0.0, 1.0, 1.0, 0.0, None], 2)) == 1  # None scores 0
    assert with_signal(_consecutive([0.0, 1.0, 1.0, 0.0], 2)) == 2
    assert with_signal(_consecutive([0.0, 1.0, 1.0, 0.0], 4)) == 1
    assert with_signal([[1.0, 1.0], [0.0, None]]) == 0  # groups by prompt, all equal
