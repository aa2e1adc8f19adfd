"""Tools as values: a second tool, defined here, next to the Python one, through `collect`."""

import asyncio
import json
from typing import Any

import pytest
from rollout_helpers import ScriptedEngine

from codeloop.config import RolloutConfig
from codeloop.data.problems import Problem
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent, collect
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.toolcall import parse_tool_call
from codeloop.rollout.tools import PYTHON_SCHEMA, PYTHON_TOOL, PythonTool, toolbox
from codeloop.types import ExecRequest, ExecResult, ExecStatus, RolloutStatus

END = "<|im_end|>"


class Calculator:
    """Adds two integers; an argument that is not one is the model's error."""

    name = "add"
    schema: dict[str, Any] = {"type": "function", "function": {
        "name": "add", "description": "a + b",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                         "b": {"type": "integer"}}}}}  # fmt: skip

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def check(self, arguments: dict[str, Any]) -> dict[str, Any] | str:
        if not all(isinstance(arguments.get(k), int) for k in ("a", "b")):
            return 'Error: "a" and "b" must be integers.'
        return arguments

    async def run(self, arguments: dict[str, Any]) -> ExecResult:
        self.calls.append(arguments)
        return ExecResult(ExecStatus.OK, stdout=f"{arguments['a'] + arguments['b']}\n")


class NoSandbox:
    async def execute(self, request: ExecRequest) -> ExecResult:
        raise AssertionError("the Python tool was not called")


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_a_second_tool_runs_through_collect_and_the_prompt_lists_it(fmt: PromptFormat) -> None:
    calculator = Calculator()
    both = PromptFormat(fmt.tokenizer, tools=[PYTHON_SCHEMA, calculator.schema])
    turns = [
        _call("add", a=2, b=3),
        _call("add", a="x", b=1),
        f"<answer>\\boxed{{5}}</answer>{END}",
    ]
    engine = ScriptedEngine(both, turns)
    agent = Agent(engine, [PythonTool(NoSandbox()), calculator], both, RolloutConfig())
    with Verifier() as verifier:
        [[trajectory]] = asyncio.run(collect(agent, [Problem("p", "2 + 3?", "5")], 1, verifier))
    prompt = both.tokenizer.decode(engine.prompts[0])
    assert '"name": "add"' in prompt and f'"name": "{PYTHON_TOOL}"' in prompt
    assert calculator.calls == [{"a": 2, "b": 3}]  # the bad call never ran
    first, second = trajectory.tool_calls
    assert first.call is not None and first.call.name == "add" and first.result.stdout == "5\n"
    assert second.call is None and second.parse_error == 'Error: "a" and "b" must be integers.'
    assert "<tool_response>\n5\n</tool_response>" in trajectory.text
    assert trajectory.status == RolloutStatus.ANSWERED and trajectory.reward == 1.0


def test_an_unknown_tool_names_the_tools_there_are() -> None:
    tools = toolbox([PythonTool(None), Calculator()])
    message = parse_tool_call(_call("search", q="x"), tools)
    assert message == f"Error: unknown tool 'search'; the tools are '{PYTHON_TOOL}', 'add'."
    assert parse_tool_call(_call("add", a=1, b=2), tools).arguments == {"a": 1, "b": 2}  # type: ignore[union-attr]


def test_the_agent_refuses_a_prompt_that_lists_other_tools(fmt: PromptFormat) -> None:
    with pytest.raises(ValueError, match="the prompt lists the tools"):
        Agent(ScriptedEngine(fmt, []), [PythonTool(None), Calculator()], fmt, RolloutConfig())
    with pytest.raises(ValueError, match="two tools share a name"):
        toolbox([Calculator(), Calculator()])
