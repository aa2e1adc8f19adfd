"""Environments served by OpenEnv (`rollout.environment = "http://..."`): a WebSocket session
a trajectory on a real OpenEnv server started on 127.0.0.1, its action the `step` tool, its
observations the answers, its rewards final or summed, a one-session server queued, a server
that dies a counted fault. And OpenEnv classes constructed in-process (`module:Name`): the same
tool, answers and rewards without a server."""

import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from rollout_helpers import ScriptedEngine

from codeloop.algo.group import make_group
from codeloop.config import AlgoConfig, ConfigError, RolloutConfig
from codeloop.data.problems import Problem
from codeloop.engine.protocol import Generation, SamplingParams
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent, collect
from codeloop.rollout.environment import environment_schemas, load_environment
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.score import score
from codeloop.types import ExecStatus, RolloutStatus

pytest.importorskip("openenv")

GUESS = [sys.executable, "-m", "codeloop.environments.guess_number_openenv"]
COUNTER = [sys.executable, str(Path(__file__).with_name("openenv_counter.py"))]


def _step(**action: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'step', 'arguments': action})}\n</tool_call>"


def _agent(
    fmt: PromptFormat, engine_turns: list[str], url: str, reward: str = "final"
) -> tuple[Agent, ScriptedEngine]:
    load_environment.cache_clear()  # a fresh gate for each server
    rollout = RolloutConfig(
        tools=[], environment=url, environment_reward=reward, max_response_tokens=4000
    )
    with_env = PromptFormat(fmt.tokenizer, tools=environment_schemas(url))
    engine = ScriptedEngine(with_env, engine_turns)
    return Agent(engine, [], with_env, rollout), engine


def _collect(agent: Agent, problems: list[Problem], k: int, concurrency: int) -> list[list[Any]]:
    with Verifier() as verifier:
        return asyncio.run(collect(agent, problems, k, verifier, concurrency=concurrency))


def _counted(fmt: PromptFormat, name: str) -> None:
    """A counting episode (+1, +2, +5 from 3) under each reward setting: the last step's
    reward (5 / 10) or the steps' sum ((1 + 2 + 5) / 10), the counter's answers as it gave them."""
    row = {"id": "c", "prompt": "Count.", "start": 3}
    turns = [_step(amount=1), _step(amount=2), _step(amount=5)]
    for reward, expected in (("final", 0.5), ("sum", 0.8)):
        agent, _ = _agent(fmt, list(turns), name, reward)
        [[trajectory]] = _collect(agent, [Problem("c", "Count.", "", row=row)], k=1, concurrency=1)
        assert trajectory.reward == pytest.approx(expected)
        assert trajectory.status == RolloutStatus.DONE
        assert [r.result.stdout for r in trajectory.tool_calls] == [
            "the counter is 4",
            "the counter is 6",
            "the counter is 11",
        ]


def _game(secret: int) -> Problem:
    row = {"id": f"g{secret}", "prompt": "Play.", "secret": secret, "high": 8, "guesses": 3}
    return Problem(row["id"], "Play.", "", row=row)


def test_a_group_of_8_on_a_one_session_server_completes_one_trajectory_after_another(
    fmt: PromptFormat, openenv_serve: Any
) -> None:
    with openenv_serve(GUESS, "--max-concurrent-envs", "1") as url:
        # whichever trajectory holds the session takes the next turns: a win in one guess,
        # then a loss in three, four times over
        turns = [_step(number=6), _step(number=4), _step(number=7), _step(number=5)] * 4
        agent, engine = _agent(fmt, turns, url)
        [group] = _collect(agent, [_game(6)], k=8, concurrency=8)
    assert sorted(t.reward for t in group) == [0.0] * 4 + [1.0] * 4
    assert all(t.status == RolloutStatus.DONE and not t.unscorable for t in group)
    assert sorted(len(t.tool_calls) for t in group) == [1] * 4 + [3] * 4
    lost = next(t for t in group if t.reward == 0.0)
    assert [r.result.stdout for r in lost.tool_calls] == [
        "higher (2 guesses left)",
        "lower (1 guess left)",
        "higher; no guesses left",
    ]
    # the reset's observation ends the user's message of every trajectory's prompt
    prompt = agent.fmt.tokenizer.decode(engine.prompts[0])
    assert "Play.\n\nI am thinking of a whole number from 1 to 8." in prompt
    assert '"name": "step"' in prompt and "The whole number guessed." in prompt
    # the server said it holds one session; every later one waited for it
    assert load_environment(url).factory().gate.limit == 1


def test_the_reward_is_the_last_steps_or_the_sum_of_the_steps(
    fmt: PromptFormat, openenv_serve: Any
) -> None:
    with openenv_serve(COUNTER, "--max-concurrent-envs", "2") as url:
        _counted(fmt, url)


def test_an_environment_error_is_the_models_answer(fmt: PromptFormat, openenv_serve: Any) -> None:
    # a guess after the game is over: the game raises, the model reads the error (as in TRL)
    with openenv_serve(GUESS, "--max-concurrent-envs", "1") as url:
        agent, _ = _agent(fmt, [_step(number="six"), _step(number=6)], url)
        [[trajectory]] = _collect(agent, [_game(6)], k=1, concurrency=1)
    bad, good = trajectory.tool_calls
    assert bad.result.status == ExecStatus.ERROR and "number" in bad.result.stderr
    assert bad.failed and not bad.infra_fault
    assert good.result.stdout == "right: you found it" and trajectory.reward == 1.0


class KillingEngine(ScriptedEngine):
    """Kills the server before it answers its `kill_at`-th turn."""

    def __init__(self, fmt: PromptFormat, turns: list[str], server: Any, kill_at: int):
        super().__init__(fmt, turns)
        self.server, self.kill_at = server, kill_at

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if len(self.prompts) + 1 == self.kill_at:
            self.server.kill()
            self.server.wait(60)
        return await super().generate(prompt_ids, params)


def test_a_server_that_dies_mid_episode_is_a_counted_fault_never_a_zero(
    fmt: PromptFormat, openenv_serve: Any
) -> None:
    with openenv_serve(GUESS, "--max-concurrent-envs", "1") as url:
        agent, _ = _agent(fmt, [], url)
        engine = KillingEngine(agent.fmt, [_step(number=4)] * 40, url.process, kill_at=2)
        agent = Agent(engine, [], agent.fmt, agent.rollout)
        [group] = _collect(agent, [_game(6)], k=2, concurrency=1)
    mid, after = group
    # the first guess was answered; the second met a dead server: an infrastructure fault
    assert mid.tool_calls[0].result.stdout == "higher (2 guesses left)"
    assert mid.tool_calls[1].result.status == ExecStatus.SANDBOX_ERROR
    assert mid.infra_fault and mid.unscorable
    # the next trajectory could not open a session at all
    assert after.status == RolloutStatus.ERROR and after.unscorable
    # neither trains nor scores: left out of the group and counted as failures
    assert make_group(_game(6), group, AlgoConfig(group_size=2), random.Random(0)).kept == []
    scores = score([group])
    assert scores.failed == 2 and scores.per_problem == {}


def test_a_server_that_cannot_be_reached_is_one_line_naming_it() -> None:
    load_environment.cache_clear()
    with pytest.raises(ConfigError, match=r"rollout.environment: 'http://127.0.0.1:9': cannot"):
        load_environment("http://127.0.0.1:9")


def test_the_action_tool_named_after_the_urls_hash_has_the_classs_arguments(
    openenv_serve: Any,
) -> None:
    # the same game as a class and served: one tool name, description and arguments (the
    # class's docstring also says what it returns)
    with openenv_serve(GUESS, "--max-concurrent-envs", "1") as url:
        load_environment.cache_clear()
        [served] = environment_schemas(url + "#guess")
        [method] = environment_schemas("codeloop.environments.guess_number:GuessNumber")
        for key in ("name", "description", "parameters"):
            assert served["function"][key] == method["function"][key]
        assert environment_schemas(url)[0]["function"]["name"] == "step"
        with pytest.raises(ConfigError, match="'no way' after '#' is not a tool name"):
            load_environment(url + "#no way")


def _guess(number: Any) -> str:
    call = {"name": "guess", "arguments": {"number": number}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def test_an_openenv_class_constructed_in_process_plays_as_its_server_would(
    fmt: PromptFormat,
) -> None:
    name = "codeloop.environments.guess_number_openenv:GuessNumberServed#guess"
    # an invalid action is the model's answer (pydantic's reason), then a game won in two
    agent, engine = _agent(fmt, [_guess("six"), _guess(4), _guess(6)], name)
    [[trajectory]] = _collect(agent, [_game(6)], k=1, concurrency=1)
    bad, higher, right = trajectory.tool_calls
    assert bad.result.status == ExecStatus.ERROR and not bad.infra_fault
    assert "Invalid action (number: Input should be a valid integer" in bad.result.stderr
    assert [higher.result.stdout, right.result.stdout] == [
        "higher (2 guesses left)",
        "right: you found it",
    ]
    assert trajectory.reward == 1.0 and trajectory.status == RolloutStatus.DONE
    prompt = agent.fmt.tokenizer.decode(engine.prompts[0])
    assert "Play.\n\nI am thinking of a whole number from 1 to 8." in prompt
    # the tool is the action model's, as the server's /schema gives it: the class's arguments
    [constructed] = environment_schemas(name)
    [method] = environment_schemas("codeloop.environments.guess_number:GuessNumber")
    for key in ("name", "description", "parameters"):
        assert constructed["function"][key] == method["function"][key]


def test_an_openenv_class_in_process_has_final_or_summed_rewards_and_its_session_limit(
    fmt: PromptFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    _counted(fmt, "openenv_counter:Counter")
    turns = [_step(amount=1), _step(amount=2), _step(amount=5)]
    problem = Problem("c", "Count.", "", row={"id": "c", "prompt": "Count.", "start": 3})
    # a class with its own coroutines: they are awaited, the synchronous methods left alone
    awaited, engine = _agent(fmt, list(turns), "openenv_counter:Awaited", "sum")
    [[twice]] = _collect(awaited, [problem], k=1, concurrency=1)
    assert twice.reward == pytest.approx(0.8)
    assert [r.result.stdout for r in twice.tool_calls][-1] == "the counter is 11 (awaited)"
    assert "The counter starts at 3. (awaited)" in awaited.fmt.tokenizer.decode(engine.prompts[0])
    # a class that does not declare concurrent sessions: a group of 4 plays one at a time,
    # each episode closed before the next begins
    import openenv_counter

    agent, _ = _agent(fmt, turns * 4, "openenv_counter:OneAtATime", "sum")
    [group] = _collect(agent, [problem], k=4, concurrency=4)
    assert [t.reward for t in group] == pytest.approx([0.8] * 4)
    assert openenv_counter.OneAtATime.most == 1 and openenv_counter.OneAtATime.live == 0


def test_an_openenv_class_without_an_action_class_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    load_environment.cache_clear()
    with pytest.raises(ConfigError, match=r"'openenv_counter:Untyped': cannot tell Untyped's act"):
        load_environment("openenv_counter:Untyped")
    with pytest.raises(ConfigError, match="'#' names an OpenEnv environment's tool; GuessNumber"):
        load_environment("codeloop.environments.guess_number:GuessNumber#guess")
