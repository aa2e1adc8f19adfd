"""The demo's real entry point with tiny numbers (the full run is `make demo`)."""

import asyncio
import json
import random
from pathlib import Path

import pytest

from codeloop.config import SandboxConfig, SFTConfig
from codeloop.data.synthetic import Task, demonstration, syntax_error
from codeloop.engine.model import tiny_model
from codeloop.recipe.demo import (
    Sizes,
    build_format,
    exact_share,
    run_demo,
    run_modes,
    sft_conversations,
)
from codeloop.rollout.toolcall import format_observation
from codeloop.sandbox.pool import LocalSandbox
from codeloop.trainer.logs import read_metrics
from codeloop.trainer.sft import encode_conversation, train_sft
from codeloop.types import ExecRequest

TINY = Sizes(
    sft_clean_steps=1,
    sft_clean_max_steps=2,
    sft_check_every=1,
    sft_mixed_steps=1,
    sft_batch=6,
    heldout_per_difficulty=2,
    rl_per_difficulty=4,
    eval_samples=1,
)
OVERRIDES = [
    "--recipe.stages.0.steps=1",
    "--recipe.stages.1.steps=1",
    "--recipe.stages.2.steps=1",
    "--trainer.prompts_per_step=2",
    "--algo.group_size=2",
    "--sandbox.workers=1",
    "--recipe.stages.2.refilter_samples=1",
    "--recipe.stages.2.refilter_max_pass_rate=1.0",
    # a budget of 64 tokens everywhere: a tiny policy's responses run to their budget, and
    # decoding them is most of a run's time, so the budget bounds the tests' time
    "--rollout.max_response_tokens=64",
    *(f'--recipe.stages.{i}.overrides={{"rollout.max_response_tokens" = 64}}' for i in range(3)),
]


@pytest.mark.slow
def test_the_demo_runs_every_stage_and_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from codeloop.engine.hf_engine import TransformersEngine

    engines: list[TransformersEngine] = []
    built = TransformersEngine.__init__

    def counted(self: TransformersEngine, *args: object, **kwargs: object) -> None:
        engines.append(self)
        built(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(TransformersEngine, "__init__", counted)
    summary = asyncio.run(run_demo(tmp_path, TINY, OVERRIDES))
    assert len(engines) == 1  # four evaluations and three stages on one engine
    stages = [p["stage"] for p in summary["points"]]
    assert stages == ["sft", "stage1-short", "stage2-longer", "stage3-hard"]
    for point in summary["points"]:
        assert 0 <= point["pass@1"] <= 1 and point["response_tokens"] > 0
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert (tmp_path / "sft" / "model" / "config.json").is_file()
    lines = (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records if "sft/heldout_exact" in r] == [1, 2]  # clean phase
    assert [r["step"] for r in records if "sft/loss" in r] == [1, 2, 3]  # then one mixed step
    assert sorted(p.name for p in (tmp_path / "rl").iterdir()) == [
        "1-stage1-short",
        "2-stage2-longer",
        "3-stage3-hard",
    ]


@pytest.mark.slow
def test_the_configs_seed_drives_every_random_choice_and_reproduces_a_run(tmp_path: Path) -> None:
    def run(name: str, seed: int) -> dict[str, object]:
        summary = asyncio.run(
            run_demo(tmp_path / name, TINY, [*OVERRIDES, f"--trainer.seed={seed}"])
        )
        return {key: value for key, value in summary.items() if key != "minutes"}

    def problems(name: str) -> set[str]:  # what its first RL step sampled
        dump = tmp_path / name / "rl" / "1-stage1-short" / "trajectories" / "step_000001.jsonl"
        return {json.loads(line)["problem"] for line in dump.read_text().splitlines()}

    def sft_weights(name: str) -> bytes:
        return (tmp_path / name / "sft" / "model" / "model.safetensors").read_bytes()

    first, again, other = run("a", 3), run("again", 3), run("b", 4)
    assert first == again and first["seed"] == 3  # the same seed: the same run
    assert problems("a") == problems("again") and sft_weights("a") == sft_weights("again")
    assert other["seed"] == 4 and other["points"] != first["points"]
    assert problems("b").isdisjoint(problems("a"))  # other problems,
    assert sft_weights("b") != sft_weights("a")  # another SFT policy (init and data)


@pytest.mark.slow
def test_modes_compares_sync_and_async_rl_from_one_sft_policy(tmp_path: Path) -> None:
    results = asyncio.run(run_modes(tmp_path, TINY, OVERRIDES))
    assert list(results) == ["sync", "async"]
    for mode, summary in results.items():
        points = summary["points"]
        assert [p["stage"] for p in points] == [
            "sft",
            "stage1-short",
            "stage2-longer",
            "stage3-hard",
        ]
        tokens = [p["trained_tokens"] for p in points[1:]]
        seconds = [p["rl_seconds"] for p in points[1:]]
        assert tokens == sorted(tokens) and seconds == sorted(seconds) and seconds[0] > 0
        rows = read_metrics(tmp_path / "modes" / mode / "rl" / "1-stage1-short")
        assert tokens[0] == sum(r["loss/policy_tokens"] for r in rows)
        assert ("async/staleness_mean" in rows[0]) == (mode == "async")
    # one SFT policy for both: the same point after SFT
    assert results["sync"]["points"][0] == results["async"]["points"][0]
    assert (tmp_path / "modes" / "curves.png").stat().st_size > 1000


def test_the_demonstrated_syntax_error_is_what_the_sandbox_reports() -> None:
    code = "print(123 % 456"

    async def run() -> str:
        async with LocalSandbox(SandboxConfig(workers=1)) as sandbox:
            result = await sandbox.execute(ExecRequest(code))
        return format_observation(result, 2000)

    assert asyncio.run(run()) == syntax_error(code)
    broken = demonstration(
        Task("What is 123 % 456?", 123, "print(123 % 456)", 3), random.Random(0), error_share=1.0
    )
    assert broken[1] == {"role": "tool", "content": syntax_error(code)}


def test_exact_share_counts_conversations_whose_every_trained_token_is_predicted() -> None:
    fmt = build_format(0)
    samples = [
        encode_conversation(fmt, c) for c in sft_conversations(fmt, 0, 6, 0.0, no_tool_share=0.0)
    ]
    model = tiny_model(len(fmt.tokenizer), hidden_size=64, layers=2)
    assert exact_share(model, samples, 0) == 0.0  # untrained
    cfg = SFTConfig(epochs=200, lr=1e-2, warmup_steps=5, conversations_per_step=2)
    train_sft(
        model, fmt, [sft_conversations(fmt, 0, 6, 0.0, no_tool_share=0.0)[0]], cfg
    )  # memorise one
    assert exact_share(model, samples, 0) == pytest.approx(1 / 6)
