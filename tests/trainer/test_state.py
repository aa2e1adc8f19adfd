"""The run state: one value into and out of a checkpoint, carried between recipe stages."""

import random

from codeloop.data.problems import Problem
from codeloop.trainer.state import RunState, problem_digest

PROBLEMS = [Problem("a", "1?", "1"), Problem("b", "2?", "2")]


def test_the_state_goes_into_a_checkpoint_and_back() -> None:
    state = RunState(
        7,
        data_position=5,
        problems=problem_digest(PROBLEMS),
        sources={"async": {"pending": [3, 4], "next": [2, 3]}},
    )
    state.roc_rng.random()  # the resampling RNG has moved on
    saved = state.state_dict()
    expected = state.roc_rng.random()
    state.sources["async"]["pending"].append(9)  # the saved copy does not change with it
    back = RunState(0)
    back.load_state_dict(saved)
    assert (back.data_position, back.problems, back.sources) == (
        5,
        problem_digest(PROBLEMS),
        {"async": {"pending": [3, 4], "next": [2, 3]}},
    )
    assert back.roc_rng.random() == expected


def test_a_stage_goes_on_drawing_only_over_the_same_problems() -> None:
    before = RunState(
        1, data_position=9, problems=problem_digest(PROBLEMS), sources={"async": {"pending": [8]}}
    )
    same = RunState(1)
    same.carry_on_from(before, problem_digest(PROBLEMS))
    assert (same.data_position, same.sources) == (9, {"async": {"pending": [8]}})
    assert same.roc_rng.random() == random.Random(1).random()  # resampling starts afresh
    other = RunState(1)
    other.carry_on_from(before, problem_digest(PROBLEMS[:1]))
    assert (other.data_position, other.sources) == (0, {})
    assert problem_digest(PROBLEMS) != problem_digest(PROBLEMS[::-1])  # the order counts
