"""Answers to reasoning-gym problems scored as their task scores them (`reward/task.py`), in the
verifier's workers: each answer kind, a right value in a form the task refuses, a scorer that
raises and one that hangs. The problems are drawn by seed; their answers are written here."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym", reason="the gym extra: pip install 'codeloop[gym]'")

from codeloop.config import RewardConfig  # noqa: E402
from codeloop.data.gym import GymTask, generate  # noqa: E402
from codeloop.data.problems import Problem  # noqa: E402
from codeloop.reward import Verdict, Verifier  # noqa: E402
from codeloop.reward.task import TaskGold  # noqa: E402


def _one(task: str, seed: int, **config: object) -> Problem:
    return generate([GymTask(task, dict(config))], 1, seed)[0]


def _boxed(answer: str) -> str:
    return f"<answer>\\boxed{{{answer}}}</answer>"


# (task, seed, config, its answer as generated, accepted forms, refused forms)
CASES = [
    ("lcm", 2, {"min_value": 2, "max_value": 20}, "34", ["34"], ["68", "34.5"]),
    (
        "fraction_simplification",
        1,
        {"styles": ["plain"]},
        "884/979",
        ["884/979"],
        ["1768/1958", "0.903"],  # the same value unreduced, or as a decimal
    ),
    (
        "prime_factorization",
        1,
        {"min_value": 12, "max_value": 12},
        "2 × 2 × 3",
        ["2 × 2 × 3", "3 × 2 × 2"],
        ["2 × 3"],
    ),
    (
        "time_intervals",
        1,
        {"task_types": ["time"]},
        "06:09",
        ["06:09", "6:09"],
        ["06:19", "369 minutes"],
    ),
    (
        "calendar_arithmetic",
        1,
        {"tasks": ["weekday_of_date"]},
        "Thursday",
        ["Thursday"],
        ["thursday", "Mon"],  # partial credit (0.05) for the lower case: not a reward
    ),
    (
        "base_conversion",
        24,
        {"min_base": 2, "max_base": 16, "min_value": 200, "max_value": 4000},
        "6d0",
        ["6d0"],
        ["6D0", "1744"],  # hexadecimal in upper case, or the decimal value
    ),
]


@pytest.mark.parametrize(("task", "seed", "config", "answer", "right", "wrong"), CASES)
def test_each_answer_kind_is_scored_by_its_task(
    task: str, seed: int, config: dict[str, object], answer: str, right: list[str], wrong: list[str]
) -> None:
    problem = _one(task, seed, **config)
    assert problem.answer == answer and problem.task == task
    with Verifier() as verifier:
        results = verifier.score_batch([(_boxed(a), problem.gold) for a in [*right, *wrong]])
    verdicts = [r.reason for r in results]
    assert verdicts == [Verdict.CORRECT] * len(right) + [Verdict.WRONG] * len(wrong), verdicts
    assert [r.reward for r in results] == [1.0] * len(right) + [0.0] * len(wrong)


def test_a_math_gold_keeps_the_math_verifier() -> None:
    with Verifier() as verifier:
        found = verifier.score_batch([(_boxed("1/2"), "0.5"), (_boxed("276/1166"), "138/583")])
    assert [r.reason for r in found] == [Verdict.CORRECT, Verdict.CORRECT]


def test_a_scorer_that_raises_gives_an_unscorable_answer() -> None:
    problem = _one("prime_factorization", 1, min_value=12, max_value=12)
    with Verifier() as verifier:  # its scorer does int() on each factor: '2*2*3' raises
        found = verifier.score(_boxed("2*2*3"), problem.gold)
        after = verifier.score(_boxed("2 × 2 × 3"), problem.gold)  # the worker goes on
    assert (found.reason, found.reward, found.extracted) == (
        Verdict.VERIFIER_ERROR,
        0.0,
        "2*2*3",
    )
    assert after.reason == Verdict.CORRECT


def test_a_scorer_that_hangs_is_stopped_at_the_deadline() -> None:
    """countdown's scorer runs sympy's parse_expr on the answer: 9**9**9**9 never ends."""
    gold = TaskGold("countdown", "9", '{"numbers": [9], "target": 9}')
    with Verifier(RewardConfig(deadline_s=3.0)) as verifier:
        found = verifier.score_batch([(_boxed("9**9**9**9"), gold), (_boxed("9"), gold)])
        assert verifier.pool.replaced == 1  # the hung worker, killed
    assert [r.reason for r in found] == [Verdict.TIMEOUT, Verdict.CORRECT]
