import json

import pytest

from codeloop.types import (
    ExecRequest,
    ExecResult,
    ExecStatus,
    RolloutStatus,
    ToolCall,
    ToolCallRecord,
    Trajectory,
)


def _trajectory(**changes: object) -> Trajectory:
    fields: dict[str, object] = dict(
        prompt_id="p1",
        sample_index=3,
        prompt_ids=[1, 2, 3],
        response_ids=[10, 11, 12, 13],
        loss_mask=[1, 1, 0, 1],
        logprobs=[-0.5, -1.0, 0.0, -0.25],
        status=RolloutStatus.ANSWERED,
        tool_calls=[
            ToolCallRecord(
                ToolCall("execute_python_code_with_standard_io", {"code": "1/0"}, "{...}"),
                ExecResult(
                    ExecStatus.ERROR, stderr="ZeroDivisionError", error_type="ZeroDivisionError"
                ),
            ),
            ToolCallRecord(None, ExecResult(ExecStatus.REJECTED), parse_error="bad JSON"),
        ],
        num_turns=2,
        final_answer="42",
        reward=1.0,
        text="...",
    )
    fields.update(changes)
    return Trajectory(**fields)  # type: ignore[arg-type]


def test_status_enums_are_their_string_values() -> None:
    assert [str(s) for s in ExecStatus] == [
        "ok",
        "error",
        "timeout",
        "memory",
        "killed",
        "rejected",
        "sandbox_error",
    ]
    assert [str(s) for s in RolloutStatus] == [
        "answered",
        "no_answer",
        "truncated_length",
        "truncated_turns",
        "error",
        "done",
    ]
    assert ExecStatus("timeout") is ExecStatus.TIMEOUT
    assert json.dumps(ExecStatus.OK) == '"ok"'


def test_trajectory_round_trips_through_json() -> None:
    original = _trajectory()
    restored = Trajectory.from_dict(json.loads(json.dumps(original.to_dict())))
    assert restored == original
    assert restored.status is RolloutStatus.ANSWERED
    assert restored.tool_calls[0].result.status is ExecStatus.ERROR
    assert restored.num_policy_tokens == 3


def test_trajectory_rejects_misaligned_token_lists() -> None:
    with pytest.raises(ValueError, match="one entry per token, got 4, 3, 4"):
        _trajectory(loss_mask=[1, 1, 0])
    with pytest.raises(ValueError, match="loss_mask must hold 0/1"):
        _trajectory(loss_mask=[1, 2, 0, 1])


def test_tool_call_record_failed_counts_parse_errors_and_bad_statuses() -> None:
    ok = ToolCallRecord(ToolCall("f", {}, ""), ExecResult(ExecStatus.OK, stdout="2\n"))
    timeout = ToolCallRecord(ToolCall("f", {}, ""), ExecResult(ExecStatus.TIMEOUT))
    malformed = ToolCallRecord(None, ExecResult(ExecStatus.REJECTED), parse_error="bad JSON")
    assert [ok.failed, timeout.failed, malformed.failed] == [False, True, True]


def test_from_dict_names_unknown_and_missing_fields() -> None:
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['cod'\]"):
        ExecRequest.from_dict({"cod": "print(1)"})
    with pytest.raises(ValueError, match=r"missing field\(s\) \['code'\]"):
        ExecRequest.from_dict({"stdin": ""})
    request = ExecRequest.from_dict({"code": "print(1)", "timeout_s": 2.5})
    assert request == ExecRequest("print(1)", timeout_s=2.5)
    assert request.memory_mb is None  # None = the sandbox's default


def test_exec_result_round_trip_and_ok() -> None:
    result = ExecResult(ExecStatus.OK, stdout="x", duration_s=0.01, truncated=True)
    assert result.ok
    assert ExecResult.from_dict(result.to_dict()) == result
    assert not ExecResult(ExecStatus.MEMORY).ok
