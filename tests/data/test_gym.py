"""reasoning-gym tasks as problems (`data/gym.py`): mixes from the command line and from files,
deterministic draws, held-out problems that share no question with training, bad task names
and configs as one-line errors, and problem files that keep each problem's task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym", reason="the gym extra: pip install 'codeloop[gym]'")

from codeloop.config import DataConfig  # noqa: E402
from codeloop.data import gym  # noqa: E402
from codeloop.data.curate import write_problems  # noqa: E402
from codeloop.data.problems import DataError, load_problems  # noqa: E402
from codeloop.reward import Verdict, Verifier  # noqa: E402

MIX = [
    gym.GymTask("lcm", {"min_value": 2, "max_value": 50}, 1.0),
    gym.GymTask("gcd", {"max_value": 500}, 3.0),
]


def test_a_command_line_mix_names_tasks_at_their_defaults() -> None:
    assert gym.parse_mix("gym:lcm, count_bits") == [gym.GymTask("lcm"), gym.GymTask("count_bits")]
    assert gym.parse_mix("gym:power_function")  # a config class without validate()


def test_a_mix_file_in_json_or_toml_reads_back_as_written(tmp_path: Path) -> None:
    (tmp_path / "mix.json").write_text(gym.mix_json(MIX))
    toml = (
        '[[tasks]]\ntask = "lcm"\nweight = 1.0\nconfig = { min_value = 2, max_value = 50 }\n'
        '[[tasks]]\ntask = "gcd"\nweight = 3\nconfig = { max_value = 500 }\n'
    )
    (tmp_path / "mix.toml").write_text(toml)
    assert gym.parse_mix(f"gym:{tmp_path / 'mix.json'}") == MIX
    assert gym.parse_mix(f"gym:{tmp_path / 'mix.toml'}") == MIX


@pytest.mark.parametrize(
    ("entries", "said"),
    [
        ([{"task": "lcmm"}], "no gym task 'lcmm'; valid: "),
        ([{"task": "lcm", "config": {"max_val": 9}}], "lcm has no setting max_val; valid: "),
        ([{"task": "lcm", "config": {"min_value": 50, "max_value": 3}}], "max_value must be >"),
        ([{"task": "lcm", "weight": 0}], "weight must be a positive number"),
        ([{"task": "lcm", "size": 3}], "unknown keys ['size']"),
        ([], "expected a non-empty list of tasks"),
    ],
)
def test_a_bad_mix_is_one_line_naming_what_is_wrong(
    tmp_path: Path, entries: list[dict[str, object]], said: str
) -> None:
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(entries))
    with pytest.raises(DataError) as err:
        gym.parse_mix(f"gym:{path}")
    assert said in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)
    if "valid: " in said:  # the valid names are listed
        assert (
            "count_bits" if "lcmm" in said else "max_numbers, max_value, min_numbers, min_value"
        ) in str(err.value)


def test_draws_are_deterministic_from_the_seed_and_follow_the_weights() -> None:
    first, again = gym.generate(MIX, 200, seed=5), gym.generate(MIX, 200, seed=5)
    other = gym.generate(MIX, 200, seed=6)
    assert first == again and first != other
    assert [p.id for p in first[:2]] == ["gym-5-0", "gym-5-1"]
    share = sum(p.task == "gcd" for p in first) / len(first)
    assert 0.6 < share < 0.9  # weight 3 of 4
    with Verifier() as verifier:  # every drawn answer scores 1 against its own problem
        answers = [f"<answer>\\boxed{{{p.answer}}}</answer>" for p in first[:20]]
        found = verifier.score_batch([(a, p.gold) for a, p in zip(answers, first, strict=False)])
    assert {r.reason for r in found} == {Verdict.CORRECT}


def test_held_out_problems_share_no_question_with_training() -> None:
    small = [gym.GymTask("lcm", {"min_value": 2, "max_value": 9})]  # 64 questions at most
    train = gym.generate(small, 30, seed=0)
    held = gym.held_out(small, 15, seed=1, seen={p.problem for p in train})
    assert len(held) == 15 and len({p.problem for p in held}) == 15
    assert {p.problem for p in held}.isdisjoint(p.problem for p in train)
    with pytest.raises(DataError, match="fewer than 60 questions unlike the training ones"):
        gym.held_out(small, 60, seed=1, seen={p.problem for p in train})


def test_a_problem_file_keeps_each_problems_task_and_scorer(tmp_path: Path) -> None:
    drawn = gym.generate(MIX, 5, seed=2)
    write_problems(tmp_path / "p.jsonl", drawn)
    assert load_problems(str(tmp_path / "p.jsonl")) == drawn
    assert load_problems("gym:lcm,gcd", DataConfig(gym_problems=4, gym_seed=7)) == gym.generate(
        [gym.GymTask("lcm"), gym.GymTask("gcd")], 4, 7
    )


def test_a_problem_line_with_a_bad_task_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    lines = [
        {"id": "a", "problem": "2 + 2?", "answer": "4"},
        {"id": "b", "problem": "lcm(2, 3)?", "answer": "6", "task": "lcn", "metadata": {}},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(DataError, match=f"{path}:2: no gym task 'lcn'; valid: "):
        load_problems(str(path))
