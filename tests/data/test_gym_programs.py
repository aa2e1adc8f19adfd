"""Each family's demonstration program against its own generator: run on many seeds, what it
prints is scored by the task's scorer."""

import contextlib
import io
import json

import pytest

pytest.importorskip("reasoning_gym", reason="the gym extra: pip install 'codeloop[gym]'")

from codeloop.data import gym  # noqa: E402
from codeloop.data.gym_programs import PROGRAMS, program  # noqa: E402
from codeloop.data.problem import Problem  # noqa: E402
from codeloop.reward.task import task_score  # noqa: E402

SEEDS = 40


def _printed(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})  # noqa: S102 - the programs this module builds, on the gym's own data
    return out.getvalue().strip()


def _excused(problem: Problem, printed: str) -> bool:
    """Problems no program can answer from what the question shows: an equation without its
    variable (`0 = 0`), and a millisecond duration whose gold the task computed from times
    finer than the question prints: one millisecond off, no more."""
    metadata = json.loads(problem.metadata)
    if problem.task == "simple_equations":
        return metadata["variable"] not in metadata["equation"]
    if problem.task != "time_intervals" or metadata["task_type"] != "time_ms" or not printed:
        return False
    return abs(_milliseconds(printed) - _milliseconds(problem.answer)) == 1


def _milliseconds(clock: str) -> int:
    hours, minutes, seconds = clock.split(":")
    whole, millis = seconds.split(".")
    return ((int(hours) * 60 + int(minutes)) * 60 + int(whole)) * 1000 + int(millis)


@pytest.mark.parametrize("task", sorted(PROGRAMS))
def test_the_program_prints_what_the_task_scores_right(task: str) -> None:
    wrong = []
    for problem in gym.generate([gym.GymTask(task)], SEEDS, seed=11):
        code = program(task, json.loads(problem.metadata), problem.problem)
        assert code is not None
        try:
            printed = _printed(code)
        except ArithmeticError:
            printed = ""
        if not task_score(printed, problem.gold) and not _excused(problem, printed):  # type: ignore[arg-type]
            wrong.append((problem.problem, problem.answer, printed))
    assert not wrong, wrong[:3]


def test_programs_are_written_from_the_question() -> None:
    # the numbers of the question, the computation left to Python: nothing worked out ahead
    problem = gym.generate([gym.GymTask("gcd")], 1, seed=3)[0]
    numbers = json.loads(problem.metadata)["numbers"]
    code = program("gcd", json.loads(problem.metadata), problem.problem)
    assert code == f"import math\nprint(math.gcd({numbers[0]}, {numbers[1]}))"
    assert all(str(n) in problem.problem for n in numbers)
    question = (
        "How much time elapsed from 09:43:58.821 to 22:11:11.690? Give your answer in HH:MM:SS.mmm."
    )
    metadata = {"task_type": "time_ms", "expected_format": "HH:MM:SS.mmm"}
    timed = program("time_intervals", metadata, question)
    assert timed is not None and "parser.parse('09:43:58.821')" in timed
    assert _printed(timed) == "12:27:12.869"  # the question's own times: 12:27:12.869 apart
    assert program("sudoku", {}, "?") is None  # no generator: no demonstration
