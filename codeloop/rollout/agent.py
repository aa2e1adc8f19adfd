"""The multi-turn agent loop: think, call the tool, read the result, ..., answer.

One trajectory, token in and token out: each turn the engine continues prompt + response so
far and stops at `</tool_call>` or the end of the turn; a tool call is parsed, run by the tool
it names (`tools.py`), and its observation inserted as tokens with loss mask 0 (logprob 0.0);
sampled tokens have loss mask 1 and the engine's logprob. Budgets: `max_turns` assistant turns,
`max_response_tokens` for sampled and inserted tokens together, `max_tokens_per_turn`. End
states: `answered` (the turn ended and holds a closed `<answer>`), `no_answer` (it ended
without), `truncated_length` (a token budget ran out, an observation would not fit, or the
context grew past what the engine's server takes: `ContextExceeded`), `truncated_turns` (the
turn budget ran out before an answer; a tool call in the last turn is not run, since no turn is
left to read its output), `done` (an environment said its episode was over after a tool call:
`done`, its answer inserted), `error` (the engine failed).

`rollout.action_parser` replaces the JSON tool call: a function of the turn's text that returns
the call (or an error for the model, or None: no action, and the turn ends the trajectory). A
turn that ended with its end-of-turn token and acted is followed by the tool's turn without a
second end-of-turn (`PromptFormat.tool_response_ids(after_end=True)`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from codeloop.config import RolloutConfig
from codeloop.engine.protocol import ContextExceeded, Engine, SamplingParams
from codeloop.rollout.environment import parsed_action
from codeloop.rollout.prompt import STOP_STRINGS, PromptFormat
from codeloop.rollout.toolcall import CALL_CLOSE, format_observation, parse_tool_call
from codeloop.rollout.tools import Tool, Toolbox, ToolExecutor, toolbox
from codeloop.types import (
    ExecResult,
    ExecStatus,
    RolloutStatus,
    ToolCall,
    ToolCallRecord,
    Trajectory,
)

log = logging.getLogger(__name__)


@dataclass
class _Response:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add(
        self, ids: list[int], logprobs: list[float] | None, versions: list[int] | None = None
    ) -> None:
        self.ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [-1] * len(ids)


async def run_trajectory(
    engine: Engine,
    tools: ToolExecutor | Toolbox | Sequence[Tool],
    fmt: PromptFormat,
    cfg: RolloutConfig,
    *,
    prompt_id: str,
    sample_index: int,
    prompt_ids: list[int],
    seed: int | None = None,
    done: Callable[[], bool] | None = None,
) -> Trajectory:
    """Roll out one trajectory to an end state (see the module docstring). `tools`: the tools
    by name, or a sequence of them, or a `ToolExecutor` (the Python tool over it); `done`,
    asked after each tool call, ends the trajectory when true (an environment's episode)."""
    tools = toolbox(tools)
    response, records, turns = _Response(), list[ToolCallRecord](), 0
    status = RolloutStatus.TRUNCATED_TURNS
    while turns < cfg.max_turns:
        budget = cfg.max_response_tokens - len(response.ids)
        if budget <= 0:
            status = RolloutStatus.TRUNCATED_LENGTH
            break
        max_tokens = min(budget, cfg.max_tokens_per_turn or budget)
        params = SamplingParams(
            max_tokens,
            cfg.temperature,
            cfg.top_p,
            STOP_STRINGS,
            None if seed is None else seed + turns,
        )
        try:
            generation = await engine.generate(prompt_ids + response.ids, params)
        except ContextExceeded:
            status = RolloutStatus.TRUNCATED_LENGTH
            break
        except Exception as err:
            _engine_failed(f"{prompt_id}#{sample_index}", err)
            status = RolloutStatus.ERROR
            break
        turns += 1
        response.add(generation.token_ids, generation.logprobs, generation.versions)
        turn_text = fmt.tokenizer.decode(generation.token_ids)
        if generation.finish_reason == "length":
            status = RolloutStatus.TRUNCATED_LENGTH
            break
        ended = bool(generation.token_ids) and generation.token_ids[-1] in fmt.end_of_turn_ids
        call: ToolCall | str | None = None
        if cfg.action_parser:  # the user's parser reads the action, if any, in the turn
            call = parsed_action(cfg.action_parser, turn_text, tools)
            acts = call is not None
        else:
            acts = not ended and CALL_CLOSE in turn_text
        if not acts:  # the turn ended: final answer or not
            status = RolloutStatus.ANSWERED if _has_answer(turn_text) else RolloutStatus.NO_ANSWER
            break
        if turns == cfg.max_turns:  # no turn left to read its output: the call is not run
            break
        record = await _call_tool(tools, turn_text, f"{prompt_id}#{sample_index}", call)
        records.append(record)
        observation = fmt.tool_response_ids(
            format_observation(record.result, cfg.max_tool_response_chars), after_end=ended
        )
        if len(response.ids) + len(observation) >= cfg.max_response_tokens:
            status = RolloutStatus.TRUNCATED_LENGTH
            break
        response.add(observation, None)
        if done is not None and done():
            status = RolloutStatus.DONE
            break
    text = fmt.tokenizer.decode(response.ids)
    return Trajectory(
        prompt_id,
        sample_index,
        list(prompt_ids),
        response.ids,
        response.mask,
        response.logprobs,
        status,
        records,
        turns,
        text=text,
        versions=response.versions,
    )


_failures = 0


def _engine_failed(who: str, err: Exception) -> None:
    """The first engine failure of a process is a warning line (a dead server fails every
    trajectory after it: one line, not hundreds); each one's traceback is logged at debug
    level. The trajectory's `error` status carries it to the run's counts."""
    global _failures
    _failures += 1
    if _failures == 1:
        log.warning(
            "engine failed on %s: %s: %s (later failures are counted in the statuses, not logged)",
            who,
            type(err).__name__,
            err,
        )
    log.debug("engine failed on %s", who, exc_info=err)


def _has_answer(turn_text: str) -> bool:
    start = turn_text.rfind("<answer>")
    return start >= 0 and turn_text.find("</answer>", start) >= 0


async def _call_tool(
    tools: Toolbox, turn_text: str, who: str, parsed: ToolCall | str | None = None
) -> ToolCallRecord:
    """Run the turn's call (`parsed`, else the JSON tool call in its text)."""
    call = parse_tool_call(turn_text, tools) if parsed is None else parsed
    if isinstance(call, str):
        return ToolCallRecord(None, ExecResult(status=ExecStatus.REJECTED, stderr=call), call)
    try:
        result = await tools[call.name].run(call.arguments)
    except Exception as err:  # a tool should not raise; a trajectory must not die of it
        log.exception("tool %s failed for %s", call.name, who)
        failed = f"tool {call.name} failed: {err}"
        result = ExecResult(status=ExecStatus.SANDBOX_ERROR, stderr=failed)
    return ToolCallRecord(call, result)
