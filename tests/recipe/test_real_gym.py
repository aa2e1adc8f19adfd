"""`codeloop real --task gym` at tiny scale: a small random model, GSM8K-format SFT data
written here, RL on a reasoning-gym mix; held-out gym problems and GSM8K's development split
scored after SFT and after RL, the summary's paired differences, and the rerun."""

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym", reason="the gym extra: pip install 'codeloop[gym]'")

from recipe.test_real import _tiny_recipe  # noqa: E402

from codeloop.config import load_config  # noqa: E402
from codeloop.data.problems import load_problems  # noqa: E402
from codeloop.recipe.real import run_real  # noqa: E402
from codeloop.recipe.sizes import Sizes  # noqa: E402
from codeloop.recipe.tasks import by_task  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gym_smollm2.toml"
TINY = Sizes(
    dev=3,
    eval_problems=6,
    eval_samples=2,
    sft_problems=4,
    rl_problems=4,
    dev_beside=2,
    sft_gym_problems=3,
    sft_family_problems=2,
    held_out_family_problems=3,
)


@pytest.mark.slow
def test_the_gym_recipe_scores_held_out_gym_problems_and_the_dev_split(tmp_path: Path) -> None:
    overrides = [
        *_tiny_recipe(tmp_path),
        "--data.rl=gym:lcm,gcd",
        "--data.sft_gym=gym:count_bits",
        "--data.held_out_gym=gym:spell_backward",
    ]
    run_dir = tmp_path / "run"
    summary = asyncio.run(run_real(load_config(str(CONFIG), overrides), TINY))
    families = {"sft": ["count_bits"], "rl": ["gcd", "lcm"], "held_out": ["spell_backward"]}
    assert json.loads((run_dir / "families.json").read_text()) == families
    assert summary["families"] == families
    # SFT's data: GSM8K's conversations and count_bits' demonstrations, nothing of the others
    lines = [json.loads(line) for line in (run_dir / "sft.jsonl").read_text().splitlines()]
    assert {line.get("task") for line in lines} == {None, "count_bits"}
    assert sum(line.get("task") == "count_bits" for line in lines) == 3
    assert all("spell_backward" not in json.dumps(line) for line in lines)
    held_out = summary["held_out_families"]
    assert held_out["problems"] == 3 and set(held_out["by_task"]) == {"overall", "spell_backward"}
    assert {"difference", "interval95"} <= set(held_out)
    assert summary["beside"]["sft_families"]["problems"] == 2
    train = load_problems(str(run_dir / "gym_train.jsonl"))
    held = load_problems(str(run_dir / "gym_eval.jsonl"))
    assert len(train) == 4 and len(held) == 6
    assert {p.task for p in [*train, *held]} <= {"lcm", "gcd"}
    assert {p.problem for p in train}.isdisjoint(p.problem for p in held)
    mix = json.loads((run_dir / "gym_mix.json").read_text())
    assert [m["task"] for m in mix] == ["lcm", "gcd"]
    first, last = summary["points"][0], summary["points"][-1]
    assert sorted(first["per_problem"]) == sorted(p.id for p in held)
    assert all(4 * v == round(4 * v) for v in first["per_problem"].values())  # 2 samples each
    assert summary["gym"] == by_task(held, first, last)["overall"]
    before, after = first["per_problem"], last["per_problem"]
    assert summary["gym"]["difference"] == pytest.approx(
        100 * sum(after[i] - before[i] for i in before) / len(before)
    )
    assert set(summary["gym_by_task"]) == {"overall", *(p.task for p in held)}
    dev = summary["beside"]["gsm8k_dev"]
    assert [p["stage"] for p in dev["points"]] == ["sft", "stage3-hard"]
    assert dev["problems"] == 2 and "interval95" in dev
    assert {"difference", "interval95"} <= set(summary["trained_problems"] or {})
    again = asyncio.run(run_real(load_config(str(CONFIG), overrides), TINY))  # all done
    assert again["gym"] == summary["gym"] and again["beside"] == summary["beside"]


def test_real_task_gym_is_the_gym_config_and_sizes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dataclasses import replace

    from codeloop import cli
    from codeloop.recipe import real
    from codeloop.recipe.sizes import GYM_SIZES

    calls: list[tuple[str, list[str], Sizes, float]] = []
    monkeypatch.setattr(real, "main", lambda c, o, s, m: calls.append((c, o, s, m)) or 0)
    assert cli.main(["real", "--task", "gym", "--dev-beside", "50"]) == 0
    [(config, overrides, sizes, minutes)] = calls
    assert (config, sizes, minutes) == (
        "configs/gym_smollm2.toml",
        replace(GYM_SIZES, dev_beside=50),
        60.0,
    )
    assert sizes.eval_problems * sizes.eval_samples >= 300
    cfg = load_config(config, overrides)
    assert cfg.data.sft_gym.startswith("gym:") and cfg.data.held_out_gym.startswith("gym:")
    assert cfg.trainer.output_dir == "runs/real-gym" and cfg.data.rl.startswith("gym:")
    assert cfg.recipe.stages[0].refilter
    capsys.readouterr()
    assert cli.main(["real", "--task", "gym", "--long"]) != 0
    assert "--task gym: its recipes are for a CPU" in capsys.readouterr().err
    assert len(calls) == 1

    # Gemma 3 270M's gym recipe: its own config (model, turn markup, output directory) on the
    # same three sets of families, its sizes and its 85 minutes
    assert cli.main(["real", "--task", "gym", "--model", "gemma3-270m"]) == 0
    config, overrides, sizes, minutes = calls[-1]
    assert (config, minutes) == ("configs/gym_gemma3.toml", 85.0)
    assert sizes.eval_problems == 200 and sizes.eval_samples == 1 and sizes.dev_beside == 50
    gemma = load_config(config, overrides)
    assert gemma.trainer.model == "gemma3-270m"
    assert gemma.trainer.output_dir == "runs/real-gym-gemma3"
    assert gemma.rollout.chat_template.endswith("gemma_chat_template.jinja")
    assert (gemma.data.rl, gemma.data.sft_gym, gemma.data.held_out_gym) == (
        cfg.data.rl,
        cfg.data.sft_gym,
        cfg.data.held_out_gym,
    )
    assert gemma.recipe.stages[2].harder == cfg.recipe.stages[2].harder
    # --eval-families names the families in neither SFT nor RL
    assert cli.main(["real", "--task", "gym", "--eval-families", "spell_backward,gcd"]) == 0
    assert load_config(*calls[-1][:2]).data.held_out_gym == "gym:spell_backward,gcd"
    assert cli.main(["real", "--eval-families", "gcd"]) != 0
    assert "--eval-families: gym families are scored with --task gym" in capsys.readouterr().err


def test_the_packaged_mix_reads_and_checks() -> None:
    from codeloop.config import config_path
    from codeloop.data.gym import read_mix
    from codeloop.data.gym_programs import PROGRAMS
    from codeloop.recipe.tasks import family_sets

    data = load_config(str(CONFIG)).data
    mix, sft, held_out = (
        read_mix(config_path(spec.removeprefix("gym:")))
        for spec in (data.rl, data.sft_gym, data.held_out_gym)
    )
    assert len(mix) >= 4 and all(task.weight > 0 for task in mix)
    sets = family_sets(sft, mix, held_out)  # disjoint
    harder = read_mix(config_path(load_config(str(CONFIG)).recipe.stages[-1].harder[4:]))
    assert {t.task for t in harder} == {t.task for t in mix}  # each RL family can grow harder
    assert all(family in PROGRAMS for family in sets["sft"])  # each has its demonstrations
    # the tasks the GSM8K-only SFT policy never solved are taught, or trained on by RL
    never = {"gcd", "count_bits", "count_primes", "base_conversion", "leg_counting",
             "fraction_simplification", "prime_factorization", "simple_equations",
             "power_function", "time_intervals"}  # fmt: skip
    assert never <= set(sets["sft"]) | set(sets["rl"])
