"""Trajectory statistics, computed one way for RL's logs, the recipes' evaluations and
`codeloop eval`.

A trajectory is first reduced to its `sample` record (JSON: what `codeloop eval` keeps of each
sample in `results.jsonl`, so that a resumed evaluation summarises the lines it reads back as it
would the trajectories); `stats` gives the means and shares over any set of records:
- `reward` (the mean reward), `response_tokens` (sampled and tool
  tokens), `policy_tokens` (the model's own), `turns`, `tool_calls` per trajectory;
- `tool_error_ratio`: the share of calls that failed through the model (`ToolCallRecord.failed`:
  infrastructure faults are not its errors), `tool_error_ratio_correct` among right answers
  (GRPO-RoC's measure);
- `tool_use` (trajectories with a call), `cut_off_in_call` (trajectories that ran out of tokens
  inside a call they had opened: the call never ran), `malformed_calls` (of calls),
  `infra_faults` (trajectories a sandbox fault touched), `status_<s>` for every end state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from codeloop.rollout.toolcall import in_open_call
from codeloop.types import RolloutStatus, Trajectory


def cut_off_in_call(trajectory: Trajectory) -> bool:
    """It ran out of tokens inside a tool call it had opened (a cell repeating itself up to the
    length limit): the call never ran."""
    return trajectory.status == RolloutStatus.TRUNCATED_LENGTH and in_open_call(trajectory.text)


def sample(trajectory: Trajectory) -> dict[str, Any]:
    """What the statistics need of one scored trajectory."""
    calls = trajectory.tool_calls
    return {
        "reward": trajectory.reward or 0.0,
        "status": str(trajectory.status),
        "response_tokens": len(trajectory.response_ids),
        "policy_tokens": trajectory.num_policy_tokens,
        "turns": trajectory.num_turns,
        "calls": len(calls),
        "tool_errors": sum(r.failed for r in calls),
        "malformed_calls": sum(r.malformed for r in calls),
        "infra_fault": trajectory.infra_fault,
        "cut_off_in_call": cut_off_in_call(trajectory),
    }


def stats(samples: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Means and shares over `sample` records (the module docstring); 0 where there are none."""
    n = max(len(samples), 1)
    calls = sum(s["calls"] for s in samples)
    correct = [s for s in samples if s["reward"] == 1.0]
    correct_calls = sum(s["calls"] for s in correct)

    def mean(key: str) -> float:
        return sum(float(s[key]) for s in samples) / n

    result = {
        "reward": mean("reward"),
        "response_tokens": mean("response_tokens"),
        "policy_tokens": mean("policy_tokens"),
        "turns": mean("turns"),
        "tool_calls": calls / n,
        "tool_error_ratio": sum(s["tool_errors"] for s in samples) / calls if calls else 0.0,
        "tool_error_ratio_correct": (
            sum(s["tool_errors"] for s in correct) / correct_calls if correct_calls else 0.0
        ),
        "tool_use": sum(s["calls"] > 0 for s in samples) / n,
        "cut_off_in_call": mean("cut_off_in_call"),
        "malformed_calls": sum(s["malformed_calls"] for s in samples) / calls if calls else 0.0,
        "infra_faults": mean("infra_fault"),
    }
    for status in RolloutStatus:  # every status, so that RL's ranks average the same keys
        result[f"status_{status}"] = sum(s["status"] == str(status) for s in samples) / n
    return result


def trajectory_stats(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """`stats` of scored trajectories."""
    return stats([sample(t) for t in trajectories])
