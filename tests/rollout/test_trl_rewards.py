"""Reward functions in TRL's signature (`rollout.reward_functions`): called once a trajectory
with lists of one, summed with the environment's get_reward as TRL sums them."""

import asyncio
import json
import sys
from typing import Any

import pytest
from rollout_helpers import ScriptedEngine

from codeloop.config import ConfigError, RolloutConfig
from codeloop.data.problems import Problem
from codeloop.errors import RunError
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent, collect
from codeloop.rollout.environment import environment_schemas, imported_function
from codeloop.rollout.prompt import PromptFormat

GUESS = "codeloop.environments.guess_number:GuessNumber"
HERE = "test_trl_rewards"
CALLS: list[dict[str, Any]] = []


# the shapes of TRL's documentation: keyword lists in, a list of rewards out
def fewer_guesses(environments: list[Any], **kwargs: Any) -> list[float]:
    CALLS.append({"environments": environments, **kwargs})
    return [0.1 * env.left for env in environments]


def bonus_for_red(completions: list[str], colour: list[str], **kwargs: Any) -> list[float | None]:
    return [0.5 if c == "red" else None for c in colour]


async def length_penalty(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    return [-0.001 * len(ids) for ids in completion_ids]


def two_rewards(**kwargs: Any) -> list[float]:
    return [1.0, 2.0]


def a_word(**kwargs: Any) -> list[Any]:
    return ["high"]


def _call(number: int) -> str:
    body = json.dumps({"name": "guess", "arguments": {"number": number}})
    return f"<tool_call>\n{body}\n</tool_call>"


def _run(
    fmt: PromptFormat,
    functions: list[str],
    turns: list[str],
    weights: list[float] | None = None,
    **row: Any,
) -> list[Any]:
    rollout = RolloutConfig(
        tools=[],
        environment=GUESS,
        reward_functions=functions,
        reward_weights=weights or [],
        max_response_tokens=4000,
    )
    with_env = PromptFormat(fmt.tokenizer, tools=environment_schemas(GUESS))
    agent = Agent(ScriptedEngine(with_env, turns), [], with_env, rollout)
    game = {"id": "g", "prompt": "Play.", "secret": 6, "high": 8, "guesses": 3, **row}
    problem = Problem("g", "Play.", "", row=game)
    with Verifier() as verifier:
        [group] = asyncio.run(collect(agent, [problem], 1, verifier, concurrency=1))
    return group


@pytest.fixture(autouse=True)
def _importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, HERE, sys.modules[__name__])
    imported_function.cache_clear()
    CALLS.clear()


def test_trls_functions_see_the_environment_and_the_row_and_add_to_get_reward(
    fmt: PromptFormat,
) -> None:
    functions = [f"{HERE}:fewer_guesses", f"{HERE}:bonus_for_red", f"{HERE}:length_penalty"]
    [trajectory] = _run(fmt, functions, [_call(4), _call(6)], colour="red")
    # a win (get_reward 1.0) with one guess left (0.1), red (0.5), a length penalty
    penalty = -0.001 * len(trajectory.response_ids)
    assert trajectory.reward == pytest.approx(1.0 + 0.1 + 0.5 + penalty)
    [call] = CALLS
    [instance] = call["environments"]
    assert instance.won and instance.left == 1  # the trajectory's own game, after its turns
    assert call["colour"] == ["red"] and call["secret"] == [6] and "prompt" not in call
    assert call["prompts"] == ["Play." + instance.reset(6)] and call["trainer_state"] is None
    assert call["completions"] == [trajectory.text]
    assert call["completion_ids"] == [trajectory.response_ids]


def test_reward_weights_weigh_each_function_and_get_reward_weighs_one(fmt: PromptFormat) -> None:
    functions = [f"{HERE}:fewer_guesses", f"{HERE}:bonus_for_red"]
    [trajectory] = _run(fmt, functions, [_call(4), _call(6)], [10.0, -2.0], colour="red")
    # a win (get_reward 1.0, weight 1), one guess left (0.1 x 10), red (0.5 x -2)
    assert trajectory.reward == pytest.approx(1.0 + 1.0 - 1.0)
    with pytest.raises(ConfigError, match=r"^rollout.reward_weights: 1 weights for 2 reward"):
        _run(fmt, functions, [], [1.0])  # refused before anything is sampled


def test_a_function_that_does_not_apply_adds_nothing(fmt: PromptFormat) -> None:
    # not red: bonus_for_red returns [None]; a loss: get_reward 0.0, no guesses left
    [trajectory] = _run(fmt, [f"{HERE}:bonus_for_red"], [_call(1), _call(2), _call(3)], colour="b")
    assert trajectory.reward == 0.0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module_q:f", "rollout.reward_functions: 'no_such_module_q:f': cannot import"),
        (f"{HERE}:missing", f"{HERE} has no missing"),
        (f"{HERE}:GUESS", "GUESS is not a function"),
        ("nothing", "'nothing' is not module:function"),
    ],
)
def test_a_bad_name_is_one_line_before_any_sampling(
    fmt: PromptFormat, name: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        _run(fmt, [name], [])  # no turn scripted: nothing was sampled
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("two_rewards", r"returned \[1.0, 2.0\]; expected a list of one reward"),
        ("a_word", r"returned \['high'\]; expected a finite number"),
    ],
)
def test_a_wrong_return_is_one_line_naming_the_function(
    fmt: PromptFormat, function: str, message: str
) -> None:
    with pytest.raises(RunError, match=f"reward function {HERE}:{function} {message}"):
        _run(fmt, [f"{HERE}:{function}"], [_call(6)])
