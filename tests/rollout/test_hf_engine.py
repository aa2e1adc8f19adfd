import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from codeloop.rollout.engine import Generation, SamplingParams
from codeloop.rollout.hf_engine import TransformersEngine
from codeloop.rollout.prompt import PromptFormat


@pytest.fixture(scope="module")
def engine(fmt: PromptFormat) -> TransformersEngine:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fmt.tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    return TransformersEngine(model, fmt.tokenizer, fmt.end_of_turn_ids, batch_window_ms=20)


def _recompute(
    engine: TransformersEngine, prompt: list[int], gen: Generation, temperature: float
) -> list[float]:
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs.gather(-1, torch.tensor(gen.token_ids).unsqueeze(-1)).squeeze(-1).tolist()


async def _many(
    engine: TransformersEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[Generation]:
    calls = [engine.generate(p, s) for p, s in zip(prompts, params, strict=True)]
    return list(await asyncio.gather(*calls))


def test_batched_logprobs_match_a_full_forward_pass(
    engine: TransformersEngine, fmt: PromptFormat
) -> None:
    prompts = [fmt.encode("What is 2 + 3?"), fmt.encode("x"), fmt.encode("def f(n): return n ** 2")]
    params = [SamplingParams(12, temperature=0.7, seed=i) for i in range(3)]
    before = engine.batches_run
    gens = asyncio.run(_many(engine, prompts, params))
    assert engine.batches_run == before + 1  # the three requests were decoded together
    for prompt, gen in zip(prompts, gens, strict=True):
        assert len(gen.token_ids) == len(gen.logprobs) == 12 and gen.finish_reason == "length"
        assert gen.logprobs == pytest.approx(_recompute(engine, prompt, gen, 0.7), abs=1e-4)


def test_seeded_sampling_does_not_depend_on_the_batch(
    engine: TransformersEngine, fmt: PromptFormat
) -> None:
    prompt = fmt.encode("What is 2 + 3?")
    alone = asyncio.run(engine.generate(prompt, SamplingParams(10, seed=7)))
    params = [SamplingParams(10, seed=1), SamplingParams(10, seed=7)]
    batched = asyncio.run(_many(engine, [fmt.encode("other"), prompt], params))[1]
    assert alone.token_ids == batched.token_ids


def test_stop_strings_and_end_of_turn_tokens(engine: TransformersEngine, fmt: PromptFormat) -> None:
    prompt = fmt.encode("print(1)")
    greedy = asyncio.run(engine.generate(prompt, SamplingParams(8, temperature=0)))
    assert greedy.logprobs == pytest.approx(_recompute(engine, prompt, greedy, 0), abs=1e-4)
    stop = fmt.tokenizer.decode(greedy.token_ids[2:4])
    first = fmt.tokenizer.decode(greedy.token_ids).find(stop)
    stopped = asyncio.run(engine.generate(prompt, SamplingParams(8, temperature=0, stop=[stop])))
    assert stopped.finish_reason == "stop"
    assert stop in fmt.tokenizer.decode(stopped.token_ids)
    assert len(fmt.tokenizer.decode(stopped.token_ids[:-1])) < first + len(stop)
    engine.stop_token_ids.add(greedy.token_ids[1])
    try:
        ended = asyncio.run(engine.generate(prompt, SamplingParams(8, temperature=0)))
    finally:
        engine.stop_token_ids.discard(greedy.token_ids[1])
    assert ended.token_ids == greedy.token_ids[:2] and ended.finish_reason == "stop"


def test_top_p_keeps_the_most_likely_token(engine: TransformersEngine, fmt: PromptFormat) -> None:
    prompt = fmt.encode("What")
    greedy = asyncio.run(engine.generate(prompt, SamplingParams(5, temperature=0)))
    nucleus = asyncio.run(engine.generate(prompt, SamplingParams(5, top_p=1e-6, seed=3)))
    assert nucleus.token_ids == greedy.token_ids


def test_weights_are_updated_in_place(engine: TransformersEngine, fmt: PromptFormat) -> None:
    prompt = fmt.encode("2 + 3")
    params = SamplingParams(6, temperature=0)
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    before = asyncio.run(engine.generate(prompt, params))
    head = "lm_head.weight"
    try:
        engine.update_weights({head: original[head] * 3.0})
        after = asyncio.run(engine.generate(prompt, params))
        assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)
        assert after.logprobs == pytest.approx(_recompute(engine, prompt, after, 0), abs=1e-4)
    finally:
        engine.update_weights({head: original[head]})
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.update_weights({"nope": torch.zeros(1)})


def test_the_agent_loop_on_the_engine(engine: TransformersEngine, fmt: PromptFormat) -> None:
    from codeloop.config import RolloutConfig
    from codeloop.rollout.agent import run_trajectory
    from codeloop.types import ExecRequest, ExecResult, ExecStatus, RolloutStatus, Trajectory

    class NoTools:
        async def execute(self, request: ExecRequest) -> ExecResult:
            return ExecResult(ExecStatus.OK)

    cfg = RolloutConfig(max_response_tokens=24)
    prompt = fmt.prompt_ids("What is 2 + 3?")

    async def main() -> list[Trajectory]:
        tools = NoTools()
        runs = [run_trajectory(engine, tools, fmt, cfg, "p", i, prompt, seed=i) for i in range(4)]
        return list(await asyncio.gather(*runs))

    before = engine.batches_run
    trajectories = asyncio.run(main())
    turns = sum(t.num_turns for t in trajectories)
    assert engine.batches_run - before < turns  # turns of different trajectories shared batches
    for t in trajectories:
        assert len(t.response_ids) <= 24 and t.status in set(RolloutStatus)
        sampled = [lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m]
        assert all(lp < 0 for lp in sampled)


def test_bench_rollout_compares_batched_with_one_at_a_time(tmp_path: object) -> None:
    import json
    from pathlib import Path

    from codeloop.rollout import bench_rollout

    out = Path(str(tmp_path)) / "rollout.json"
    args = ["--trajectories", "4", "--tokens", "6", "--hidden", "32", "--layers", "1",
            "--max-batch", "4", "--tool-turns", "2", "--tool-s", "0.1",
            "--out", str(out)]  # fmt: skip
    assert bench_rollout.main(args) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert set(rows) == {"one_at_a_time", "batched", "tools_serialised", "tools_overlapped"}
    assert all(row["tokens_per_s"] > 0 for row in rows.values())
    for name in ("tools_serialised", "tools_overlapped"):  # every call ran in the sandbox
        assert rows[name]["tool_calls"] == 4 * 2
        assert rows[name]["seconds"] >= 2 * 0.1
