"""A policy's scores (`eval/passrate.py`): what the infrastructure failed is left out of every
figure, the pass rate and the trajectory statistics alike."""

from codeloop.eval.passrate import policy_metrics
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
    found = policy_metrics(groups)
    assert found["per_problem"] == {"a": 0.5, "b": 1.0} and found["accuracy"] == 0.75
    assert found["infrastructure_failures"] == 2 and found["problems"] == 2
    # the three scored samples only: 10, 30 and 20 tokens; 1, 1 and 0 calls
    assert found["response_tokens"] == 20 and found["policy_tokens"] == 20
    assert found["tool_calls"] == 2 / 3
