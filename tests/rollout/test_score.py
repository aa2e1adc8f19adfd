"""A policy's scores (`rollout/score.py`): what the infrastructure failed is left out of every
figure, the pass rate and the trajectory statistics alike, and counted."""

from codeloop.rollout.score import Scores, score
from codeloop.rollout.stats import trajectory_stats
from codeloop.types import (
    ExecResult,
    ExecStatus,
    RolloutStatus,
    ToolCall,
    ToolCallRecord,
    Trajectory,
)


def _trajectory(
    problem: str,
    reward: float,
    tokens: int,
    calls: int,
    status: RolloutStatus,
    result: ExecStatus = ExecStatus.OK,
) -> Trajectory:
    records = [ToolCallRecord(ToolCall("python", {"code": "1"}, ""), ExecResult(result))] * calls
    mask = [1] * tokens
    return Trajectory(
        problem,
        0,
        [1],
        [2] * tokens,
        mask,
        [0.0] * tokens,
        status,
        records,
        num_turns=calls + 1,
        reward=reward,
    )


def test_samples_the_infrastructure_failed_count_in_no_figure() -> None:
    answered = RolloutStatus.ANSWERED
    groups = [
        [
            _trajectory("a", 1.0, 10, 1, answered),
            _trajectory("a", 0.0, 30, 1, answered),
            _trajectory("a", 0.0, 500, 7, RolloutStatus.ERROR),  # the engine failed
        ],
        [
            _trajectory("b", 1.0, 20, 0, answered),
            _trajectory("b", 0.0, 900, 9, answered, ExecStatus.SANDBOX_ERROR),  # the sandbox
        ],
    ]
    found = score(groups)
    metrics = found.metrics()
    assert found.per_problem == {"a": 0.5, "b": 1.0} and metrics["pass@1"] == 0.75
    assert metrics["infrastructure_failures"] == 2 and metrics["problems"] == 2
    # the three scored samples only: 10, 30 and 20 tokens; 1, 1 and 0 calls
    means = trajectory_stats(found.trajectories)
    assert means["response_tokens"] == 20 and means["policy_tokens"] == 20
    assert means["tool_calls"] == 2 / 3


def test_a_problem_is_scored_over_its_problems_not_its_trajectories() -> None:
    right, failed = RolloutStatus.ANSWERED, RolloutStatus.ERROR
    groups = [
        [_trajectory("a", 1.0, 1, 0, right), _trajectory("a", 1.0, 1, 0, right)],
        [_trajectory("b", 0.0, 1, 0, right), _trajectory("b", 1.0, 1, 0, failed)],
        [_trajectory("c", 1.0, 1, 0, failed), _trajectory("c", 1.0, 1, 0, failed)],
    ]
    found = score(groups)
    metrics = found.metrics()
    # a: 2 of 2, b: 0 of 1 scored, c: nothing scored; avg@k over problems (1 + 0) / 2, not the
    # trajectories' 2 of 3, and the failed ones' rewards count for nothing
    assert found.per_problem == {"a": 1.0, "b": 0.0}
    assert metrics["pass@1"] == 0.5 and metrics["problems"] == 2
    assert metrics["infrastructure_failures"] == 3
    assert (metrics["pass@1_low"], metrics["pass@1_high"]) == (0.0, 1.0)  # two problems, 1, 0
    assert score([groups[2]]).metrics() == {"problems": 0, "infrastructure_failures": 2}


def test_merged_scores_add_up_the_parts() -> None:
    """Ranks' shares, or an evaluation's lines: the problems joined, the failures summed."""
    merged = Scores.merged([Scores({"a": 1.0}, 1), Scores({"b": 0.5}, 2), Scores({}, 4)])
    assert merged.per_problem == {"a": 1.0, "b": 0.5} and merged.failed == 7
    assert merged.metrics()["pass@1"] == 0.75
    line = {"id": 7, "correct": [True, False, False], "failed": 1}
    assert Scores.from_result(line) == Scores({"7": 1 / 3}, 1)
