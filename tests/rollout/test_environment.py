"""Environments in TRL's form (`rollout.environment`): one instance per trajectory, its methods
the tools, `reset(**row)`, `get_reward()`, `done`; the tokens trained are the tokens sampled
and the tokens appended."""

import asyncio
import collections
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from rollout_helpers import ScriptedEngine

from codeloop.algo.loss import policy_loss
from codeloop.config import ConfigError, RolloutConfig
from codeloop.data.problems import Problem
from codeloop.environments import guess_number
from codeloop.environments.guess_number import GuessNumber
from codeloop.environments.guess_number_demos import demonstrations, play
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent, collect
from codeloop.rollout.environment import (
    EnvError,
    environment_schemas,
    load_environment,
    load_environments,
    schemas_by_environment,
)
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.toolcall import format_observation
from codeloop.trainer.batch import collate, from_trajectory
from codeloop.trainer.sft import encode_conversation
from codeloop.types import ExecStatus, RolloutStatus

END = "<|im_end|>"
GUESS = "codeloop.environments.guess_number:GuessNumber"


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _agent(fmt: PromptFormat, turns: list[str], environment: str) -> tuple[Agent, ScriptedEngine]:
    rollout = RolloutConfig(tools=[], environment=environment, max_response_tokens=4000)
    with_env = PromptFormat(fmt.tokenizer, tools=environment_schemas(environment))
    engine = ScriptedEngine(with_env, turns)
    return Agent(engine, [], with_env, rollout), engine


def _collect(agent: Agent, problems: list[Problem], k: int = 1) -> list[list[Any]]:
    with Verifier() as verifier:
        return asyncio.run(collect(agent, problems, k, verifier, concurrency=1))


def _game(secret: int, **extra: Any) -> Problem:
    row = {"id": f"g{secret}", "prompt": "Play.", "secret": secret, "high": 8, "guesses": 3}
    return Problem(row["id"], "Play.", "", row={**row, **extra})


def test_each_turn_trains_the_sampled_ids_and_the_appended_ones_masked(fmt: PromptFormat) -> None:
    turns = [_call("guess", number=4), _call("guess", number=6), _call("guess", number=7)]
    agent, engine = _agent(fmt, turns, GUESS)
    [[trajectory]] = _collect(agent, [_game(7)])
    with_env = agent.fmt
    answers = ["higher (2 guesses left)", "higher (1 guess left)", "right: you found it"]
    # sampled turn, its answer, sampled turn, its answer, ...: exactly these ids, in order
    expected_ids, expected_mask = [], []
    for turn, answer in zip(turns, answers, strict=True):
        sampled, appended = with_env.encode(turn), with_env.tool_response_ids(answer)
        expected_ids += sampled + appended
        expected_mask += [1] * len(sampled) + [0] * len(appended)
    assert trajectory.response_ids == expected_ids
    assert trajectory.loss_mask == expected_mask
    assert [lp for lp, m in zip(trajectory.logprobs, expected_mask, strict=True) if not m] == [
        0.0
    ] * expected_mask.count(0)
    # each turn was sampled from the prompt plus everything before it, token for token
    for n, prompt in enumerate(engine.prompts):
        assert (
            prompt
            == trajectory.prompt_ids + expected_ids[: len(prompt) - len(trajectory.prompt_ids)]
        )
        assert len(prompt) - len(trajectory.prompt_ids) == sum(
            len(with_env.encode(t)) + len(with_env.tool_response_ids(a))
            for t, a in zip(turns[:n], answers[:n], strict=True)
        )
    # the game said done after the winning guess: the trajectory ends there, reward from it
    assert trajectory.status == RolloutStatus.DONE and trajectory.reward == 1.0
    assert [r.result.stdout for r in trajectory.tool_calls] == answers

    # the loss's gradient reaches the sampled tokens' positions only
    sample = from_trajectory(trajectory, advantage=1.0)
    batch = collate([sample], pad_id=0)
    logprobs = batch["old_logprobs"].clone().requires_grad_()  # on policy: ratio 1
    loss, _ = policy_loss(
        logprobs, batch["old_logprobs"], batch["advantages"], batch["loss_mask"], denominator=1
    )
    loss.backward()
    assert logprobs.grad is not None
    trained = (logprobs.grad[0] != 0).tolist()
    prompt = len(trajectory.prompt_ids)
    assert trained == [bool(m) for m in ([0] * (prompt - 1) + expected_mask)]


def test_reset_gets_the_row_and_its_text_ends_the_users_message(fmt: PromptFormat) -> None:
    agent, engine = _agent(fmt, [f"no idea{END}"], GUESS)
    [[trajectory]] = _collect(agent, [_game(5, colour="red")])
    prompt = agent.fmt.tokenizer.decode(engine.prompts[0])
    assert "Play.\n\nI am thinking of a whole number from 1 to 8." in prompt
    assert '"name": "guess"' in prompt and "The whole number guessed." in prompt
    # no tool call: the turn ended without an answer, and the game scores a loss
    assert trajectory.status == RolloutStatus.NO_ANSWER and trajectory.reward == 0.0


def test_rewards_are_the_environments_per_trajectory_and_instances_are_not_shared(
    fmt: PromptFormat,
) -> None:
    # four trajectories of one game, in turn: 3; 1, 2, 8; 5, 4, 3; 7, 6, 5
    guesses = [3, 1, 2, 8, 5, 4, 3, 7, 6, 5]
    agent, _ = _agent(fmt, [_call("guess", number=n) for n in guesses], GUESS)
    [group] = _collect(agent, [_game(3)], k=4)
    assert [t.reward for t in group] == [1.0, 0.0, 1.0, 0.0]
    assert [len(t.tool_calls) for t in group] == [1, 3, 3, 3]
    assert [t.status for t in group] == [RolloutStatus.DONE] * 4
    # the second trajectory guessed 1, 2, 8: three guesses of its own game, not the first's
    assert [r.result.stdout for r in group[1].tool_calls] == [
        "higher (2 guesses left)",
        "higher (1 guess left)",
        "lower; no guesses left",
    ]


class Counter:
    """TRL documentation's shape: a counter the model increments, no reward of its own."""

    def __init__(self):
        self._counter = 0

    def reset(self, **kwargs) -> None:
        self._counter = int(kwargs.get("start", 0))

    def increment(self, a: int) -> int:
        """
        Increment the integer by a specified value

        Args:
            a: The value to increment by

        Returns:
            The incremented integer.
        """
        self._counter += a
        if self._counter > 100:
            raise ValueError("past 100")
        return self._counter


def test_a_trl_class_runs_unchanged_its_errors_become_answers_and_the_gold_scores(
    fmt: PromptFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "trl_counter_env", sys.modules[__name__])
    turns = [
        _call("increment", a=2),
        _call("increment", a=200),
        _call("increment", b=1),
        f"<answer>\\boxed{{12}}</answer>{END}",
    ]
    agent, _ = _agent(fmt, turns, "trl_counter_env:Counter")
    problem = Problem("c", "Count.", "12", row={"start": 10})
    [[trajectory]] = _collect(agent, [problem])
    assert [r.result.stdout or r.result.stderr for r in trajectory.tool_calls] == [
        "12",
        "{'error': 'past 100'}",
        "{'error': \"Counter.increment() got an unexpected keyword argument 'b'\"}",
    ]
    # no get_reward: the verifier scores the final answer against the row's gold answer
    assert trajectory.status == RolloutStatus.ANSWERED and trajectory.reward == 1.0
    # a row without a gold answer cannot be scored without get_reward: refused before sampling
    from codeloop.errors import RunError

    with pytest.raises(RunError, match="problem d: no gold answer, and Counter has no get_reward"):
        _collect(agent, [Problem("d", "Count.", "")])


class NoReset:
    def step(self, a: int) -> int:
        """Step.

        Args:
            a: how far
        """
        return a


class Undocumented:
    def reset(self, **row):
        return None

    def move(self, a: int) -> int:
        return a


class BadReward(GuessNumber):
    def get_reward(self):
        return "yes"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nosuch_module_xyz:Env", "rollout.environment: 'nosuch_module_xyz:Env': cannot import"),
        ("env_cases:Missing", "rollout.environment: 'env_cases:Missing': env_cases has no Missing"),
        ("env_cases:NoReset", "NoReset has no reset method"),
        ("env_cases:Undocumented", "Undocumented.move: cannot make its tool schema"),
        ("Nothing", "'Nothing' is not module:Name"),
    ],
)
def test_a_bad_environment_is_one_line_naming_the_class_and_method(
    name: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "env_cases", sys.modules[__name__])
    load_environment.cache_clear()
    with pytest.raises(ConfigError) as caught:
        load_environment(name)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_reward_that_is_not_a_number_is_one_line_naming_get_reward(
    fmt: PromptFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "env_cases", sys.modules[__name__])
    agent, _ = _agent(fmt, [_call("guess", number=2)], "env_cases:BadReward")
    with pytest.raises(
        EnvError, match=r"^BadReward.get_reward returned str \('yes'\); expected a number$"
    ):
        _collect(agent, [_game(2)])


class Echo:
    """A second environment for one run beside the game: it repeats what it is told, and
    rewards 0.5 once it has."""

    def reset(self, **row) -> str:
        self.said = ""
        return " Say something."

    def echo(self, text: str) -> str:
        """
        Repeat a text.

        Args:
            text: What to repeat.
        """
        self.said = text
        return text

    def get_reward(self) -> float:
        return 0.5 if self.said else 0.0


def _two_environments(fmt: PromptFormat, turns: list[str]) -> tuple[Agent, ScriptedEngine]:
    table = {"guess": GUESS, "echo": "env_cases:Echo"}
    rollout = RolloutConfig(tools=[], environments=table, max_response_tokens=4000)
    with_envs = PromptFormat(fmt.tokenizer, tools=[], per_environment=schemas_by_environment(table))
    engine = ScriptedEngine(with_envs, turns)
    return Agent(engine, [], with_envs, rollout), engine


def test_several_environments_each_problem_with_its_own_tools_instance_and_reward(
    fmt: PromptFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL's dict form: the row's `environment` field picks the environment; its prompt lists
    that environment's tools only, its calls reach that environment's instance, and its reward
    is that environment's."""
    monkeypatch.setitem(sys.modules, "env_cases", sys.modules[__name__])
    turns = [_call("guess", number=3), _call("echo", text="hi"), f"done{END}"]
    agent, engine = _two_environments(fmt, turns)
    chat = Problem("e", "Talk.", "", row={"id": "e", "environment": "echo"})
    [[played], [talked]] = _collect(agent, [_game(3, environment="guess"), chat])
    game_prompt, chat_prompt = (fmt.tokenizer.decode(p) for p in engine.prompts[:2])
    assert '"name": "guess"' in game_prompt and '"name": "echo"' not in game_prompt
    assert '"name": "echo"' in chat_prompt and '"name": "guess"' not in chat_prompt
    assert chat_prompt.count("Talk. Say something.") == 1
    assert [r.result.stdout for r in played.tool_calls] == ["right: you found it"]
    assert [r.result.stdout for r in talked.tool_calls] == ["hi"]
    assert (played.reward, talked.reward) == (1.0, 0.5)
    # the saved policy records every tool a prompt may list
    assert sorted(t["function"]["name"] for t in agent.fmt.tools) == ["echo", "guess"]


def test_a_problem_without_an_environment_of_the_table_is_one_line_before_sampling(
    fmt: PromptFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    from codeloop.errors import RunError

    monkeypatch.setitem(sys.modules, "env_cases", sys.modules[__name__])
    agent, engine = _two_environments(fmt, [f"x{END}"] * 4)
    with pytest.raises(
        RunError,
        match=r"^problem g3: its environment field is 'chess', not one of rollout.environments "
        r"\(guess, echo\)$",
    ):
        _collect(agent, [_game(2, environment="guess"), _game(3, environment="chess")])
    with pytest.raises(RunError, match=r"^problem g3: no environment field, and rollout"):
        _collect(agent, [_game(3)])
    assert engine.prompts == []  # refused before anything was sampled
    with pytest.raises(ConfigError, match="rollout.environment and rollout.environments are both"):
        load_environments(GUESS, {"guess": GUESS})
    with pytest.raises(ConfigError, match=r"rollout.environments.guess: expected 'module:Name'"):
        load_environments("", {"guess": 3})


def test_a_config_file_names_several_environments_in_a_table(tmp_path: Path) -> None:
    from codeloop.config import load_config

    path = tmp_path / "run.toml"
    path.write_text(f'[rollout.environments]\nguess = "{GUESS}"\nother = "http://h:1"\n')
    assert load_config(path).rollout.environments == {"guess": GUESS, "other": "http://h:1"}
    path.write_text("[rollout.environments]\nguess = 3\n")
    with pytest.raises(ConfigError, match="rollout.environments.guess: expected a string, got 3"):
        load_config(path)


def bracketed(text: str) -> Any:
    """An action parser: the turn's last `[n]` is a guess; `[0]` an error for the model."""
    found = re.findall(r"\[(\d+)\]", text)
    if not found:
        return None
    if found[-1] == "0":
        return "Error: guess a number from 1."
    return {"name": "guess", "arguments": {"number": int(found[-1])}}


def a_number(text: str) -> Any:
    return 4


def _parsed(fmt: PromptFormat, turns: list[str], parser: str) -> tuple[Agent, ScriptedEngine]:
    rollout = RolloutConfig(
        tools=[], environment=GUESS, action_parser=parser, max_response_tokens=4000
    )
    with_env = PromptFormat(fmt.tokenizer, tools=environment_schemas(GUESS))
    engine = ScriptedEngine(with_env, turns)
    return Agent(engine, [], with_env, rollout), engine


def test_an_action_parser_reads_plain_turns_and_the_tokens_stay_the_ones_sampled(
    fmt: PromptFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "env_cases", sys.modules[__name__])
    turns = [f"I guess [0]{END}", f"Then [4]{END}", f"So [7]{END}"]
    agent, engine = _parsed(fmt, turns, "env_cases:bracketed")
    [[trajectory]] = _collect(agent, [_game(7)])
    calls = trajectory.tool_calls
    assert calls[0].result.status == ExecStatus.REJECTED
    assert calls[0].result.stderr == "Error: guess a number from 1."
    assert [c.result.stdout for c in calls[1:]] == [
        "higher (2 guesses left)",
        "right: you found it",
    ]
    assert trajectory.status == RolloutStatus.DONE and trajectory.reward == 1.0
    expected_ids, expected_mask = [], []
    for turn, call in zip(turns, calls, strict=True):
        answer = format_observation(call.result, agent.rollout.max_tool_response_chars)
        sampled = agent.fmt.encode(turn)
        appended = agent.fmt.tool_response_ids(answer, after_end=True)
        expected_ids += sampled + appended
        expected_mask += [1] * len(sampled) + [0] * len(appended)
    assert trajectory.response_ids == expected_ids
    assert trajectory.loss_mask == expected_mask
    assert (
        engine.prompts[-1]
        == trajectory.prompt_ids
        + expected_ids[: len(engine.prompts[-1]) - len(trajectory.prompt_ids)]
    )
    # each turn's own end-of-turn token, and the tool turn's: none appended twice
    text = fmt.tokenizer.decode(trajectory.response_ids)
    assert text.count(END) == 2 * len(turns) and END + END not in text


def test_a_turn_the_parser_finds_no_action_in_ends_the_trajectory(
    fmt: PromptFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "env_cases", sys.modules[__name__])
    agent, _ = _parsed(fmt, [f"I give up{END}", f"[3]{END}"], "env_cases:bracketed")
    [[trajectory]] = _collect(agent, [_game(3)])
    assert trajectory.status == RolloutStatus.NO_ANSWER and trajectory.num_turns == 1
    assert trajectory.tool_calls == [] and trajectory.reward == 0.0


def test_a_bad_action_parser_is_one_line(
    fmt: PromptFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    from codeloop.errors import RunError

    monkeypatch.setitem(sys.modules, "env_cases", sys.modules[__name__])
    agent, _ = _parsed(fmt, [f"[3]{END}"], "env_cases:a_number")
    with pytest.raises(RunError, match=r"^action parser env_cases:a_number returned 4; expected"):
        _collect(agent, [_game(3)])
    agent, engine = _parsed(fmt, [f"[3]{END}"], "env_cases:nothing_here")
    with pytest.raises(ConfigError, match="rollout.action_parser: 'env_cases:nothing_here'"):
        _collect(agent, [_game(3)])
    assert engine.prompts == []  # refused before anything was sampled


def test_a_trained_policy_keeps_its_environments_and_action_parser(
    fmt: PromptFormat, tmp_path: Path
) -> None:
    """What shaped the policy's turns is saved beside it and set again when it is evaluated."""
    from codeloop.config import apply_policy_settings, load_config

    cfg = load_config(
        None, ["--rollout.tools", "[]", "--rollout.action_parser", "my_parser:bracketed"]
    )
    cfg.rollout.environments = {"guess": GUESS}
    PromptFormat.from_config(fmt.tokenizer, cfg.rollout).save_pretrained(tmp_path)
    fresh = load_config(None)
    assert apply_policy_settings(fresh, tmp_path)
    assert fresh.rollout.environments == {"guess": GUESS}
    assert fresh.rollout.action_parser == "my_parser:bracketed" and fresh.rollout.tools == []


def test_the_games_sft_demonstrations_are_the_tokens_a_trajectory_of_that_game_holds(
    fmt: PromptFormat,
) -> None:
    system, instruction = "Play by calling tools.", "Task: {problem}"
    row = {"id": "g", "prompt": "Play.", "secret": 8, "high": 8, "guesses": 3}
    messages = play(row, random.Random(4), system, instruction)
    turns = [m["content"] for m in messages if m["role"] == "assistant"]
    answers = [m["content"] for m in messages if m["role"] == "tool"]
    # a random opening (4 from this seed), then the middle of what the answers left
    assert answers == [
        "higher (2 guesses left)",
        "higher (1 guess left)",
        "higher; no guesses left",
    ]
    assert [t.split("\n")[0] for t in turns] == [
        "<reason>It is from 1 to 8. I guess 4.</reason>",
        "<reason>It is from 5 to 8. I guess 6.</reason>",
        "<reason>It is from 7 to 8. I guess 7.</reason>",
    ]
    rollout = RolloutConfig(tools=[], environment=GUESS, max_response_tokens=4000)
    with_env = PromptFormat(
        fmt.tokenizer, "", system, instruction, tools=environment_schemas(GUESS)
    )
    # the first turn is sampled after the <reason> the prompt opens it with
    sampled = [turns[0].removeprefix("<reason>"), *turns[1:]]
    agent = Agent(ScriptedEngine(with_env, sampled), [], with_env, rollout)
    [[trajectory]] = _collect(agent, [Problem("g", "Play.", "", row=row)])
    assert trajectory.reward == 0.0 and trajectory.status == RolloutStatus.DONE
    sample = encode_conversation(with_env, messages)
    # SFT trains the ids RL samples, with the same mask; RL's last answer is past the demo's end
    last = len(with_env.tool_response_ids(answers[-1]))
    assert sample.input_ids == (trajectory.prompt_ids + trajectory.response_ids)[:-last]
    assert sample.loss_mask == ([0] * len(trajectory.prompt_ids) + trajectory.loss_mask)[:-last]


def test_the_shipped_demonstrations_are_what_the_generator_writes() -> None:
    shipped = Path(guess_number.__file__).with_name("guess_number_sft.jsonl")
    lines = shipped.read_text().splitlines()
    assert [json.loads(line) for line in lines] == demonstrations(256, 1)
    wins = sum(
        d["messages"][-1]["content"] == "right: you found it" for d in demonstrations(256, 1)
    )
    assert 0.6 < wins / 256 < 0.78  # a random opening, then halving: 44 of 64 (69%)
    openings = collections.Counter(  # the first call's number: every opening, none favoured
        re.search(r'"number": (\d+)', d["messages"][2]["content"])[1]  # type: ignore[index]
        for d in demonstrations(256, 1)
    )
    assert sorted(openings) == [str(n) for n in range(1, 9)] and min(openings.values()) > 16
