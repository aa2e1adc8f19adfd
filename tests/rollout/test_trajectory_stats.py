"""Trajectory statistics (one computation for RL, the recipes and `codeloop eval`), by hand."""

import pytest

from codeloop.rollout.stats import stats, trajectory_stats
from codeloop.types import (
    ExecResult,
    ExecStatus,
    RolloutStatus,
    ToolCall,
    ToolCallRecord,
    Trajectory,
)


def _call(status: ExecStatus, parsed: bool = True) -> ToolCallRecord:
    call = ToolCall("python", {"code": "1"}, "") if parsed else None
    return ToolCallRecord(call, ExecResult(status), None if parsed else "bad json")


def _traj(
    reward: float,
    status: RolloutStatus,
    calls: list[ToolCallRecord],
    mask: list[int],
    text: str = "",
) -> Trajectory:
    return Trajectory(
        "p",
        0,
        [1],
        [2] * len(mask),
        mask,
        [0.0] * len(mask),
        status,
        calls,
        num_turns=len(calls) + 1,
        reward=reward,
        text=text,
    )


def test_statistics_of_four_trajectories_worked_by_hand() -> None:
    trajectories = [
        # right, 2 calls (one error), 4 tokens of which 3 sampled
        _traj(
            1.0,
            RolloutStatus.ANSWERED,
            [_call(ExecStatus.OK), _call(ExecStatus.ERROR)],
            [1, 1, 0, 1],
        ),
        # right, no call, 2 sampled tokens
        _traj(1.0, RolloutStatus.ANSWERED, [], [1, 1]),
        # wrong, a malformed call and a sandbox fault (not the model's error)
        _traj(
            0.0,
            RolloutStatus.NO_ANSWER,
            [_call(ExecStatus.REJECTED, parsed=False), _call(ExecStatus.SANDBOX_ERROR)],
            [1, 0, 1],
        ),
        # cut off inside a call it opened
        _traj(
            0.0,
            RolloutStatus.TRUNCATED_LENGTH,
            [],
            [1] * 5,
            text='<tool_call>\n{"name": "x", "arguments": {"code": "1 + ',
        ),
    ]
    found = trajectory_stats(trajectories)
    assert found["reward"] == 0.5
    assert found["response_tokens"] == pytest.approx((4 + 2 + 3 + 5) / 4)
    assert found["policy_tokens"] == pytest.approx((3 + 2 + 2 + 5) / 4)
    assert found["turns"] == pytest.approx((3 + 1 + 3 + 1) / 4)
    assert found["tool_calls"] == 1.0  # 4 calls over 4 trajectories
    assert found["tool_error_ratio"] == pytest.approx(2 / 4)  # the error and the malformed call
    assert found["tool_error_ratio_correct"] == pytest.approx(1 / 2)  # among right answers
    assert found["tool_use"] == 0.5 and found["cut_off_in_call"] == 0.25
    assert found["malformed_calls"] == pytest.approx(1 / 4)
    assert found["infra_faults"] == 0.25
    assert found["status_answered"] == 0.5 and found["status_no_answer"] == 0.25
    assert found["status_truncated_length"] == 0.25 and found["status_error"] == 0.0


def test_no_trajectories_give_zeros() -> None:
    assert set(stats([]).values()) == {0.0}
