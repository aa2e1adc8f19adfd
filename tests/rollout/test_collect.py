"""`collect`: k scored trajectories per problem, each scored while the others still generate."""

import asyncio
import threading
import time

from codeloop.config import RolloutConfig
from codeloop.data.problems import Problem
from codeloop.engine.protocol import Generation, SamplingParams
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent, collect, seed_of
from codeloop.rollout.prompt import PromptFormat

PROBLEMS = [Problem("fast", "What is 2 + 2?", "4"), Problem("slow", "What is 3 + 3?", "6")]


class _WatchedVerifier(Verifier):
    def __init__(self) -> None:
        super().__init__()
        self.scored = threading.Event()

    def score(self, response: object, gold: str) -> object:  # type: ignore[override]
        result = super().score(response, gold)  # type: ignore[arg-type]
        self.scored.set()
        return result


class _Engine:
    """Answers "fast" at once (right) and "slow" (wrong) only once something was scored, or
    after 5 s: a caller that scores after the whole batch makes "slow" wait the 5 s."""

    def __init__(self, fmt: PromptFormat, verifier: _WatchedVerifier) -> None:
        self.fmt, self.verifier = fmt, verifier
        self.waited_s = 0.0
        self.seeds: list[int | None] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.seeds.append(params.seed)
        if "3 + 3" in self.fmt.tokenizer.decode(prompt_ids):
            start = time.perf_counter()
            while not self.verifier.scored.is_set() and time.perf_counter() - start < 5:
                await asyncio.sleep(0.01)
            self.waited_s = time.perf_counter() - start
            reply = "<answer>\\boxed{7}</answer>"
        else:
            reply = "<answer>\\boxed{4}</answer>"
        ids = self.fmt.encode(reply + "<|im_end|>")
        return Generation(ids, [-0.1] * len(ids), "stop")


def test_a_finished_trajectory_is_scored_while_others_generate(fmt: PromptFormat) -> None:
    with _WatchedVerifier() as verifier:
        engine = _Engine(fmt, verifier)
        agent = Agent(engine, None, fmt, RolloutConfig(max_turns=1))  # type: ignore[arg-type]
        groups = asyncio.run(collect(agent, PROBLEMS, 2, verifier, seed=7, keys=[10, 11]))
    assert engine.waited_s < 4  # "fast" was scored before "slow" finished
    assert [[t.reward for t in g] for g in groups] == [[1.0, 1.0], [0.0, 0.0]]
    assert [[t.final_answer for t in g] for g in groups] == [["4", "4"], ["7", "7"]]
    assert [[t.sample_index for t in g] for g in groups] == [[0, 1], [0, 1]]
    # sample j of the problem with key K is seeded from (7, K, j)
    wanted = {seed_of(7, key, j) for key in (10, 11) for j in (0, 1)}
    assert set(engine.seeds) == wanted and len(wanted) == 4


class _Counting:
    """An in-process engine of `max_batch` rows that counts the generations in flight."""

    def __init__(self, fmt: PromptFormat, max_batch: int | None) -> None:
        self.fmt, self.now, self.most = fmt, 0, 0
        if max_batch is not None:
            self.max_batch = max_batch

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.now += 1
        self.most = max(self.most, self.now)
        await asyncio.sleep(0.01)
        self.now -= 1
        ids = self.fmt.encode("<answer>\\boxed{4}</answer><|im_end|>")
        return Generation(ids, [-0.1] * len(ids), "stop")


def test_trajectories_in_flight_are_bounded_by_the_engines_rows(fmt: PromptFormat) -> None:
    """Twice an in-process engine's rows at once (3 -> 6 of 40); none without `max_batch` (a
    server) or with concurrency 0; a given bound otherwise."""
    problems = [Problem(f"p{i}", "What is 2 + 2?", "4") for i in range(10)]
    rollout = RolloutConfig(max_turns=1)
    for max_batch, concurrency, most in ((3, None, 6), (None, None, 40), (3, 0, 40), (3, 5, 5)):
        engine = _Counting(fmt, max_batch)
        with Verifier() as verifier:
            agent = Agent(engine, None, fmt, rollout)  # type: ignore[arg-type]
            groups = asyncio.run(collect(agent, problems, 4, verifier, concurrency=concurrency))
        assert engine.most == most
        assert all(t.reward == 1.0 for g in groups for t in g)


class _CountedFormat(PromptFormat):
    """A prompt format that counts the prompts it renders."""

    rendered = 0

    def prompt_ids(self, problem: str, appended: str = "", environment: str = "") -> list[int]:
        self.rendered += 1
        return super().prompt_ids(problem, appended, environment)


def test_each_problems_prompt_is_rendered_once_when_its_first_sample_runs(
    fmt: PromptFormat,
) -> None:
    """10 problems x 4 samples, 3 at a time: 10 renders, not 40, and none ahead of the gate
    (when the first generation runs, only its own prompt has been rendered)."""
    counted = _CountedFormat(fmt.tokenizer)
    problems = [Problem(f"p{i}", f"What is 2 + {i}?", "4") for i in range(10)]
    seen: list[int] = []

    class _Watching(_Counting):
        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
            seen.append(counted.rendered)
            return await super().generate(prompt_ids, params)

    engine = _Watching(counted, None)
    with Verifier() as verifier:
        agent = Agent(engine, None, counted, RolloutConfig(max_turns=1))  # type: ignore[arg-type]
        groups = asyncio.run(collect(agent, problems, 4, verifier, concurrency=3))
    assert counted.rendered == 10 and seen[0] == 1
    assert [g[0].prompt_ids for g in groups] == [fmt.prompt_ids(p.problem) for p in problems]


def test_a_gym_answer_its_scorer_fails_on_is_unscorable_not_wrong(fmt: PromptFormat) -> None:
    """prime_factorization's scorer raises on '2*2*3': that sample is left out of scores and
    of RL's groups (`Trajectory.unscorable`), and a wrong answer stays a plain 0."""
    import pytest

    pytest.importorskip("reasoning_gym", reason="the gym extra")
    from rollout_helpers import ScriptedEngine

    from codeloop.data.gym import GymTask, generate

    problem = generate([GymTask("prime_factorization", {"min_value": 12, "max_value": 12})], 1, 1)
    replies = ["<answer>\\boxed{2*2*3}</answer>", "<answer>\\boxed{2 × 3}</answer>"]
    engine = ScriptedEngine(fmt, [r + "<|im_end|>" for r in replies])
    with Verifier() as verifier:
        agent = Agent(engine, None, fmt, RolloutConfig(max_turns=1))  # type: ignore[arg-type]
        [group] = asyncio.run(collect(agent, problem, 2, verifier, seed=0, concurrency=1))
    assert [(t.scorer_failed, t.unscorable, t.reward) for t in group] == [
        (True, True, 0.0),
        (False, False, 0.0),
    ]
