"""Tools as values: what the model may call, how a call's arguments are checked, how it runs.

A `Tool` has a `name`, the `schema` the prompt lists (an OpenAI-style function description),
`check(arguments)` (the arguments to run with, or the error text the model reads instead), and
`run(arguments)`, which returns the call's `ExecResult` (its status and the text the model reads
next, `toolcall.format_observation`). The agent holds a mapping of tools by name
(`toolbox`); the tool call in a turn names one of them (`toolcall.parse_tool_call`).

`PythonTool` is the report's tool: the code and its standard input go to a `ToolExecutor` (the
sandbox in this process, or `SandboxClient` over sandbox servers). A second tool is any object
with the same four members, e.g. a calculator or a call to a verifier service; see
`tests/rollout/test_tools.py`. `rollout.tools` names the tools of a run (`python`, or
`module:Name` for a class of one's own: `tool_class`); the prompt lists their schemas and a
saved policy keeps the names, so `codeloop eval --model` runs and lists the same tools.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from codeloop.config import ConfigError
from codeloop.types import ExecRequest, ExecResult


class ToolExecutor(Protocol):
    """What runs tool calls: `SandboxClient`, or a `WorkerPool` in the same process."""

    async def execute(self, request: ExecRequest) -> ExecResult: ...


PYTHON_TOOL = "execute_python_code_with_standard_io"
PYTHON_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": PYTHON_TOOL,
        "description": (
            "Run Python code with `input` as its standard input and return what it prints, or "
            "its error. If the last statement is a bare expression, its value is printed."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The Python code to run."},
                "input": {"type": "string", "description": "Standard input for the code."},
            },
            "required": ["code"],
        },
    },
}


@runtime_checkable
class Tool(Protocol):
    name: str
    schema: dict[str, Any]

    def check(self, arguments: dict[str, Any]) -> dict[str, Any] | str:
        """The arguments to run with, or the error text the model reads instead."""
        ...

    async def run(self, arguments: dict[str, Any]) -> ExecResult:
        """Run one checked call; the result's status and output are what the model reads."""
        ...


def python_arguments(arguments: dict[str, Any]) -> dict[str, Any] | str:
    """The Python tool's arguments (`code`, optional `input`), or what is wrong with them."""
    if not isinstance(arguments.get("code"), str):
        return 'Error: missing argument "code" (a string).'
    if not isinstance(arguments.get("input", ""), str):
        return 'Error: argument "input" must be a string.'
    return arguments


class PythonTool:
    """Run Python code in the sandbox (the report's one tool)."""

    name = PYTHON_TOOL
    schema = PYTHON_SCHEMA

    def __init__(self, executor: ToolExecutor | None) -> None:
        self.executor = executor

    def check(self, arguments: dict[str, Any]) -> dict[str, Any] | str:
        return python_arguments(arguments)

    async def run(self, arguments: dict[str, Any]) -> ExecResult:
        if self.executor is None:
            raise RuntimeError("PythonTool: no executor to run code with")
        request = ExecRequest(code=arguments["code"], stdin=arguments.get("input", ""))
        return await self.executor.execute(request)


Toolbox = Mapping[str, Tool]
PYTHON_ONLY: Toolbox = {PYTHON_TOOL: PythonTool(None)}  # for checking calls, not running them


def toolbox(
    tools: ToolExecutor | Toolbox | Sequence[Tool], names: Sequence[str] = ("python",)
) -> dict[str, Tool]:
    """The tools by name: a `ToolExecutor` makes the tools `names` (`rollout.tools`, see
    `tool_class`) over it; tools given as a sequence or a mapping are taken as they are."""
    if isinstance(tools, Mapping):
        return dict(tools)
    if not isinstance(tools, Sequence):
        tools = [tool_class(name)(tools) for name in names]
    by_name = {tool.name: tool for tool in tools}
    if len(by_name) != len(tools):
        raise ValueError(f"two tools share a name: {[t.name for t in tools]}")
    return by_name


def tool_class(name: str) -> Any:
    """What makes the tool `name` of `rollout.tools` from a `ToolExecutor`: `python` is
    `PythonTool`; `module:Name` is that attribute of an importable module (a class whose
    instances are `Tool`s, with its `schema` and `name` on the class). A `ConfigError` names
    what is wrong."""
    if name == "python":
        return PythonTool
    module, _, attribute = name.partition(":")
    if not module or not attribute:
        raise ConfigError(f"rollout.tools: {name!r} is neither python nor module:Name")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except ImportError as err:
        raise ConfigError(f"rollout.tools: {name!r}: cannot import {module} ({err})") from None
    except AttributeError:
        raise ConfigError(f"rollout.tools: {name!r}: {module} has no {attribute}") from None
    missing = [m for m in ("name", "schema", "check", "run") if not hasattr(found, m)]
    if missing or not callable(found):
        raise ConfigError(
            f"rollout.tools: {name!r} is not a Tool class (it lacks "
            f"{', '.join(missing) or 'a constructor'})"
        )
    return found


def tool_schemas(names: Sequence[str]) -> list[dict[str, Any]]:
    """The schemas the prompt lists for the tools `names` (`rollout.tools`)."""
    return [tool_class(name).schema for name in names]
