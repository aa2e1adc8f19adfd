"""FSDP2 data parallelism: 2 gloo processes under torchrun train like 1 process."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from trainer_helpers import (  # noqa: F401  (trainer_fmt: the session fixture)
    cli_inputs,
    recipe_config,
    rl_arguments,
    trainer_fmt,
)
from transformers import AutoModelForCausalLM

from codeloop.engine.model import tiny_model
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer.checkpoint import read_state
from codeloop.trainer.distributed import World, pad_micro_batches
from codeloop.trainer.logs import read_metrics
from codeloop.trainer.rollout_side import rank_share

WORKER = Path(__file__).with_name("fsdp_worker.py")


def _torchrun(processes: int, tokenizer_dir: Path, out: Path) -> dict:
    out.mkdir()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(processes),
        "--standalone",
        str(WORKER),
        str(tokenizer_dir),
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.slow
def test_two_gloo_processes_match_one(trainer_fmt: PromptFormat, tmp_path: Path) -> None:  # noqa: F811
    tokenizer_dir = tmp_path / "tokenizer"
    trainer_fmt.tokenizer.save_pretrained(tokenizer_dir)
    one = _torchrun(1, tokenizer_dir, tmp_path / "one")
    two = _torchrun(2, tokenizer_dir, tmp_path / "two")
    # the first step scores the same weights: only summation order differs. Later steps follow
    # AdamW steps at lr 1e-2, which turn that noise into visible moves wherever a gradient is ~0
    # (one CI machine's one-process run drifted 8e-5 by step 4), so they get a looser bound that
    # still catches a wrong split of the data or a wrong average of the gradients (>= 1e-2)
    for step, (a, b) in enumerate(zip(one["sft"], two["sft"], strict=True)):  # 4 SFT steps
        rel = 1e-5 if step == 0 else 1e-3
        assert b["sft/tokens"] == a["sft/tokens"]
        assert b["sft/loss"] == pytest.approx(a["sft/loss"], rel=rel)
        assert b["sft/grad_norm"] == pytest.approx(a["sft/grad_norm"], rel=10 * rel)
    for a, b in zip(one["rl"], two["rl"], strict=True):  # 2 RL updates of 2 optimiser steps
        for key in (
            "loss/loss",
            "loss/grad_norm",
            "loss/policy_tokens",
            "loss/clip_fraction",
            "loss/approx_kl",
            "loss/entropy",
        ):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), key
    assert one["rl"][1]["loss/clip_fraction"] > 0  # lr 1e-2: the second update clips
    w1 = torch.load(tmp_path / "one" / "weights.pt")
    w2 = torch.load(tmp_path / "two" / "weights.pt")
    assert w1.keys() == w2.keys()
    # Adam divides each gradient by its own scale, so elements whose gradient is ~0 turn
    # summation-order noise into visible steps: compare each tensor's disagreement with how far
    # training moved it. Measured: 5e-5 on one machine, 1.3e-3 on another; both ranks training
    # on the same half of the SFT data gives >= 0.5
    start = tiny_model(len(trainer_fmt.tokenizer), hidden_size=32, layers=2, heads=4, seed=0)
    for key, initial in start.state_dict().items():
        moved = float((w1[key] - initial).norm())
        assert moved > 0, key
        assert float((w2[key] - w1[key]).norm()) < 1e-2 * moved, key
    assert one["engine_synced"] and two["engine_synced"]


def test_pad_micro_batches_in_a_world_of_one() -> None:
    assert pad_micro_batches(["a", "b"], World()) == [("a", 1.0), ("b", 1.0)]
    assert pad_micro_batches([], World()) == []


def _codeloop_torchrun(*args: str) -> str:
    """`codeloop ARGS` in two processes under torchrun; its stdout."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "codeloop",
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_sft_and_train_commands_under_torchrun(trainer_fmt: PromptFormat, tmp_path: Path) -> None:  # noqa: F811
    base, sft_data, problems = cli_inputs(trainer_fmt, tmp_path)
    run_dir = tmp_path / "run"

    _codeloop_torchrun(
        "sft",
        "--trainer.model",
        str(base),
        "--sft.data",
        str(sft_data),
        "--trainer.output_dir",
        str(run_dir),
        "--sft.epochs",
        "2",
        "--trainer.dtype",
        "bfloat16",
    )  # FSDP2 mixed precision
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]  # one log, not one per rank
    saved = AutoModelForCausalLM.from_pretrained(run_dir / "sft_model", dtype="auto")
    assert {p.dtype for p in saved.parameters()} == {torch.float32}  # trained in float32
    common = rl_arguments(run_dir / "sft_model", problems, run_dir / "rl", 2)
    _codeloop_torchrun("train", *common, "--trainer.max_steps", "2")
    assert "resumed from step 2" in _codeloop_torchrun("train", *common, "--trainer.max_steps", "3")
    assert [m["step"] for m in read_metrics(run_dir / "rl")] == [1, 2, 3]
    dump = (run_dir / "rl" / "trajectories" / "step_000003.jsonl").read_text().splitlines()
    assert len(dump) == 2 * 2 * 2  # both ranks' prompts, 2G sampled each
    ids = Counter(json.loads(line)["prompt_id"] for line in dump)
    assert len(ids) == 2 and set(ids.values()) == {4}  # one prompt from each rank


@pytest.mark.slow
def test_async_train_under_torchrun(trainer_fmt: PromptFormat, tmp_path: Path) -> None:  # noqa: F811
    base, _, problems = cli_inputs(trainer_fmt, tmp_path)
    run_dir = tmp_path / "rl"

    common = [*rl_arguments(base, problems, run_dir, 2), "--trainer.mode", "async"]
    _codeloop_torchrun("train", *common, "--trainer.max_steps", "2")
    assert "resumed from step 2" in _codeloop_torchrun("train", *common, "--trainer.max_steps", "3")
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]  # one log, not one per rank
    assert all("async/staleness_max" in m for m in metrics)  # the asynchronous loop's
    assert [m["rollout/groups_kept"] for m in metrics] == [2, 2, 2]  # one group per rank
    for step in (1, 2, 3):
        dump = (run_dir / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()
        positions = {json.loads(line)["position"] for line in dump}
        # rank r draws positions r, r + 2, ...: both ranks' groups are in every step's dump
        assert {p % 2 for p in positions} == {0, 1}


@pytest.mark.slow
def test_dropping_zero_signal_groups_with_two_ranks_keeps_what_one_process_keeps(
    tmp_path: Path,
) -> None:
    def ranks(processes: int, rule: str = "odd", *keep: str) -> list[dict]:
        out = tmp_path / f"{processes}-{rule}{''.join(keep)}"
        out.mkdir()
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(processes),
            str(Path(__file__).with_name("refill_worker.py")),
            str(out),
            rule,
            *keep,
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]

    # odd positions have signal: round 1 draws 0-3 (keeps 1, 3), round 2 draws 4-5 (5),
    # round 3 draws 6 (none), round 4 draws 7 (7)
    assert ranks(1) == [{"positions": [1, 3, 5, 7], "data_position": 8}]
    assert ranks(2) == [
        {"positions": [1, 5], "data_position": 8},
        {"positions": [3, 7], "data_position": 8},
    ]
    # no signal anywhere: 4 rounds of 4 drawn, nothing to train on, on either rank
    assert ranks(2, "none") == [{"positions": [], "data_position": 16}] * 2
    # one group with signal for two ranks: each rank would need one; both say so
    error = (
        "only 1 groups with signal after 4 rounds, fewer than the 2 ranks: raise "
        "trainer.prompts_per_step"
    )
    assert ranks(2, "only_1") == [{"error": error}] * 2
    # as many groups with signal as ranks: one each, after rounds of 4, 2, 2, 2 drawn
    assert ranks(2, "1_and_3") == [
        {"positions": [1], "data_position": 10},
        {"positions": [3], "data_position": 10},
    ]
    # without the refill every rank keeps its own share of the step's four, signal or not
    assert ranks(2, "odd", "keep") == [
        {"positions": [0, 2], "data_position": 4},
        {"positions": [1, 3], "data_position": 4},
    ]


@pytest.mark.slow
def test_recipe_under_torchrun(trainer_fmt: PromptFormat, tmp_path: Path) -> None:  # noqa: F811
    base, _, problems = cli_inputs(trainer_fmt, tmp_path)
    run_dir = tmp_path / "recipe"
    config = tmp_path / "recipe.toml"
    stages = """
[[recipe.stages]]
name = "one"
steps = 1
[[recipe.stages]]
name = "two"
steps = 1
refilter = true
refilter_samples = 2
"""
    recipe_config(config, base, problems, run_dir, stages)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "codeloop",
        "recipe",
        "--config",
        str(config),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()  # rank 0 speaks; the refilter sees every problem
    refilter = [line for line in lines if line.startswith("refilter")]
    assert len(refilter) == 1
    assert refilter[0].startswith(
        "refilter: kept 4 of 4 problems (pass rate <= 0.99 over 2 samples); expected in RL: "
    )
    assert [line for line in lines if line.startswith("stage")] == [
        "stage one: 1 steps on 4 problems",
        "stage two: 1 steps on 4 problems",
    ]
    for name, steps in (("1-one", 1), ("2-two", 1)):
        summary = json.loads((run_dir / name / "stage.json").read_text())
        assert summary["steps"] == steps and summary["problems"] == 4
        assert [m["step"] for m in read_metrics(run_dir / name)] == [1]
    first = read_state(run_dir / "1-one" / "checkpoints" / "step_000001")
    second = read_state(run_dir / "2-two" / "checkpoints" / "step_000001")
    step = [s["lr_schedule"]["last_epoch"] for s in (first, second)]
    assert step == [1, 2]  # the optimiser and its schedule carried over from stage one


def test_each_rank_schedules_over_its_own_servers_or_a_share_of_one() -> None:
    servers = ["s0", "s1", "s2", "s3"]
    assert [rank_share(servers, World(r, 2)) for r in range(2)] == [
        (["s0", "s2"], 1),
        (["s1", "s3"], 1),
    ]
    assert rank_share(servers, World(0, 1)) == (servers, 1)
    # 3 ranks over 2 servers: s0 serves ranks 0 and 2, s1 rank 1 alone
    assert [rank_share(servers[:2], World(r, 3)) for r in range(3)] == [
        (["s0"], 2),
        (["s1"], 1),
        (["s0"], 2),
    ]
    assert rank_share([], World(1, 2)) == ([], 1)  # no servers: the in-process engine


@pytest.mark.slow
def test_held_out_problems_are_shared_out_and_gathered_under_torchrun(
    trainer_fmt: PromptFormat,  # noqa: F811
    tmp_path: Path,
) -> None:
    base, _, problems = cli_inputs(trainer_fmt, tmp_path)
    run_dir = tmp_path / "rl"
    common = [
        *rl_arguments(base, problems, run_dir, 2),
        "--trainer.max_steps",
        "1",
        "--trainer.eval_every",
        "1",
        "--eval.data",
        str(problems),
        "--eval.k",
        "2",
        "--eval.max_response_tokens",
        "16",
    ]
    _codeloop_torchrun("train", *common)
    [metrics] = read_metrics(run_dir)
    # rank 0 scores problems 0 and 2, rank 1 problems 1 and 3: the step logs all four once
    assert metrics["eval/problems"] == 4 and metrics["eval/infrastructure_failures"] == 0
    assert metrics["eval/pass@1_low"] <= metrics["eval/pass@1"] <= metrics["eval/pass@1_high"]
