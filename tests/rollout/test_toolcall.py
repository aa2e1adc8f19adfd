import pytest

from codeloop.rollout.toolcall import format_observation, in_open_call, parse_tool_call
from codeloop.rollout.tools import PYTHON_TOOL
from codeloop.types import ExecResult, ExecStatus, ToolCall


def _call(body: str) -> str:
    return f"Let me compute.\n<tool_call>\n{body}\n</tool_call>"


def test_a_well_formed_call() -> None:
    body = f'{{"name": "{PYTHON_TOOL}", "arguments": {{"code": "print(2)", "input": "5"}}}}'
    call = parse_tool_call(_call(body))
    assert call == ToolCall(PYTHON_TOOL, {"code": "print(2)", "input": "5"}, body)


def test_the_last_call_of_the_turn_counts_and_string_arguments_are_accepted() -> None:
    first = f'{{"name": "{PYTHON_TOOL}", "arguments": {{"code": "1"}}}}'
    last = f'{{"name": "{PYTHON_TOOL}", "arguments": "{{\\"code\\": \\"2\\"}}"}}'
    call = parse_tool_call(_call(first) + _call(last))
    assert isinstance(call, ToolCall) and call.arguments == {"code": "2"}


def test_a_list_of_calls_is_read_as_its_last_call() -> None:
    first = f'{{"name": "{PYTHON_TOOL}", "arguments": {{"code": "1"}}}}'
    last = f'{{"name": "{PYTHON_TOOL}", "arguments": {{"code": "2"}}}}'
    call = parse_tool_call(_call(f"[{first}, {last}]"))
    assert isinstance(call, ToolCall) and call.arguments == {"code": "2"}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("no call here", "no <tool_call>"),
        (_call("{not json"), "not valid JSON"),
        (_call("[1, 2]"), "must be a JSON object"),
        (_call('{"name": "bash", "arguments": {"code": "ls"}}'), "unknown tool 'bash'"),
        (_call(f'{{"name": "{PYTHON_TOOL}", "arguments": {{}}}}'), 'missing argument "code"'),
        (
            _call(f'{{"name": "{PYTHON_TOOL}", "arguments": {{"code": 5}}}}'),
            'missing argument "code"',
        ),
        (_call(f'{{"name": "{PYTHON_TOOL}", "arguments": 5}}'), 'missing argument "code"'),
        (_call(f'{{"name": "{PYTHON_TOOL}"}}'), 'missing argument "code"'),  # no arguments
        (
            _call(f'{{"name": "{PYTHON_TOOL}", "arguments": {{"code": "1", "input": 3}}}}'),
            '"input" must be a string',
        ),
    ],
)
def test_malformed_calls_are_error_texts(text: str, error: str) -> None:
    result = parse_tool_call(text)
    assert isinstance(result, str) and error in result


@pytest.mark.parametrize(
    ("result", "shown"),
    [
        (ExecResult(ExecStatus.OK, stdout="42\n"), "42"),
        (ExecResult(ExecStatus.OK), "[no output]"),
        (ExecResult(ExecStatus.OK, stdout="1\n", stderr="warn\n"), "1\n\n[stderr]\nwarn"),
        (
            ExecResult(ExecStatus.ERROR, stderr="ZeroDivisionError: division by zero"),
            "ZeroDivisionError: division by zero",
        ),
        (
            ExecResult(ExecStatus.TIMEOUT, stdout="partial"),
            "partial\nError: the code ran past its time limit and was stopped.",
        ),
        (ExecResult(ExecStatus.MEMORY), "Error: the code ran out of memory and was stopped."),
        (
            ExecResult(ExecStatus.REJECTED, stderr="code too long"),
            "Error (rejected): code too long",
        ),
        (
            ExecResult(ExecStatus.OK, stdout="x" * 10, truncated=True),
            "xxxxxxxxxx\n[output truncated]",
        ),
    ],
)
def test_observations(result: ExecResult, shown: str) -> None:
    assert format_observation(result, 1000) == shown


def test_long_output_keeps_head_and_tail() -> None:
    text = "".join(f"line {i}\n" for i in range(1000))
    shown = format_observation(ExecResult(ExecStatus.OK, stdout=text), 200)
    assert shown.startswith("line 0\nline 1\n") and shown.endswith("line 998\nline 999")
    assert "characters omitted" in shown and len(shown) < 260


@pytest.mark.parametrize(
    ("text", "open_call"),
    [
        ('<reason>r</reason>\n<tool_call>\n{"name": "x", "arguments": {"code": "1', True),
        ("<tool_call>{}</tool_call>\n<tool_call>{", True),  # the second call is still open
        ("<tool_call>{}</tool_call>", False),
        ("<tool_call>{}</tool_call> then <answer>1</answer>", False),
        ("no call at all", False),
    ],
)
def test_in_open_call(text: str, open_call: bool) -> None:
    assert in_open_call(text) is open_call
