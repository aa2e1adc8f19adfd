"""The demo's real entry point with tiny numbers (the full run is `make demo`)."""

import asyncio
import json
from pathlib import Path

import pytest

from codeloop.recipe.demo import Sizes, run_demo

TINY = Sizes(sft_per_difficulty=4, sft_epochs=1, heldout_per_difficulty=2, rl_per_difficulty=4,
             eval_samples=1)  # fmt: skip
OVERRIDES = ["--recipe.stages.0.steps=1", "--recipe.stages.1.steps=1", "--recipe.stages.2.steps=1",
             "--trainer.prompts_per_step=2", "--algo.group_size=2", "--sandbox.workers=1",
             "--recipe.stages.2.refilter_samples=1",
             "--recipe.stages.2.refilter_max_pass_rate=1.0"]  # fmt: skip


@pytest.mark.slow
def test_the_demo_runs_every_stage_and_reports(tmp_path: Path) -> None:
    summary = asyncio.run(run_demo(tmp_path, 0, TINY, OVERRIDES))
    stages = [p["stage"] for p in summary["points"]]
    assert stages == ["sft", "stage1-short", "stage2-longer", "stage3-hard"]
    for point in summary["points"]:
        assert 0 <= point["accuracy"] <= 1 and point["response_tokens"] > 0
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert (tmp_path / "sft" / "model" / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "rl").iterdir()) == [
        "1-stage1-short", "2-stage2-longer", "3-stage3-hard"]  # fmt: skip
