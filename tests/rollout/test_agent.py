import asyncio
import json

import pytest
from rollout_helpers import ScriptedEngine

from codeloop.config import RolloutConfig, SandboxConfig
from codeloop.reward import Verdict, Verifier
from codeloop.rollout.agent import run_trajectory
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.tools import PYTHON_TOOL
from codeloop.sandbox.pool import LocalSandbox
from codeloop.types import ExecRequest, ExecResult, ExecStatus, RolloutStatus, Trajectory

END = "<|im_end|>"


def _call(code: str) -> str:
    payload = json.dumps({"name": PYTHON_TOOL, "arguments": {"code": code}})
    return f"Let me compute it.\n<tool_call>\n{payload}\n</tool_call>"


class FakeTools:
    def __init__(self, stdout: str = "5\n"):
        self.requests: list[ExecRequest] = []
        self.stdout = stdout

    async def execute(self, request: ExecRequest) -> ExecResult:
        self.requests.append(request)
        return ExecResult(ExecStatus.OK, stdout=self.stdout)


def _run(
    fmt: PromptFormat, turns: list[str], tools: object = None, **cfg: float
) -> tuple[Trajectory, ScriptedEngine]:  # type: ignore[type-arg]
    engine = ScriptedEngine(fmt, turns)
    prompt = fmt.prompt_ids("What is 2 + 3?")
    trajectory = asyncio.run(
        run_trajectory(
            engine,
            tools or FakeTools(),
            fmt,
            RolloutConfig(**cfg),
            prompt_id="p1",
            sample_index=3,
            prompt_ids=prompt,
            seed=100,
        )
    )
    return trajectory, engine


def test_tool_call_then_answer_token_in_token_out(fmt: PromptFormat) -> None:
    turns = [_call("print(2 + 3)"), f"So it is 5.</reason>\n<answer>\\boxed{{5}}</answer>{END}"]
    tools = FakeTools()
    t, engine = _run(fmt, turns, tools)
    first, second = fmt.encode(turns[0]), fmt.encode(turns[1])
    observation = fmt.tool_response_ids("5")
    assert t.status == RolloutStatus.ANSWERED and t.num_turns == 2
    assert t.response_ids == first + observation + second
    assert t.loss_mask == [1] * len(first) + [0] * len(observation) + [1] * len(second)
    assert t.logprobs == [-0.25] * len(first) + [0.0] * len(observation) + [-0.25] * len(second)
    assert engine.prompts[1] == engine.prompts[0] + first + observation  # never re-tokenised
    assert [r.code for r in tools.requests] == ["print(2 + 3)"]
    assert t.tool_calls[0].call is not None and t.tool_calls[0].result.stdout == "5\n"
    assert "<tool_response>\n5\n</tool_response>" in t.text
    assert Verifier().score(t, "5").reason == Verdict.CORRECT


def test_a_malformed_call_is_a_failed_call_shown_to_the_model(fmt: PromptFormat) -> None:
    bad = "<tool_call>\n{oops\n</tool_call>"
    tools = FakeTools()
    t, _ = _run(fmt, [bad, f"<answer>\\boxed{{5}}</answer>{END}"], tools)
    record = t.tool_calls[0]
    assert record.failed and record.call is None and "not valid JSON" in (record.parse_error or "")
    assert record.result.status == ExecStatus.REJECTED and not tools.requests
    assert "not valid JSON" in t.text and t.status == RolloutStatus.ANSWERED


def test_a_turn_that_ends_without_an_answer(fmt: PromptFormat) -> None:
    t, _ = _run(fmt, [f"I give up.{END}"])
    assert t.status == RolloutStatus.NO_ANSWER and t.num_turns == 1 and not t.tool_calls


def test_the_turn_budget(fmt: PromptFormat) -> None:
    tools = FakeTools()
    t, engine = _run(fmt, [_call("1"), _call("2"), "never reached"], tools, max_turns=2)
    assert t.status == RolloutStatus.TRUNCATED_TURNS and t.num_turns == 2
    assert len(engine.prompts) == 2
    # The last turn's call is not run: no turn is left to read its output (as the released
    # code does)
    assert [r.code for r in tools.requests] == ["1"] and len(t.tool_calls) == 1
    assert t.text.endswith("</tool_call>")


def test_the_response_budget_counts_tool_tokens(fmt: PromptFormat) -> None:
    call = _call("print(2 + 3)")
    budget = len(fmt.encode(call)) + 3  # room for the call, not for its observation
    t, _ = _run(fmt, [call, "unused"], max_response_tokens=budget)
    assert t.status == RolloutStatus.TRUNCATED_LENGTH and len(t.response_ids) <= budget
    long_answer = "x " * 500
    t, engine = _run(fmt, [long_answer], max_response_tokens=50)
    assert t.status == RolloutStatus.TRUNCATED_LENGTH and len(t.response_ids) == 50
    assert engine.params[0].max_tokens == 50


def test_per_turn_cap_and_per_turn_seeds(fmt: PromptFormat) -> None:
    t, engine = _run(
        fmt, [_call("1"), f"<answer>\\boxed{{1}}</answer>{END}"], max_tokens_per_turn=200
    )
    assert [p.max_tokens for p in engine.params] == [200, 200]
    assert [p.seed for p in engine.params] == [100, 101]
    assert engine.params[0].stop == ["</tool_call>"]


def test_an_engine_failure_is_an_error_state(fmt: PromptFormat) -> None:
    class Broken:
        async def generate(self, prompt_ids: list[int], params: object) -> object:
            raise ConnectionError("engine down")

    prompt = fmt.prompt_ids("q")
    t = asyncio.run(
        run_trajectory(
            Broken(),
            FakeTools(),
            fmt,
            RolloutConfig(),
            prompt_id="p",
            sample_index=0,
            prompt_ids=prompt,
        )
    )  # type: ignore[arg-type]
    assert t.status == RolloutStatus.ERROR and t.response_ids == []


def test_with_the_real_sandbox(fmt: PromptFormat) -> None:
    async def main() -> Trajectory:
        async with LocalSandbox(SandboxConfig(workers=1)) as sandbox:
            engine = ScriptedEngine(
                fmt, [_call("x = 6 * 7\nx"), f"<answer>\\boxed{{42}}</answer>{END}"]
            )
            return await run_trajectory(
                engine,
                sandbox,
                fmt,
                RolloutConfig(),
                prompt_id="p",
                sample_index=0,
                prompt_ids=fmt.prompt_ids("6 * 7?"),
            )

    t = asyncio.run(main())
    assert t.tool_calls[0].result.stdout == "42\n" and not t.tool_calls[0].failed
    assert t.status == RolloutStatus.ANSWERED


@pytest.mark.parametrize(
    ("last_turn", "status"),
    [
        (f"<answer>\\boxed{{5}}</answer>{END}", RolloutStatus.ANSWERED),
        ("<answer>5</answer>", RolloutStatus.ANSWERED),  # no end token, no call: it ended
        (f"<answer>\\boxed{{5}}{END}", RolloutStatus.NO_ANSWER),  # never closed
        (f"</answer> then <answer>5{END}", RolloutStatus.NO_ANSWER),  # closed before it opened
        (f"<answer>4</answer> no, <answer>5{END}", RolloutStatus.NO_ANSWER),  # the last is open
        (f"The answer is \\boxed{{5}}.{END}", RolloutStatus.NO_ANSWER),  # no answer tags
    ],
)
def test_what_counts_as_an_answer(fmt: PromptFormat, last_turn: str, status: RolloutStatus) -> None:
    t, _ = _run(fmt, [_call("print(5)"), last_turn])
    assert t.status == status and t.num_turns == 2


def test_each_turn_may_sample_only_what_is_left_of_the_response_budget(
    fmt: PromptFormat,
) -> None:
    turns = [_call("print(1)"), _call("print(2)"), f"<answer>\\boxed{{2}}</answer>{END}"]
    observation = len(fmt.tool_response_ids("5"))
    first, second = len(fmt.encode(turns[0])), len(fmt.encode(turns[1]))
    budget = first + second + 2 * observation + 30  # 30 tokens left for the third turn
    t, engine = _run(fmt, turns, max_response_tokens=budget, max_tokens_per_turn=first + 40)
    assert [p.max_tokens for p in engine.params] == [first + 40, first + 40, 30]
    assert t.status == RolloutStatus.ANSWERED


def test_the_configured_temperature_and_top_p_reach_the_engine(fmt: PromptFormat) -> None:
    _, engine = _run(fmt, [f"<answer>1</answer>{END}"], temperature=0.3, top_p=0.7)  # type: ignore[arg-type]
    assert (engine.params[0].temperature, engine.params[0].top_p) == (0.3, 0.7)


def test_an_observation_that_fills_the_budget_is_not_inserted(fmt: PromptFormat) -> None:
    call = _call("print(2 + 3)")
    used = len(fmt.encode(call)) + len(fmt.tool_response_ids("5"))
    t, engine = _run(fmt, [call, "unused"], max_response_tokens=used)  # no token left after it
    assert t.status == RolloutStatus.TRUNCATED_LENGTH and len(engine.params) == 1
    assert t.response_ids == fmt.encode(call)
    # one token left: the next turn may sample exactly that one
    t, engine = _run(fmt, [call, "5"], max_response_tokens=used + 1)
    assert [p.max_tokens for p in engine.params] == [used + 1, 1]
    assert len(t.response_ids) == used + 1


def test_a_turn_that_ends_is_final_even_with_a_call_in_it(fmt: PromptFormat) -> None:
    tools = FakeTools()
    t, engine = _run(fmt, [f"{_call('print(5)')}<answer>5</answer>{END}", "unused"], tools)
    assert t.status == RolloutStatus.ANSWERED and t.num_turns == 1 and len(engine.params) == 1
    assert tools.requests == [] and t.tool_calls == []
