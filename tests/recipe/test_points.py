"""A point's share of wrong answers whose own program had printed the right one."""

from codeloop.config import RewardConfig
from codeloop.data.problems import Problem
from codeloop.recipe.points import printed_right
from codeloop.reward import Verifier
from codeloop.types import ExecResult, ExecStatus, RolloutStatus, ToolCallRecord, Trajectory


def _trajectory(pid: str, reward: float, *outputs: tuple[ExecStatus, str]) -> Trajectory:
    calls = [ToolCallRecord(None, ExecResult(status=s, stdout=out)) for s, out in outputs]
    t = Trajectory(pid, 0, [1], [2], [1], [0.0], RolloutStatus.ANSWERED, calls, 1)
    t.reward = reward
    return t


def test_a_wrong_answer_after_a_right_output_is_counted() -> None:
    ok, error = ExecStatus.OK, ExecStatus.ERROR
    problems = [Problem("a", "6 * 7?", "42"), Problem("b", "2 + 2?", "4")]
    trajectories = [
        _trajectory("a", 0.0, (ok, "41"), (ok, "42\n")),  # printed 42 last, answered wrong: counted
        _trajectory("a", 0.0, (ok, "42"), (ok, "41")),  # its last output is wrong
        _trajectory("a", 0.0, (ok, "42"), (error, "")),  # the last call that ran printed 42
        _trajectory("a", 1.0, (ok, "42")),  # answered right: not counted
        _trajectory("b", 0.0),  # no call
        _trajectory("c", 0.0, (ok, "4")),  # not one of the problems
        _trajectory("b", 0.0, (ExecStatus.TIMEOUT, "4")),  # a call that did not finish
        _trajectory("b", 0.0, (ok, "  ")),  # printed nothing
    ]
    with Verifier(RewardConfig()) as verifier:
        assert printed_right(trajectories, problems, verifier) == 2 / 8
        assert printed_right([], problems, verifier) == 0.0
