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
    schema: dict[str, Any] = {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }

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


ADDER = '''
from codeloop.types import ExecResult, ExecStatus


class Adder:
    """Adds two integers (a tool of a user's own, named in rollout.tools)."""

    name = "add"
    schema = {"type": "function", "function": {"name": "add", "description": "a + b",
              "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                               "b": {"type": "integer"}}}}}

    def __init__(self, executor):
        self.executor = executor

    def check(self, arguments):
        return arguments

    async def run(self, arguments):
        return ExecResult(ExecStatus.OK, stdout=str(arguments["a"] + arguments["b"]))
'''


def test_a_policy_trained_with_two_tools_is_evaluated_with_them_without_its_config(
    fmt: PromptFormat, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from codeloop.cli import main
    from codeloop.engine.model import tiny_model

    (tmp_path / "my_adder_tool.py").write_text(ADDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    base, problems, config = tmp_path / "base", tmp_path / "train.jsonl", tmp_path / "two.toml"
    tiny_model(len(fmt.tokenizer), hidden_size=32, layers=1).save_pretrained(base)
    fmt.tokenizer.save_pretrained(base)
    rows = [{"id": f"q{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(2)]
    problems.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config.write_text(
        '[rollout]\ntools = ["python", "my_adder_tool:Adder"]\nmax_response_tokens = 16\n'
    )
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--config",
                str(config),
                "--trainer.model",
                str(base),
                "--data.train",
                str(problems),
                "--trainer.output_dir",
                str(run),
                "--trainer.max_steps",
                "1",
                "--trainer.prompts_per_step",
                "2",
                "--algo.group_size",
                "2",
                "--sandbox.workers",
                "1",
                "--reward.workers",
                "1",
                "--algo.drop_zero_signal_groups",
                "false",
            ]
        )
        == 0
    )
    policy = run / "checkpoints" / "step_000001" / "model"
    saved = json.loads((policy / "codeloop.json").read_text())
    assert saved["rollout"]["tools"] == ["python", "my_adder_tool:Adder"]
    names = [t["function"]["name"] for t in saved["trajectory"]["tools"]]
    assert names == [PYTHON_TOOL, "add"]  # what RL's prompts listed
    out = tmp_path / "eval"
    assert (
        main(
            [
                "eval",
                "--model",
                str(policy),
                "--data",
                str(problems),
                "--k",
                "1",
                "--sandbox.workers",
                "1",
                "--eval.max_response_tokens",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    evaluated = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    both = PromptFormat(fmt.tokenizer, tools=[PYTHON_SCHEMA, saved["trajectory"]["tools"][1]])
    by_id = {t["prompt_id"]: t["prompt_ids"] for t in evaluated}
    assert by_id == {row["id"]: both.prompt_ids(row["problem"]) for row in rows}
    # the agent that ran them had both tools (it refuses a prompt listing others), built as
    # the saved settings say
    cfg = RolloutConfig(tools=saved["rollout"]["tools"])
    assert sorted(Agent(ScriptedEngine(both, []), NoSandbox(), both, cfg).tools) == sorted(names)


def test_a_tool_that_cannot_be_made_is_named_with_what_is_wrong() -> None:
    from codeloop.config import ConfigError
    from codeloop.rollout.tools import tool_class

    for name, message in [
        ("calculator", "'calculator' is neither python nor module:Name"),
        ("no_such_module_x:Tool", "'no_such_module_x:Tool': cannot import no_such_module_x"),
        ("json:NoTool", "'json:NoTool': json has no NoTool"),
        ("json:dumps", "'json:dumps' is not a Tool class (it lacks name, schema, check, run)"),
    ]:
        with pytest.raises(ConfigError) as refused:
            tool_class(name)
        assert str(refused.value).startswith(f"rollout.tools: {message}")
