"""`codeloop real`'s code path at tiny scale: a small random model in place of SmolLM2 (the
full run is `make real`), GSM8K-format problems written here, every stage and the rerun."""

import asyncio
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from codeloop.config import load_config
from codeloop.data.problems import Problem, load_problems
from codeloop.data.tokenizer import train_tokenizer
from codeloop.engine.model import tiny_model
from codeloop.eval.evaluate import problem_result
from codeloop.eval.evaluate import summary as eval_summary
from codeloop.recipe.real import disk_needed, disk_warning, memory_line, memory_plan, run_real
from codeloop.recipe.sizes import Sizes
from codeloop.rollout.policy import Policy
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.score import score
from codeloop.rollout.stats import trajectory_stats
from codeloop.rollout.tools import PYTHON_TOOL
from codeloop.trainer.checkpoint import save_checkpoint
from codeloop.types import (
    ExecResult,
    ExecStatus,
    RolloutStatus,
    ToolCall,
    ToolCallRecord,
    Trajectory,
)

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gsm8k_smollm2.toml"
TINY = Sizes(dev=3, eval_problems=2, eval_samples=1, sft_problems=4, rl_problems=4)


def _gsm8k(path: Path, count: int) -> None:
    rows = []
    for i in range(count):
        a, b = 10 + i, 3 + 2 * i
        solution = f"She has {a}+{b} = <<{a}+{b}={a + b}>>{a + b} apples."
        rows.append(
            {
                "question": f"Ann has {a} apples and gets {b}. How many?",
                "answer": f"{solution}\n#### {a + b}",
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _tiny_recipe(tmp_path: Path, first_stage_steps: int = 1) -> list[str]:
    """A tiny model and GSM8K-format data in `tmp_path`; the overrides that run the real
    recipe on them into `tmp_path / "run"`, one step a stage (`first_stage_steps` in the first)."""
    _gsm8k(tmp_path / "gsm8k.jsonl", 12)
    tokenizer = train_tokenizer(["Ann has 10 apples and gets 3. How many? print(x1)"] * 20, 400)
    tiny_model(len(tokenizer), hidden_size=32, layers=1).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    run_dir = tmp_path / "run"
    return [
        f"--trainer.model={tmp_path / 'model'}",
        f"--trainer.output_dir={run_dir}",
        f"--data.train={tmp_path / 'gsm8k.jsonl'}",
        "--trainer.prompts_per_step=2",
        "--algo.group_size=2",
        "--sft.epochs=1",
        "--sft.conversations_per_step=2",
        "--eval.max_response_tokens=64",
        "--rollout.max_response_tokens=64",
        "--recipe.stages.0.steps=1",
        "--recipe.stages.1.steps=1",
        "--recipe.stages.0.refilter_samples=1",
        "--recipe.stages.0.refilter_min_pass_rate=0",
        "--recipe.stages.0.refilter_max_pass_rate=1.0",
        "--recipe.stages.2.steps=1",
        "--recipe.stages.2.refilter_samples=1",
        "--recipe.stages.2.refilter_max_pass_rate=1.0",
        "--recipe.stages.0.overrides={}",
        "--recipe.stages.1.overrides={}",
        f"--recipe.stages.0.steps={first_stage_steps}",
    ]


@pytest.mark.slow
def test_the_real_recipe_runs_every_stage_and_resumes(tmp_path: Path) -> None:
    overrides = _tiny_recipe(tmp_path)
    run_dir = tmp_path / "run"
    summary = asyncio.run(run_real(load_config(str(CONFIG), overrides), TINY))
    dev, train = (
        load_problems(str(run_dir / "dev.jsonl")),
        load_problems(str(run_dir / "train.jsonl")),
    )
    stages = [p["stage"] for p in summary["points"]]
    assert stages == ["sft", "stage3-hard"]  # after SFT and the last stage, not in between
    for point in summary["points"]:
        assert 0 <= point["pass@1"] <= 1 and 0 <= point["tool_use"] <= 1
        assert 0 <= point["malformed_calls"] <= 1
        assert 0 <= point["pass@1_low"] <= point["pass@1"] <= point["pass@1_high"] <= 1
        assert sorted(point["per_problem"]) == sorted(p.id for p in dev[:2])
        assert point["problems"] == 2 and point["infrastructure_failures"] == 0
        assert point["engine"]["steps"] > 0 and point["engine"]["prefills"] > 0  # its counters
    assert len(dev) == 3 and len(train) == 9
    assert {p.problem for p in dev}.isdisjoint(p.problem for p in train)
    sft = [json.loads(line) for line in (run_dir / "sft.jsonl").read_text().splitlines()]
    assert len(sft) == 4  # every solution reproduced its answer in the sandbox
    for name in ("sft_model", "final_model"):
        assert (run_dir / name / "config.json").is_file()
        assert (run_dir / name / "tokenizer.json").is_file()
    assert json.loads((run_dir / "summary.json").read_text())["points"] == summary["points"]
    assert (run_dir / "curves.png").stat().st_size > 1000
    # the problems RL trained on (each stage's list), scored before and after RL, paired
    stage_ids = [
        json.loads((run_dir / d / "stage.json").read_text())["problem_ids"]
        for d in ("1-stage1-short", "2-stage2-long", "3-stage3-hard")
    ]
    trained = summary["trained_problems"]
    assert trained["problems"] == len(set().union(*stage_ids)) > 0
    assert set(trained["per_problem"]["before"]) == set().union(*stage_ids)
    before = trained["per_problem"]["before"]
    after = trained["per_problem"]["after"]
    assert trained["difference"] == pytest.approx(
        100 * sum(after[i] - before[i] for i in before) / len(before)
    )
    low, high = trained["interval95"]
    assert low <= trained["difference"] <= high and trained["samples"] == TINY.trained_samples
    assert all(8 * v == round(8 * v) for v in [*before.values(), *after.values()])  # k = 8
    again = asyncio.run(run_real(load_config(str(CONFIG), overrides), TINY))  # all done: skipped
    assert again["points"] == summary["points"]
    assert again["trained_problems"] == trained  # read back, not sampled again
    assert (summary["resumed"], again["resumed"]) == (False, True)  # `minutes`: the rerun's


@pytest.mark.slow
def test_one_set_of_score_names_in_points_rl_logs_and_eval_summaries(tmp_path: Path) -> None:
    """One small run: its recipe points, its RL steps' held-out evaluations and `codeloop eval`
    of its final policy report the score under the same names (RL's under `eval/`)."""
    from codeloop.cli import main
    from codeloop.trainer.logs import read_metrics

    held_out = tmp_path / "held_out.jsonl"
    rows = [{"id": f"h{i}", "problem": f"What is {i} + 2?", "answer": str(i + 2)} for i in range(2)]
    held_out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = [
        *_tiny_recipe(tmp_path),
        "--trainer.eval_every=1",
        f"--eval.data={held_out}",
        "--eval.k=1",
    ]
    summary = asyncio.run(run_real(load_config(str(CONFIG), overrides), TINY))
    names = {"pass@1", "pass@1_low", "pass@1_high", "problems", "infrastructure_failures"}
    for point in summary["points"]:
        assert names <= set(point)
    logged = [m for d in sorted((tmp_path / "run").glob("[0-9]-*")) for m in read_metrics(d)]
    assert len(logged) == 3  # a step a stage, each with its held-out evaluation
    for metrics in logged:
        assert {"eval/" + name for name in names} <= set(metrics)
        assert metrics["eval/problems"] == 2
    out = tmp_path / "eval"
    args = ["eval", "--model", str(tmp_path / "run" / "final_model"), "--data", str(held_out)]
    assert main([*args, "--out", str(out), "--k", "1"]) == 0
    evaluated = json.loads((out / "summary.json").read_text())
    assert names <= set(evaluated) and evaluated["problems"] == 2


def test_one_engine_serves_the_whole_run_and_no_finished_stage_is_loaded_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    from codeloop.engine.hf_engine import TransformersEngine

    engines: list[TransformersEngine] = []
    loads: list[str] = []
    built = TransformersEngine.__init__
    load = AutoModelForCausalLM.from_pretrained.__func__  # type: ignore[attr-defined]

    def counted_engine(self: TransformersEngine, *args: Any, **kwargs: Any) -> None:
        engines.append(self)
        built(self, *args, **kwargs)

    def counted_load(cls: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
        loads.append(str(path))
        return load(cls, path, *args, **kwargs)

    monkeypatch.setattr(TransformersEngine, "__init__", counted_engine)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(counted_load))
    overrides = _tiny_recipe(tmp_path)
    sizes = replace(TINY, eval_every_stage=True)  # an evaluation after every stage
    summary = asyncio.run(run_real(load_config(str(CONFIG), overrides), sizes))
    stages = [p["stage"] for p in summary["points"]]
    assert stages == ["sft", "stage1-short", "stage2-long", "stage3-hard"]
    assert len(engines) == 1  # SFT's evaluation, three stages and three more evaluations
    assert loads == [str(tmp_path / "model")]  # the initial policy, and nothing after it
    # each stage's engine counters: the one engine sampled them all
    assert [p["engine"]["steps"] > 0 for p in summary["points"]] == [True] * 4
    engines.clear()
    loads.clear()
    asyncio.run(run_real(load_config(str(CONFIG), overrides), sizes))  # a rerun: all done
    assert len(engines) == 1 and len(loads) == 2 + 3  # the policy, SFT's, each stage's final


@pytest.mark.slow
def test_a_time_limit_stops_rl_scores_where_it_stopped_and_a_rerun_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from codeloop.trainer.rl import RLRun

    overrides = _tiny_recipe(tmp_path, first_stage_steps=2)
    run_dir = tmp_path / "run"

    def run(minutes: float) -> dict[str, Any]:
        sizes = replace(TINY, eval_every_stage=True)
        return asyncio.run(run_real(load_config(str(CONFIG), overrides), sizes, minutes))

    # 0.6 s leave no room for an evaluation and the final save: no RL step runs
    summary = run(0.01)
    assert [p["stage"] for p in summary["points"]] == ["sft"]
    assert summary["stopped"] == {"stage": "stage1-short", "step": 0, "of": 2}
    assert (run_dir / "final_model" / "config.json").is_file()
    # time for one step of stage 1 only: that policy is scored as "stage1-short@1"
    monkeypatch.setattr(RLRun, "_out_of_time", lambda self, deadline, step_s: self.step_index >= 1)
    summary = run(60)
    assert [p["stage"] for p in summary["points"]] == ["sft", "stage1-short@1"]
    assert summary["stopped"] == {"stage": "stage1-short", "step": 1, "of": 2}
    assert not (run_dir / "1-stage1-short" / "stage.json").exists()  # not finished
    monkeypatch.undo()
    summary = run(0)  # no limit: stage 1 goes on from its step 1, then the others
    stages = [p["stage"] for p in summary["points"]]
    assert stages == ["sft", "stage1-short@1", "stage1-short", "stage2-long", "stage3-hard"]
    assert summary["stopped"] is None
    stage1 = json.loads((run_dir / "1-stage1-short" / "stage.json").read_text())
    assert stage1["steps"] == 2 and "stopped_at" not in stage1
    steps = [
        json.loads(line)["step"]
        for line in (run_dir / "1-stage1-short" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2]  # each step once


@pytest.mark.slow
def test_a_later_screen_that_keeps_nothing_ends_rl_and_the_run_is_scored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every screen says the policy solves every problem: stage 1's band (up to 1.0) keeps them,
    stage 3's (up to 0.75) keeps none, so RL ends before stage 3 and the policy after stage 2
    is scored, the reason printed and kept in summary.json."""
    from codeloop.rollout.score import Scores
    from codeloop.trainer import rl

    async def rates(agent: object, problems: list[Problem], *args: object, **kw: object) -> Scores:
        return Scores({p.id: 1.0 for p in problems})

    monkeypatch.setattr(rl, "score_policy", rates)
    overrides = [*_tiny_recipe(tmp_path), "--recipe.stages.2.refilter_max_pass_rate=0.75"]
    summary = asyncio.run(run_real(load_config(str(CONFIG), overrides), TINY))
    reason = "its screen kept no problems"
    assert summary["stopped"] == {"stage": "stage3-hard", "step": 0, "of": 1, "reason": reason}
    assert [p["stage"] for p in summary["points"]] == ["sft", "stage2-long"]
    assert f"RL ended before stage3-hard: {reason}" in capsys.readouterr().out
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["stopped"] == summary["stopped"]
    assert (tmp_path / "run" / "final_model" / "config.json").is_file()
    assert summary["trained_problems"]["problems"] == TINY.rl_problems


def _trajectory(status: RolloutStatus, text: str, calls: list[ToolCallRecord]) -> Trajectory:
    return Trajectory("p", 0, [1], [2], [1], [0.0], status, calls, text=text)


def test_tool_metrics_tell_a_call_cut_off_by_the_length_limit_from_no_call() -> None:
    ran = ToolCallRecord(ToolCall(PYTHON_TOOL, {"code": "print(1)"}, ""), ExecResult(ExecStatus.OK))
    bad = ToolCallRecord(None, ExecResult(ExecStatus.REJECTED), "bad JSON")
    called = '<tool_call>\n{"name": ...}\n</tool_call>'
    looping = "<tool_call>\nx1 = 1\nx1 = 1"
    groups = [
        [
            _trajectory(RolloutStatus.ANSWERED, f"{called}\n<answer>1</answer>", [ran]),
            _trajectory(RolloutStatus.TRUNCATED_LENGTH, f"{called}\n{looping}", [ran]),
            _trajectory(RolloutStatus.TRUNCATED_LENGTH, '<tool_call>\n{"code": "x = 1\\nx = 1', []),
            _trajectory(RolloutStatus.TRUNCATED_LENGTH, "I think I think I think", []),
            _trajectory(
                RolloutStatus.ANSWERED, "<tool_call>{</tool_call><answer>2</answer>", [bad]
            ),
        ]
    ]
    metrics = {
        key: value
        for key, value in trajectory_stats(groups[0]).items()
        if key in ("tool_use", "cut_off_in_call", "malformed_calls")
    }
    # a call that ran: 1st, 2nd (its second call was cut off), 5th (malformed, but answered)
    assert metrics["tool_use"] == pytest.approx(3 / 5)
    assert metrics["cut_off_in_call"] == pytest.approx(2 / 5)  # the 2nd and 3rd
    assert metrics["malformed_calls"] == pytest.approx(1 / 3)
    # codeloop eval's summary counts the same from its per-problem results
    shares = eval_summary([problem_result(Problem("p", "q", "1"), score(groups))])
    assert {k: shares[k] for k in metrics} == pytest.approx(metrics)


def test_the_disk_estimate_matches_a_saved_checkpoint(tmp_path: Path) -> None:
    """12 bytes a parameter for a checkpoint (float32 weights, AdamW's two moments), 4 for a
    saved policy: checked against what `save_checkpoint` writes after an AdamW step."""
    model = tiny_model(1000, hidden_size=64, layers=2, heads=4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()  # the moments exist only after a step
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    fmt = PromptFormat(train_tokenizer(["a b c"], vocab_size=300))
    checkpoint = save_checkpoint(
        tmp_path / "run",
        1,
        Policy(model, fmt),
        optimizer=optimizer,
        lr_schedule=schedule,
        extra={},
        keep=1,
    )
    Policy(model, fmt).save(tmp_path / "policy")

    def size(directory: Path) -> int:
        return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())

    written = size(checkpoint) + 2 * size(tmp_path / "policy")  # one stage: SFT, final policy
    parameters = sum(p.numel() for p in model.parameters())
    assert written == pytest.approx(disk_needed(parameters, stages=1, keep=1), rel=0.05)


def test_a_run_warns_when_the_disk_cannot_hold_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=3_200_000_000))
    warning = disk_warning(tmp_path / "runs" / "real", 5_918_660_352)  # not created yet
    assert warning is not None and "3.2 GB free" in warning and "5.9 GB" in warning
    assert str(tmp_path) in warning  # the nearest existing directory
    assert disk_warning(tmp_path, 3_000_000_000) is None


def test_real_gpu_takes_the_gpu_config_and_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    from codeloop import cli
    from codeloop.recipe import real

    calls: list[tuple[str, list[str], Sizes]] = []
    minutes: list[float] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --gpu asks for one
    monkeypatch.setattr(
        real, "main", lambda c, o, s, m: calls.append((c, o, s)) or minutes.append(m) or 0
    )
    assert cli.main(["real", "--gpu", "--rl-problems", "200", "--trainer.seed", "3"]) == 0
    assert cli.main(["real"]) == 0
    assert cli.main(["real", "--out", "runs/mine", "--trainer.output_dir", "runs/wins"]) == 0
    assert cli.main(["real", "--gpu", "--time-limit", "0"]) == 0
    assert cli.main(["real", "--time-limit", "30"]) == 0
    assert cli.main(["real", "--eval-every-stage"]) == 0
    assert minutes == [9.0, 0.0, 0.0, 0.0, 30.0, 0.0]  # the GPU recipe's limit, unless given
    assert calls[-1][2] == Sizes(eval_every_stage=True) and not calls[1][2].eval_every_stage
    assert calls[2][1] == [
        "--trainer.output_dir",
        "runs/mine",
        "--trainer.output_dir",
        "runs/wins",
    ]
    (gpu_config, overrides, gpu), (cpu_config, _, cpu) = calls[:2]
    assert gpu_config == "configs/gsm8k_smollm2_gpu.toml" and overrides == ["--trainer.seed", "3"]
    assert gpu == Sizes(
        dev=500,
        eval_problems=500,
        eval_samples=2,
        sft_problems=5973,
        rl_problems=200,
        trained_samples=4,
    )
    assert cpu_config == "configs/gsm8k_smollm2.toml" and cpu == Sizes()
    # the GPU recipe's SFT and RL problems fit in GSM8K's 7,473 outside the development split
    assert gpu.dev + gpu.sft_problems + 600 <= 7473


def test_real_model_takes_the_packaged_models_config_and_sizes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from codeloop import cli
    from codeloop.recipe import real
    from codeloop.recipe.sizes import GEMMA3_SIZES

    calls: list[tuple[str, list[str], Sizes, float]] = []
    monkeypatch.setattr(real, "main", lambda c, o, s, m: calls.append((c, o, s, m)) or 0)
    assert cli.main(["real", "--model", "gemma3-270m", "--dev", "100"]) == 0
    assert cli.main(["real", "--model=gemma3-270m", "--config=mine.toml", "--time-limit=0"]) == 0
    gemma3 = ("configs/gsm8k_gemma3.toml", [], replace(GEMMA3_SIZES, dev=100), 85.0)
    assert calls == [gemma3, ("mine.toml", ["--trainer.model=gemma3-270m"], GEMMA3_SIZES, 0.0)]
    cfg = load_config("configs/gsm8k_gemma3.toml")
    assert cfg.trainer.model == "gemma3-270m"  # imported on first use by run_real
    assert cfg.rollout.chat_template.endswith("gemma_chat_template.jinja")
    with pytest.raises(SystemExit):
        cli.main(["real", "--model", "gemma-7b"])
    assert "invalid choice: 'gemma-7b'" in capsys.readouterr().err


def test_real_long_is_smollm2s_recipe_with_rl_asked_for_more_steps_than_fit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from codeloop import cli
    from codeloop.recipe import real

    calls: list[tuple[str, list[str], Sizes, float]] = []
    monkeypatch.setattr(real, "main", lambda c, o, s, m: calls.append((c, o, s, m)) or 0)
    assert cli.main(["real", "--long"]) == 0
    assert cli.main(["real", "--long", "--out", "L", "--recipe.stages.2.steps=3"]) == 0
    assert cli.main(["real", "--long", "--rl-problems", "90", "--time-limit", "60"]) == 0
    (config, overrides, sizes, minutes), mine, smaller = calls
    assert config == "configs/gsm8k_smollm2.toml"
    assert sizes == Sizes(rl_problems=300) and minutes == 150.0
    cfg = load_config(config, overrides)
    assert cfg.trainer.output_dir == "runs/real-long"  # not make real's run, which it would resume
    assert [stage.steps for stage in cfg.recipe.stages] == [16, 12, 12]
    assert cfg.recipe.stages[0].refilter  # on screened problems
    cfg = load_config(mine[0], mine[1])  # the user's options after the preset's
    assert cfg.trainer.output_dir == "L" and [s.steps for s in cfg.recipe.stages] == [16, 12, 3]
    assert smaller[2] == Sizes(rl_problems=90) and smaller[3] == 60.0
    capsys.readouterr()
    assert cli.main(["real", "--long", "--model", "gemma3-270m"]) != 0
    assert cli.main(["real", "--long", "--gpu"]) != 0
    err = capsys.readouterr().err
    assert err.count("--long: the long recipe is SmolLM2's on a CPU") == 2
    assert len(calls) == 3


def test_the_memory_plan_counts_state_logits_activations_and_the_kv_cache() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    cfg = load_config(
        None, ["--trainer.micro_batch_tokens", "100", "--sft.micro_batch_tokens", "200"]
    )
    plan = memory_plan(config, 10_000, cfg, engine_bytes=2)
    assert plan == {
        "weights and AdamW": 160_000,  # 4 + 4 + 8 bytes a parameter
        "SFT weights": 40_000,
        "engine weights": 20_000,  # its copy in bfloat16
        "logits": 4 * 4 * 1000 * 200,  # four float32 copies of the larger micro-batch's
        "activations": 4 * (16 * 64 + 4 * 128) * 2 * 200,
        "KV cache": 32768 * 2 * 2 * 2 * 16 * 4,  # K and V, 2 layers, 2 heads of 16, float32
        "runtime": 440 * 2**20,  # Python and the libraries
    }
    packed = memory_plan(config, 10_000, cfg, engine_bytes=2, packed=True)
    assert packed == {**plan, "engine weights": 40_000}  # and its copies packed for oneDNN
    need = sum(plan.values())
    line, fits = memory_line(plan, need)
    assert fits and line.startswith("memory: about 0.5 GiB at the peak (weights and AdamW 0.0")
    line, fits = memory_line(plan, need - 1)
    assert not fits and "will not fit; lower trainer.micro_batch_tokens" in line


def test_gemma3_s_recipe_is_planned_to_fit_in_24_gib() -> None:
    """Gemma 3 270M (268M parameters, 18 layers of width 640, a 262,144-token vocabulary) at
    its recipe's micro-batches; 4,096-token ones (SmolLM2's) would not fit."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=262_144,
    )
    cfg = load_config("configs/gsm8k_gemma3.toml")
    plan = memory_plan(config, 268_098_176, cfg)
    assert sum(plan.values()) < 20 * 2**30
    bigger = load_config(
        "configs/gsm8k_gemma3.toml",
        ["--trainer.micro_batch_tokens", "4096", "--sft.micro_batch_tokens", "4096"],
    )
    assert not memory_line(memory_plan(config, 268_098_176, bigger), 24 * 2**30)[1]


def test_the_gpu_config_loads_with_the_engines_slots() -> None:
    cfg = load_config(str(CONFIG.with_name("gsm8k_smollm2_gpu.toml")), [])
    assert cfg.rollout.engine_max_batch == 256
    assert [s.name for s in cfg.recipe.stages] == ["stage1-short", "stage2-long"]
    assert cfg.trainer.output_dir == "runs/real-gpu"


def test_the_budget_plans_rl_steps_from_the_first_evaluations_rate() -> None:
    from codeloop.recipe.real import budget
    from codeloop.recipe.sizes import GPU_CONFIG, GPU_SIZES

    cfg = load_config(GPU_CONFIG, [])
    # 500 x 2 evaluated in 50 s: 20 trajectories/s. The screen: 300 x 4 = 1,200 (60 s); a
    # step: 16 prompts x 8 x 2 = 256 (12.8 s); the last evaluation 1.25 x 50 s; the trained
    # problems, 30 expected, twice x 4 samples (12 s). 540 s less SFT's 60, the first
    # evaluation's 50, 60, 62.5, 12 and 15 to finish: 280.5 s, 21 steps: all 12 planned.
    text = budget(cfg, GPU_SIZES, 9.0, sft_s=60.0, eval_s=50.0)
    planned = sum(stage.steps for stage in cfg.recipe.stages)
    assert planned == 12
    assert "(20.0 trajectories/s)" in text and "the screen 1.0 min" in text
    assert "an RL step's sampling 13 s" in text
    assert "room for at most 12 of the 12 RL steps (their updates" in text
    # at half that rate: 540 - 60 - 100 - 120 - 125 - 24 - 15 = 96 s, three steps of 25.6 s
    text = budget(cfg, GPU_SIZES, 9.0, sft_s=60.0, eval_s=100.0)
    assert "an RL step's sampling 26 s" in text
    assert "room for at most 3 of the 12 RL steps (their updates" in text
    # a rerun that found SFT and the evaluation done, 1 s into its time: 540 - 1 - 120 - 125 -
    # 24 - 15 = 255 s, nine steps
    text = budget(cfg, GPU_SIZES, 9.0, sft_s=60.0, eval_s=100.0, spent_s=1.0)
    assert "room for at most 9 of the 12 RL steps (their updates" in text
    # the first evaluation scored 2,000 trajectories in its 50 s (sets beside): 40 a second
    text = budget(cfg, GPU_SIZES, 9.0, sft_s=60.0, eval_s=50.0, points=[{"scored": 2000}])
    assert "(40.0 trajectories/s)" in text and "an RL step's sampling 6 s" in text


def test_the_time_kept_after_rl_holds_the_last_evaluation_and_the_trained_problems() -> None:
    from codeloop.recipe.real import after_rl_s
    from codeloop.recipe.sizes import GPU_SIZES

    points = [{"stage": "sft", "seconds": 40.0}, {"stage": "stage1", "seconds": 30.0}]
    # the last evaluation: 1.25 x 40 s = 50 s. The trained problems: 30 expected (a tenth of
    # the 300 screened) x 4 samples, twice, against 500 x 2 in 40 s: 2 x 0.12 x 50 s = 12 s.
    # And 15 s to finish.
    assert after_rl_s(points, GPU_SIZES) == pytest.approx(50 + 12 + 15)
    assert after_rl_s([], GPU_SIZES) == 15.0
    # once the screen has kept 100: 100 x 4, twice, against 1,000 in 40 s: 2 x 0.4 x 50 s
    assert after_rl_s(points, GPU_SIZES, 100) == pytest.approx(50 + 40 + 15)
    # an evaluation that scored 2,000 trajectories (sets beside the held-out ones): the trained
    # problems' 120, twice, are 2 x 0.06 of it
    points[0]["scored"] = 2000
    assert after_rl_s(points, GPU_SIZES) == pytest.approx(50 + 6 + 15)


def test_the_slots_are_planned_for_the_longest_prompt_and_budget() -> None:
    """The GPU recipe's budgets: RL 768 (stage overrides 512 and 768), evaluation 1,024; a
    request holds its prompt and the budget, so the slots are planned for the longest prompt
    and 1,024."""
    from codeloop.recipe.real import longest_request
    from codeloop.recipe.sizes import GPU_CONFIG

    cfg = load_config(str(Path(__file__).parents[2] / GPU_CONFIG), [])
    fmt = PromptFormat(train_tokenizer(["Ann has 10 apples and gets 3. How many?"] * 20, 400))
    problems = [Problem("a", "Ann has 10 apples.", "10"), Problem("b", "Ann " * 30, "1")]
    longest = max(len(fmt.prompt_ids(p.problem)) for p in problems)
    assert longest == len(fmt.prompt_ids("Ann " * 30))
    assert longest_request(cfg, fmt, problems) == longest + 1024
    stretched = load_config(str(Path(__file__).parents[2] / GPU_CONFIG), [])
    stretched.recipe.stages[1].overrides = {"rollout.max_response_tokens": 2000}
    assert longest_request(stretched, fmt, problems) == longest + 2000  # a stage's budget
