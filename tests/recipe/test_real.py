"""`codeloop real`'s code path at tiny scale: a small random model in place of SmolLM2 (the
full run is `make real`), GSM8K-format problems written here, every stage and the rerun."""

import asyncio
import json
from pathlib import Path

import pytest

from codeloop.config import load_config
from codeloop.data.problems import load_problems
from codeloop.data.tokenizer import train_tokenizer
from codeloop.recipe.real import Sizes, run_real
from codeloop.trainer.model import tiny_model

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gsm8k_smollm2.toml"
TINY = Sizes(dev=3, eval_problems=2, eval_samples=1, sft_problems=4, rl_problems=4)


def _gsm8k(path: Path, count: int) -> None:
    rows = []
    for i in range(count):
        a, b = 10 + i, 3 + 2 * i
        solution = f"She has {a}+{b} = <<{a}+{b}={a + b}>>{a + b} apples."
        rows.append({"question": f"Ann has {a} apples and gets {b}. How many?",
                     "answer": f"{solution}\n#### {a + b}"})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
def test_the_real_recipe_runs_every_stage_and_resumes(tmp_path: Path) -> None:
    _gsm8k(tmp_path / "gsm8k.jsonl", 12)
    tokenizer = train_tokenizer(["Ann has 10 apples and gets 3. How many? print(x1)"] * 20, 400)
    tiny_model(len(tokenizer), hidden_size=32, layers=1).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    run_dir = tmp_path / "run"
    overrides = [f"--trainer.model={tmp_path / 'model'}", f"--trainer.output_dir={run_dir}",
                 f"--data.train={tmp_path / 'gsm8k.jsonl'}", "--trainer.prompts_per_step=2",
                 "--algo.group_size=2", "--sft.epochs=1", "--sft.conversations_per_step=2",
                 "--eval.max_response_tokens=64", "--rollout.max_response_tokens=64",
                 "--recipe.stages.0.steps=1", "--recipe.stages.1.steps=1",
                 "--recipe.stages.2.steps=1", "--recipe.stages.2.refilter_samples=1",
                 "--recipe.stages.2.refilter_max_pass_rate=1.0",
                 "--recipe.stages.0.overrides={}", "--recipe.stages.1.overrides={}"]  # fmt: skip
    summary = asyncio.run(run_real(load_config(str(CONFIG), overrides), TINY))
    stages = [p["stage"] for p in summary["points"]]
    assert stages == ["sft", "stage1-short", "stage2-long", "stage3-hard"]
    for point in summary["points"]:
        assert 0 <= point["accuracy"] <= 1 and 0 <= point["tool_use"] <= 1
        assert 0 <= point["malformed_calls"] <= 1
    dev, train = (
        load_problems(str(run_dir / "dev.jsonl")),
        load_problems(str(run_dir / "train.jsonl")),
    )
    assert len(dev) == 3 and len(train) == 9
    assert {p.problem for p in dev}.isdisjoint(p.problem for p in train)
    sft = [json.loads(line) for line in (run_dir / "sft.jsonl").read_text().splitlines()]
    assert len(sft) == 4  # every solution reproduced its answer in the sandbox
    for name in ("sft_model", "final_model"):
        assert (run_dir / name / "config.json").is_file()
        assert (run_dir / name / "tokenizer.json").is_file()
    assert json.loads((run_dir / "summary.json").read_text())["points"] == summary["points"]
    assert (run_dir / "curves.png").stat().st_size > 1000
    again = asyncio.run(run_real(load_config(str(CONFIG), overrides), TINY))  # all done: skipped
    assert again["points"] == summary["points"]
