"""`codeloop bench ceiling`: the replay answers each problem with its own turns, through the
real engine's slot path, and the whole command runs the recipe's phases at a small scale."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from codeloop.bench.ceiling import ReplayDecoder, Scripts
from codeloop.engine.hf_engine import TransformersEngine
from codeloop.engine.model import tiny_model
from codeloop.engine.protocol import SamplingParams
from codeloop.rollout.prompt import STOP_STRINGS, PromptFormat

CALL = (
    '<tool_call>\n{"name": "execute_python_code_with_standard_io", '
    '"arguments": {"code": "print(3)"}}\n</tool_call>'
)
TURNS = {
    "What is 1 + 2?": ["<reason>Add.</reason>\n" + CALL, "<answer>\\boxed{3}</answer>"],
    "What is 1 + 3?": ["<answer>\\boxed{4}</answer>"],
}


@pytest.fixture(scope="module")
def fmt() -> PromptFormat:
    from transformers import AutoTokenizer

    from codeloop.data.pretrained import PretrainedError, smollm2

    try:
        path = smollm2(quiet=True)
    except PretrainedError as err:
        pytest.skip(str(err))
    return PromptFormat(AutoTokenizer.from_pretrained(path))


def test_a_prompt_finds_its_problem_and_turn(fmt: PromptFormat) -> None:
    scripts = Scripts(fmt, TURNS)
    first = fmt.prompt_ids("What is 1 + 2?")
    start, end = scripts.start(first)
    assert scripts.flat[start:end].tolist() == fmt.encode(TURNS["What is 1 + 2?"][0])
    assert scripts.flat[end].item() in fmt.end_of_turn_ids  # a turn ends in an end of turn
    returning = first + fmt.encode(TURNS["What is 1 + 2?"][0]) + fmt.tool_response_ids("3\n")
    start, end = scripts.start(returning)
    assert scripts.flat[start:end].tolist() == fmt.encode(TURNS["What is 1 + 2?"][1])
    start, end = scripts.start(fmt.prompt_ids("What is 1 + 3?"))
    assert scripts.flat[start:end].tolist() == fmt.encode(TURNS["What is 1 + 3?"][0])
    assert scripts.start(fmt.prompt_ids("Something else entirely, not a problem")) == (0, 0)
    assert scripts.start(returning + returning[-5:] + fmt.tool_response_ids("x")) == (0, 0)


def _replay_engine(fmt: PromptFormat, step_s: float, **settings: object) -> TransformersEngine:
    """The engine on 4 slots with the replay of TURNS in place of its model."""
    engine = TransformersEngine(
        tiny_model(len(fmt.tokenizer), hidden_size=8, layers=1, heads=1),
        fmt.tokenizer,
        fmt.end_of_turn_ids,
        max_batch=4,
        max_kv_tokens=4 * 2048,
        slot_cache=True,
        **settings,  # type: ignore[arg-type]
    )
    engine.slots = ReplayDecoder(Scripts(fmt, TURNS), 4, step_s=step_s, prefill_s=0.0)
    return engine


def test_the_engine_on_the_replay_samples_each_problems_turns(fmt: PromptFormat) -> None:
    engine = _replay_engine(fmt, step_s=0.001, step_in_thread=True)
    params = SamplingParams(200, 1.0, 1.0, STOP_STRINGS, seed=0)

    async def both() -> list:
        prompts = [fmt.prompt_ids(p) for p in TURNS]
        return list(await asyncio.gather(*(engine.generate(p, params) for p in prompts)))

    call, answer = asyncio.run(both())
    # stops at the stop string, whose last token it keeps; the answer at its end of turn
    assert fmt.tokenizer.decode(call.token_ids) == TURNS["What is 1 + 2?"][0]
    assert answer.token_ids[:-1] == fmt.encode(TURNS["What is 1 + 3?"][0])
    assert answer.token_ids[-1] in fmt.end_of_turn_ids and answer.finish_reason == "stop"
    assert set(call.logprobs) == {0.0}
    assert engine.slots.slept_s == pytest.approx(0.001 * engine.stats().steps)


def test_a_returning_turn_fed_through_the_replay_gets_its_next_turn(fmt: PromptFormat) -> None:
    """A turn with few uncached tokens goes through decoding steps (`feed_tokens`): the
    replay's cursor reaches the turn's first token with the prompt's last."""
    engine = _replay_engine(fmt, step_s=0.0, feed_tokens=64)
    params = SamplingParams(200, 1.0, 1.0, STOP_STRINGS, seed=0)
    first = fmt.prompt_ids("What is 1 + 2?")
    call = asyncio.run(engine.generate(first, params))
    returning = first + call.token_ids + fmt.tool_response_ids("3\n")
    answer = asyncio.run(engine.generate(returning, params))
    assert answer.token_ids[:-1] == fmt.encode(TURNS["What is 1 + 2?"][1])
    stats = engine.stats()
    fed = len(returning) - (len(first) + len(call.token_ids) - 1)  # the call's last token on
    assert stats.prefills == 1 and stats.fed_tokens == fed
    assert stats.steps == len(call.token_ids) - 1 + fed + len(answer.token_ids) - 1


@pytest.mark.slow
def test_the_command_runs_every_phase_and_the_replay_answers_right(
    fmt: PromptFormat, tmp_path: Path
) -> None:
    out = tmp_path / "ceiling.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "codeloop",
            "bench",
            "ceiling",
            "--scale",
            "0.01",
            "--rl-steps",
            "1",
            "--step-ms",
            "1",
            "--json",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last == json.loads(out.read_text())
    for key in (
        "tokens_per_s",
        "trajectories_per_s",
        "host_ms_per_step",
        "prefills_per_step",
        "rows_per_step",
    ):
        assert last[key] > 0
    phases = last["phases"]
    assert list(phases) == ["evaluation", "screen", "rl"]
    # 1% of 500 development problems x 2 samples; 1% of 300 x 4 (stage 1's refilter_samples);
    # one step of 16 prompts x 8 x 2 samples; less the problems without a conversation
    left_out = last["problems_without_conversation"]
    evaluated, screened = phases["evaluation"]["trajectories"], phases["screen"]["trajectories"]
    assert evaluated % 2 == 0 and screened % 4 == 0
    assert evaluated // 2 + screened // 4 == 5 + 3 - left_out
    assert phases["rl"]["trajectories"] == 16 * 16
    for phase in phases.values():  # each replayed conversation is right, through the verifier
        assert phase["correct"] == phase["trajectories"] and phase["tool_calls"] > 0
        assert phase["device_s"] == pytest.approx(phase["steps"] * 0.001, rel=0.01)
