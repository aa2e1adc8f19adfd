"""Tool calls in the assistant's text, and tool results as the text the model reads next.

A call is the JSON object inside the turn's last `<tool_call>...</tool_call>`: `{"name": ...,
"arguments": {...}}`, naming one of the agent's tools (`tools.py`; the report's one is
`execute_python_code_with_standard_io` with `code` and an optional `input`, the program's
stdin); a JSON list of such objects, as some models write, is read as its last call. Bad JSON,
an unknown tool, a missing or mistyped argument are not exceptions: `parse_tool_call` returns
the error text, which goes back to the model as the tool response and counts as a failed call.
"""

from __future__ import annotations

import json
import re

from codeloop.rollout.tools import PYTHON_ONLY, Toolbox
from codeloop.types import ExecResult, ExecStatus, ToolCall

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(rf"{CALL_OPEN}(.*?){CALL_CLOSE}", re.DOTALL)


def in_open_call(text: str) -> bool:
    """Whether `text` ends inside a tool call: its last `<tool_call>` is not closed."""
    return text.rfind(CALL_OPEN) > text.rfind(CALL_CLOSE)


def parse_tool_call(turn_text: str, tools: Toolbox = PYTHON_ONLY) -> ToolCall | str:
    """The turn's last tool call to one of `tools`, or the error text to show the model."""
    found = _CALL.findall(turn_text)
    if not found:
        return "Error: no <tool_call>...</tool_call> block found."
    raw = found[-1].strip()
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError as err:
        where = f"line {err.lineno} column {err.colno}"
        return f"Error: the tool call is not valid JSON ({err.msg} at {where})."
    if isinstance(payload, list) and payload:  # a list of calls (some models' format): the last
        payload = payload[-1]
    return checked_call(payload, tools, raw)


def checked_call(payload: object, tools: Toolbox, raw: str) -> ToolCall | str:
    """A call's payload (`{"name": ..., "arguments": {...}}`) checked against `tools`: the
    call, or the error text to show the model."""
    if not isinstance(payload, dict):
        return 'Error: the tool call must be a JSON object with "name" and "arguments".'
    name, arguments = payload.get("name"), payload.get("arguments")
    if not isinstance(name, str) or name not in tools:
        names = ", ".join(repr(n) for n in tools)
        which = f"the only tool is {names}" if len(tools) == 1 else f"the tools are {names}"
        return f"Error: unknown tool {name!r}; {which}."
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    checked = tools[name].check(arguments if isinstance(arguments, dict) else {})
    if isinstance(checked, str):
        return checked
    return ToolCall(name=name, arguments=checked, raw=raw)


def _clip(text: str, max_chars: int) -> str:
    """Keep the head and the tail: the end of a traceback matters as much as the start."""
    if len(text) <= max_chars:
        return text
    keep = max_chars // 2
    omitted = len(text) - 2 * keep
    return f"{text[:keep]}\n... [{omitted} characters omitted] ...\n{text[-keep:]}"


def format_observation(result: ExecResult, max_chars: int) -> str:
    """What the model reads back: the output, the error, or why there is none."""
    match result.status:
        case ExecStatus.OK:
            body = result.stdout + (f"\n[stderr]\n{result.stderr}" if result.stderr.strip() else "")
            body = body if body.strip() else "[no output]"
        case ExecStatus.ERROR:
            body = (result.stdout + "\n" if result.stdout.strip() else "") + result.stderr
        case ExecStatus.TIMEOUT:
            body = f"{result.stdout}\nError: the code ran past its time limit and was stopped."
        case ExecStatus.MEMORY:
            body = f"{result.stdout}\nError: the code ran out of memory and was stopped."
        case _:
            body = f"{result.stdout}\nError ({result.status}): {result.stderr.strip()}"
    if result.truncated:
        body += "\n[output truncated]"
    return _clip(body.strip("\n"), max_chars)
