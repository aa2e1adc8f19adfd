"""Evaluation during RL (`trainer/held_out.py`): what is scored and when, against a scripted
engine whose answers are known."""

import asyncio
import re
from pathlib import Path

import pytest

from codeloop.config import Config, ConfigError
from codeloop.data.problems import Problem
from codeloop.engine.protocol import Generation, SamplingParams
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.score import Scores
from codeloop.trainer.distributed import World
from codeloop.trainer.held_out import HeldOut
from codeloop.types import ExecRequest, ExecResult


class _Answers:
    """Boxes a + 1 for an even a (right), a + 2 for an odd one (wrong); fails on a = 5, as a
    server that went away would. Records the sampling settings it was asked for."""

    def __init__(self, fmt: PromptFormat) -> None:
        self.fmt, self.params = fmt, list[SamplingParams]()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.params.append(params)
        a = int(re.findall(r"What is (\d+) \+", self.fmt.tokenizer.decode(prompt_ids))[-1])
        if a == 5:
            raise ConnectionError("server went away")
        ids = self.fmt.encode(f"<answer>\\boxed{{{a + 1 + a % 2}}}</answer>")
        end = sorted(self.fmt.end_of_turn_ids)[:1]
        return Generation(ids + end, [-0.1] * (len(ids) + 1), "stop")


class _NoTools:
    async def execute(self, request: ExecRequest) -> ExecResult:
        raise AssertionError("no tool call expected")


class _Side:
    """What `HeldOut.score` uses of a run's rollout side: an agent and the verifier."""

    def __init__(self, engine: _Answers, fmt: PromptFormat) -> None:
        self.engine, self.fmt, self.verifier = engine, fmt, Verifier()

    def agent(self, rollout: object) -> Agent:
        return Agent(self.engine, _NoTools(), self.fmt, rollout)  # type: ignore[arg-type]


def _cfg(every: int) -> Config:
    cfg = Config()
    cfg.trainer.eval_every, cfg.eval.k = every, 2
    cfg.eval.temperature, cfg.eval.max_response_tokens = 0.3, 50
    return cfg


def test_held_out_problems_are_scored_without_the_failed_ones(trainer_fmt: PromptFormat) -> None:
    problems = [Problem(f"q{a}", f"What is {a} + 1?", str(a + 1)) for a in range(6)]
    engine = _Answers(trainer_fmt)
    side = _Side(engine, trainer_fmt)
    try:
        metrics = asyncio.run(HeldOut(_cfg(2), problems).score(side, World()))  # type: ignore[arg-type]
    finally:
        side.verifier.close()
    # q0, q2, q4 right, q1, q3 wrong, q5's two samples failed in the engine: 3 of 5 scored
    assert metrics["eval/pass@1"] == pytest.approx(3 / 5)
    assert metrics["eval/problems"] == 5 and metrics["eval/infrastructure_failures"] == 2
    assert 0.0 < metrics["eval/pass@1_low"] < 0.6 < metrics["eval/pass@1_high"] <= 1.0
    assert {(p.temperature, p.max_tokens) for p in engine.params} == {(0.3, 50)}  # [eval]'s


def test_an_evaluation_is_due_every_n_steps_only_with_problems() -> None:
    problem = [Problem("q", "What is 1 + 1?", "2")]
    assert [s for s in range(1, 8) if HeldOut(_cfg(3), problem).due(s)] == [3, 6]
    assert not any(HeldOut(_cfg(0), problem).due(s) for s in range(1, 8))
    assert not any(HeldOut(_cfg(3), []).due(s) for s in range(1, 8))


def test_eval_every_without_eval_data_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.eval_every needs the held-out problems"):
        HeldOut.from_config(_cfg(2))
    cfg = _cfg(2)
    cfg.eval.data = str(tmp_path / "held.jsonl")
    (tmp_path / "held.jsonl").write_text('{"id": "a", "problem": "1 + 1?", "answer": "2"}\n')
    assert [p.id for p in HeldOut.from_config(cfg).problems] == ["a"]
    assert HeldOut.from_config(_cfg(0)).problems == []


def test_every_ranks_failures_and_problems_are_summed(
    trainer_fmt: PromptFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun each rank scores its share; the log sums the failures of all ranks (here
    a second rank's share, scored elsewhere, is what all_gather brings back beside this one's)."""
    from codeloop.trainer import held_out

    other_rank = Scores({"q10": 1.0, "q11": 0.0}, 3)
    monkeypatch.setattr(held_out, "all_gather", lambda mine, world: [mine, other_rank])
    problems = [Problem(f"q{a}", f"What is {a} + 1?", str(a + 1)) for a in range(6)]
    side = _Side(_Answers(trainer_fmt), trainer_fmt)
    try:
        metrics = asyncio.run(HeldOut(_cfg(2), problems).score(side, World()))  # type: ignore[arg-type]
    finally:
        side.verifier.close()
    assert metrics["eval/infrastructure_failures"] == 2 + 3  # q5's two samples, and the other's
    assert metrics["eval/problems"] == 5 + 2
    assert metrics["eval/pass@1"] == pytest.approx((3 + 1) / 7)
