"""Shared value types that cross module boundaries (see DESIGN.md, "Core types").

Plain dataclasses and string enums: no torch, no I/O. Every type round-trips through
`to_dict()` / `from_dict()` so that it can travel as JSON (HTTP, JSONL dumps, the viewer);
`from_dict` rejects unknown and missing fields with a message that names them.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from dataclasses import dataclass, field
from typing import Any

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - exercised only on Python 3.10

    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)


class ExecStatus(StrEnum):
    """How one code execution ended."""

    OK = "ok"
    ERROR = "error"  # exception in user code
    TIMEOUT = "timeout"  # wall-clock or CPU time limit
    MEMORY = "memory"  # memory limit
    KILLED = "killed"  # killed by a signal or another resource limit
    REJECTED = "rejected"  # the request itself was invalid
    SANDBOX_ERROR = "sandbox_error"  # infrastructure fault, not the user's code


class RolloutStatus(StrEnum):
    """How one trajectory ended."""

    ANSWERED = "answered"
    NO_ANSWER = "no_answer"
    TRUNCATED_LENGTH = "truncated_length"
    TRUNCATED_TURNS = "truncated_turns"
    ERROR = "error"
    DONE = "done"  # an environment said its episode was over after a tool call


def _check_keys(cls: type, data: dict[str, Any]) -> None:
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    required = {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; expected {sorted(names)}")
    missing = sorted(required - set(data))
    if missing:
        raise ValueError(f"{cls.__name__}: missing field(s) {missing}")


@dataclass(slots=True)
class ExecRequest:
    """One snippet to run. `None` limits mean the sandbox's configured defaults."""

    code: str
    stdin: str = ""
    timeout_s: float | None = None
    memory_mb: int | None = None
    session_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExecRequest:
        _check_keys(cls, data)
        return cls(**data)


@dataclass(slots=True)
class ExecResult:
    """What one execution produced. User-code failures are data here, never exceptions."""

    status: ExecStatus
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    error_type: str | None = None  # e.g. "NameError" when status is ERROR
    duration_s: float = 0.0
    truncated: bool = False  # stdout or stderr was cut at the output cap

    @property
    def ok(self) -> bool:
        return self.status == ExecStatus.OK

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = str(self.status)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExecResult:
        _check_keys(cls, data)
        return cls(**{**data, "status": ExecStatus(data["status"])})


@dataclass(slots=True)
class ToolCall:
    """A parsed tool call: the function name, its arguments and the raw text it came from."""

    name: str
    arguments: dict[str, Any]
    raw: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolCall:
        _check_keys(cls, data)
        return cls(**data)


@dataclass(slots=True)
class ToolCallRecord:
    """One tool call of a trajectory: the call (or why it could not be parsed) and its result.

    A malformed call has `call=None`, a `parse_error`, and a result with status REJECTED.
    """

    call: ToolCall | None
    result: ExecResult
    parse_error: str | None = None

    @property
    def failed(self) -> bool:
        """Counts as a tool error (GRPO-RoC's p_err, tool-error ratios): a parse error or any
        status but ok, except an infrastructure fault, which is not the model's error."""
        return self.parse_error is not None or not (self.result.ok or self.infra_fault)

    @property
    def malformed(self) -> bool:
        """The call could not be parsed, or the sandbox refused it (missing code, bad JSON)."""
        return self.call is None or self.result.status == ExecStatus.REJECTED

    @property
    def infra_fault(self) -> bool:
        """The environment failed the call (sandbox unreachable, overloaded, crashed)."""
        return self.result.status == ExecStatus.SANDBOX_ERROR

    def to_dict(self) -> dict[str, Any]:
        return {
            "call": None if self.call is None else self.call.to_dict(),
            "result": self.result.to_dict(),
            "parse_error": self.parse_error,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolCallRecord:
        _check_keys(cls, data)
        call = None if data["call"] is None else ToolCall.from_dict(data["call"])
        return cls(call, ExecResult.from_dict(data["result"]), data.get("parse_error"))


@dataclass(slots=True)
class Trajectory:
    """One sampled multi-turn answer to one prompt, token-in/token-out.

    `response_ids`, `loss_mask` and `logprobs` are aligned token by token: `loss_mask[i]` is 1
    when the policy sampled `response_ids[i]` and 0 when the environment inserted it (tool
    responses, turn headers); `logprobs[i]` is the engine's logprob of a sampled token, 0.0 for
    an inserted one. `versions[i]` is the policy version (RL step) whose weights sampled token i,
    -1 for an inserted one or where the engine does not say (empty: not recorded).
    """

    prompt_id: str
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    status: RolloutStatus
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    num_turns: int = 0  # assistant turns
    final_answer: str | None = None
    reward: float | None = None
    text: str = ""  # decoded response; the reward reads the final answer from it
    versions: list[int] = field(default_factory=list)
    # its reasoning-gym task's scorer raised or hung on its answer (`reward/task.py`)
    scorer_failed: bool = False

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if self.versions and len(self.versions) != n:
            raise ValueError(
                f"Trajectory {self.prompt_id}#{self.sample_index}: {len(self.versions)} "
                f"versions for {n} response tokens"
            )
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"Trajectory {self.prompt_id}#{self.sample_index}: response_ids, loss_mask and "
                f"logprobs must have one entry per token, got {n}, {len(self.loss_mask)}, "
                f"{len(self.logprobs)}"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(
                f"Trajectory {self.prompt_id}#{self.sample_index}: loss_mask must hold 0/1 only"
            )

    @property
    def policy_versions(self) -> list[int]:
        """The recorded policy versions of the sampled tokens."""
        return [v for v, m in zip(self.versions, self.loss_mask, strict=False) if m and v >= 0]

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version among the sampled tokens (None: none recorded)."""
        return min(self.policy_versions, default=None)

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def infra_fault(self) -> bool:
        """A tool call of it failed through the environment: RL neither rewards nor penalises
        it (it is left out of the group) and tool-error statistics leave its faults out."""
        return any(record.infra_fault for record in self.tool_calls)

    @property
    def unscorable(self) -> bool:
        """Infrastructure, not the model, decided its end: the engine or server failed (status
        `error`), the sandbox failed a call, or a gym task's scorer failed on its answer.
        Evaluations leave it out of their scores, RL out of its groups."""
        return self.status == RolloutStatus.ERROR or self.infra_fault or self.scorer_failed

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["status"] = str(self.status)
        data["tool_calls"] = [record.to_dict() for record in self.tool_calls]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        _check_keys(cls, data)
        return cls(
            **{
                **data,
                "status": RolloutStatus(data["status"]),
                "tool_calls": [ToolCallRecord.from_dict(r) for r in data.get("tool_calls", [])],
            }
        )
