"""Gym SFT demonstrations: the task's program run in the real sandbox, kept only when its task
scores the printed answer right; the three sets of families and their disjointness."""

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym", reason="the gym extra: pip install 'codeloop[gym]'")

from codeloop.config import ConfigError, SandboxConfig, StageConfig, load_config  # noqa: E402
from codeloop.data import gym, gym_programs  # noqa: E402
from codeloop.data.problem import Problem  # noqa: E402
from codeloop.data.problems import load_problems  # noqa: E402
from codeloop.data.tokenizer import train_tokenizer  # noqa: E402
from codeloop.recipe.gsm8k_sft import Built  # noqa: E402
from codeloop.recipe.gym_sft import build_gym  # noqa: E402
from codeloop.recipe.sizes import Sizes  # noqa: E402
from codeloop.recipe.tasks import family_sets, task_data  # noqa: E402
from codeloop.rollout.prompt import PromptFormat  # noqa: E402
from codeloop.sandbox.pool import LocalSandbox  # noqa: E402
from codeloop.trainer.sft import encode_conversation  # noqa: E402


def _build(problems: list[Problem], error_share: float = 0.0) -> tuple[Built, PromptFormat]:
    fmt = PromptFormat(train_tokenizer(["print(math.gcd(12, 18)) bin count"] * 20, 400))

    async def main() -> Built:
        async with LocalSandbox(SandboxConfig(workers=1)) as sandbox:
            return await build_gym(problems, sandbox, fmt, error_share)

    return asyncio.run(main()), fmt


def test_a_demonstration_answers_what_its_program_printed() -> None:
    [power] = [p for p in gym.generate([gym.GymTask("power_function")], 8, 2) if "^-" in p.problem][
        :1
    ]
    gcd = gym.generate([gym.GymTask("gcd")], 1, 5)[0]
    plain = Problem("math", "What is 2 + 2?", "4")  # no task: no program
    built, fmt = _build([gcd, power, plain])
    assert built.ids == [gcd.id, power.id]
    assert built.dropped == {"no computation gives the answer": 1}
    first, second = built.conversations
    assert [m["role"] for m in first] == ["system", "user", "assistant", "tool", "assistant"]
    numbers = json.loads(gcd.metadata)["numbers"]
    payload = json.loads(first[2]["content"].split("<tool_call>\n")[1].split("\n</tool_call>")[0])
    assert (
        payload["arguments"]["code"] == f"import math\nprint(math.gcd({numbers[0]}, {numbers[1]}))"
    )
    assert first[3]["content"] == gcd.answer  # the sandbox's output
    assert first[4]["content"] == f"<answer>\\boxed{{{gcd.answer}}}</answer>"
    # the answer is what the program printed (e notation), not the gold's long decimal
    printed = second[3]["content"]
    assert "e-" in printed and printed != power.answer
    assert second[4]["content"] == f"<answer>\\boxed{{{printed}}}</answer>"
    assert sum(encode_conversation(fmt, first).loss_mask) > 0


def test_a_program_whose_answer_its_task_scores_wrong_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    problems = gym.generate([gym.GymTask("count_bits")], 3, 1)
    monkeypatch.setitem(gym_programs.PROGRAMS, "count_bits", lambda m, q: f"print({m['number']})")
    built, _ = _build(problems)
    assert built.conversations == [] and built.dropped == {"the code does not print the answer": 3}
    monkeypatch.setitem(gym_programs.PROGRAMS, "count_bits", lambda m, q: "print(1)\nprint(2)")
    assert _build(problems)[0].dropped == {"the code does not print the answer": 3}


def test_an_error_and_its_fix_in_a_gym_demonstration() -> None:
    built, _ = _build(gym.generate([gym.GymTask("count_bits")], 1, 4), error_share=1.0)
    (fixed,) = built.conversations
    assert "print(answer)" in fixed[2]["content"]
    assert fixed[3]["content"].endswith("NameError: name 'answer' is not defined")
    assert "bin(" in fixed[4]["content"]


def test_a_family_in_two_sets_is_refused_with_one_line() -> None:
    sets = family_sets([gym.GymTask("gcd")], [gym.GymTask("lcm"), gym.GymTask("products")], [])
    assert sets == {"sft": ["gcd"], "rl": ["lcm", "products"], "held_out": []}
    with pytest.raises(ConfigError) as err:
        family_sets([gym.GymTask("gcd")], [gym.GymTask("lcm")], [gym.GymTask("gcd")])
    assert str(err.value) == (
        "data.sft_gym and data.held_out_gym share gcd: a family is in one set (SFT "
        "demonstrations, RL, or neither)"
    )
    with pytest.raises(ConfigError, match="data.rl and data.held_out_gym share lcm"):
        family_sets([], [gym.GymTask("lcm")], [gym.GymTask("lcm")])


def test_the_run_keeps_its_families_apart_in_its_own_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config(
        None,
        [
            "--data.rl=gym:lcm,products",
            "--data.sft_gym=gym:gcd,count_bits",
            "--data.held_out_gym=gym:spell_backward,letter_counting",
        ],
    )
    sizes = Sizes(eval_problems=6, rl_problems=8, sft_gym_problems=10, sft_family_problems=4,
                  held_out_family_problems=6, dev_beside=2)  # fmt: skip
    dev = [Problem(f"d{i}", "?", "1") for i in range(3)]
    data = task_data(cfg, tmp_path, sizes, [], dev)
    families = json.loads((tmp_path / "families.json").read_text())
    assert (
        families
        == data.families
        == {
            "sft": ["count_bits", "gcd"],
            "rl": ["lcm", "products"],
            "held_out": ["letter_counting", "spell_backward"],
        }
    )
    assert {p.task for p in data.sft} <= {"gcd", "count_bits"} and len(data.sft) == 10
    assert {p.task for p in data.rl} | {p.task for p in data.held_out} <= {"lcm", "products"}
    assert {p.task for p in data.beside["held_out_families"]} <= set(families["held_out"])
    assert {p.task for p in data.beside["sft_families"]} <= set(families["sft"])
    assert {p.problem for p in data.sft}.isdisjoint(p.problem for p in data.beside["sft_families"])
    assert len(data.beside["held_out_families"]) == 6 and len(data.beside["gsm8k_dev"]) == 2
    again = task_data(cfg, tmp_path, sizes, [], dev)  # read back, the same
    assert again == data
    assert capsys.readouterr().err == ""
    # a rerun whose config names other families keeps the run's own, and says so
    other = load_config(None, ["--data.rl=gym:lcm,products", "--data.held_out_gym=gym:gcd"])
    assert task_data(other, tmp_path, sizes, [], dev) == data
    assert capsys.readouterr().err == (
        f"{tmp_path}: the run keeps its own families (families.json); the config's "
        "data.sft_gym and data.held_out_gym apply to a new run directory (--out DIR)\n"
    )
    (tmp_path / "families.json").unlink()  # a run made before the sets
    task_data(cfg, tmp_path, sizes, [], dev)
    assert "(families.json: none, made before the sets)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="share gcd"):
        task_data(load_config(None, ["--data.rl=gym:gcd", "--data.sft_gym=gym:gcd"]),
                  tmp_path / "other", sizes, [], dev)  # fmt: skip
    assert not (tmp_path / "other").exists()


def test_a_stage_draws_harder_problems_of_the_families_the_policy_solved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from types import SimpleNamespace

    from codeloop.config import AlgoConfig, StageConfig
    from codeloop.recipe.runner import HARDER_FILE, _stage_problems, known_problems

    problems = gym.generate([gym.GymTask("lcm"), gym.GymTask("gcd")], 6, 1)
    lcm = [p for p in problems if p.task == "lcm"]
    scored: list[list[str]] = []

    class Run:  # the policy solves every lcm problem drawn first, half of the others
        cfg = SimpleNamespace(trainer=SimpleNamespace(seed=0), algo=AlgoConfig())
        world = SimpleNamespace(is_main=True)

        async def score(self, given: list[Problem], samples: int, label: str) -> object:
            scored.append([p.id for p in given])
            solved = {p.id: 1.0 if p in lcm else 0.5 for p in given}
            return SimpleNamespace(per_problem=solved)

    stage_dir = tmp_path / "2-hard"
    stage_dir.mkdir()
    stage = StageConfig(
        name="hard",
        refilter=True,
        refilter_samples=2,
        refilter_max_pass_rate=0.75,
        harder="gym:lcm",  # lcm at its default settings: values up to 100
    )
    kept = asyncio.run(_stage_problems(Run(), stage, problems, index=1, where=stage_dir))  # type: ignore[arg-type]
    new = load_problems(str(stage_dir / HARDER_FILE))
    assert len(new) == len(lcm) and {p.task for p in new} == {"lcm"}
    assert scored == [[p.id for p in problems], [p.id for p in new]]
    # the solved lcm problems leave the band; gcd's (half) and the new ones (half) stay
    assert [p.id for p in kept] == [p.id for p in problems if p.task == "gcd"] + [p.id for p in new]
    assert f"harder: lcm (solved 100%: {len(lcm)} new)" in capsys.readouterr().out
    assert known_problems(tmp_path, problems) == [*problems, *new]  # a rerun finds them
    # a family solved no more often than the band's top keeps its problems: nothing drawn
    stage.refilter_max_pass_rate = 1.0
    again = asyncio.run(_stage_problems(Run(), stage, problems, index=1, where=tmp_path))  # type: ignore[arg-type]
    assert again == problems and not (tmp_path / HARDER_FILE).exists()


def test_a_bad_harder_mix_fails_before_any_stage_runs(tmp_path: Path) -> None:
    from codeloop.data.problem import DataError
    from codeloop.recipe.runner import run_recipe

    def run(harder: str) -> None:
        cfg = load_config(None, ["--trainer.output_dir", str(tmp_path)])
        cfg.recipe.stages = [StageConfig(name="a", steps=1), StageConfig(name="b", harder=harder)]
        asyncio.run(run_recipe(cfg, None, None, [], tools=None))  # type: ignore[arg-type]

    with pytest.raises(ConfigError) as err:
        run("lcm")
    assert str(err.value) == (
        "recipe.stages[1].harder: 'lcm' is not a gym mix (gym:TASKS or gym:MIX_FILE)"
    )
    with pytest.raises(DataError, match="no gym task 'lcn'"):
        run("gym:lcn")
    assert not any(tmp_path.iterdir())  # no stage started
