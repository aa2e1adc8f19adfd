"""Mixed engine steps (step_plan.py, `SlotDecoder.step`): decoding tokens and prompt chunks in
one forward compute the logits of the separate prefill and decoding they replace (float64 on
the Llama family and Gemma 3 with a chunk across its sliding window; float32 through the CPU
kernel), the plan worked out by hand, and random arrivals decoding greedy as the engine's
separate prefills do."""

import asyncio
import random
import shutil
from typing import Any

import pytest
import torch
from test_slot_cache import _model as slot_model
from transformers import Gemma3TextConfig, LlamaConfig

from codeloop.engine.hf_engine import TransformersEngine
from codeloop.engine.kv_batch import PrefixCache
from codeloop.engine.protocol import ContextExceeded, Generation, SamplingParams
from codeloop.engine.slot_cache import SlotBatch, SlotDecoder
from codeloop.engine.step_plan import Follow, followers, plan_step

SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)  # head size 16: the CPU kernel takes it


def _model(config: Any, dtype: torch.dtype) -> Any:
    return slot_model(config).to(dtype)


def _gemma3() -> Any:
    """Two local layers that see the last 8 positions, then a global one."""
    layers = ["sliding_attention", "sliding_attention", "full_attention"]
    return Gemma3TextConfig(
        **{**SMALL, "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 24},
        sliding_window=8,
        layer_types=layers,
    )


def _logits_at(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' own next-token logits after every token of `ids` [len, V]."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()  # type: ignore[no-any-return]


def test_a_step_plans_decoding_rows_first_then_chunks_within_the_budget() -> None:
    # rows 0 and 1 decode; row 2 feeds 6 of its 10 (8 - 2 decoding); row 3 waits for the
    # budget; row 4 waits for its leader
    assert plan_step([0, 0, 10, 5, 7], [False, False, False, False, True], 8) == [1, 1, 6, 0, 0]
    assert plan_step([0, 0, 3, 5], [False] * 4, 8) == [1, 1, 3, 3]
    # more decoding rows than the budget: each still decodes, and one prompt token goes in
    assert plan_step([0, 0, 0, 4, 4], [False] * 5, 2) == [1, 1, 1, 1, 0]
    assert plan_step([], [], 8) == []


def test_samples_of_one_prompt_and_a_shared_system_prompt_follow_an_earlier_row() -> None:
    a = list(range(1, 41))
    c = a[:35] + [99] * 10
    prompts = [a, list(a), c, [7, 8, 9], c]
    plan = followers(prompts, [0, 0, 0, 0, 0], [True] * 5)
    # b: all but its last token from a; c: 35 shared (a first, b ties); the last c: c itself
    assert plan == {1: Follow(0, 39), 2: Follow(0, 35), 4: Follow(2, 44)}
    # a cached prefix leaves 25 shared tokens to spare, under SHARED_PREFIX_MIN (32)
    assert 2 not in followers(prompts[:3], [0, 0, 10], [True] * 3)
    # running rows lead but never follow
    assert followers(prompts[:2], [0, 0], [True, False]) == {}


def _mixed_step_against_transformers(model: Any, decoder: SlotDecoder, tolerance: float) -> None:
    """Rows 0 and 1 decode a token; row 2 feeds a chunk of 12 tokens past its 6 cached ones
    (positions 6..17: across an 8-wide sliding window); row 3 starts a 3-token prompt (a chunk
    under CHUNK_MIN: the kernel's, on its path). The logits after every token equal a full
    forward's of that prefix."""
    prompts = [list(range(1, 11)), [40, 41, 42, 43, 44], list(range(100, 118)), [7, 8, 9]]
    prefixes = PrefixCache(0)
    batch, _ = SlotBatch.prefill(
        decoder, [prompts[0], prompts[1], prompts[2][:6]], prefixes, pad_id=0, offset=0,
        columns=64,
    )  # fmt: skip
    decoded = [5, 6]
    tokens = [*decoded, *prompts[2][6:], *prompts[3]]
    slots = [0, 1, *[2] * 12, *[3] * 3]
    positions = [10, 5, *range(6, 18), *range(0, 3)]
    logits = decoder.step(tokens, slots, positions, list(range(len(tokens))))
    assert logits.shape == (len(tokens), 300)
    expected = [
        _logits_at(model, [*prompts[0], 5])[-1],
        _logits_at(model, [*prompts[1], 6])[-1],
        *_logits_at(model, prompts[2])[6:],
        *_logits_at(model, prompts[3]),
    ]
    for row, (got, want) in enumerate(zip(logits, expected, strict=True)):
        torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance, msg=f"token {row}")
    assert batch.lengths == [10, 5, 6]  # the batch's rows are the engine's to advance


@pytest.mark.parametrize("config", [LlamaConfig(**SMALL), _gemma3()], ids=["llama", "gemma3"])
def test_a_mixed_step_in_float64_computes_the_separate_prefill_and_decoding(config: Any) -> None:
    model = _model(config, torch.float64)
    decoder = SlotDecoder(model, rows=5)
    assert decoder.kernel is None  # float64: SDPA over each row's slot
    _mixed_step_against_transformers(model, decoder, 1e-9)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("config", [LlamaConfig(**SMALL), _gemma3()], ids=["llama", "gemma3"])
def test_a_mixed_step_through_the_cpu_kernel_computes_the_same_logits(config: Any) -> None:
    model = _model(config, torch.float32)
    decoder = SlotDecoder(model, rows=5)
    assert decoder.kernel is not None  # decoding rows by the kernel, the chunk by SDPA
    _mixed_step_against_transformers(model, decoder, 1e-4)


class _Tokens:
    """A tokenizer's face for the engine: no stop strings, nothing to decode."""

    pad_token_id = 0

    def decode(self, ids: list[int], **_: Any) -> str:
        return " ".join(map(str, ids))


def _random_arrivals(engine: TransformersEngine, seed: int) -> list[tuple[Generation, ...]]:
    """Twelve trajectories arriving at random steps, some sharing a system prompt and three
    the same prompt; each samples a turn of 1..11 tokens, then comes back with 3..42 tokens
    of a tool's output and samples 6 more: greedy, so the tokens depend on the logits alone."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 300) for _ in range(40)]
    plans = []
    for i in range(12):
        prompt = (system if i % 2 else []) + [
            rng.randrange(1, 300) for _ in range(rng.randrange(3, 40))
        ]
        plans.append(
            (prompt, rng.randrange(1, 12), [5, 6, 7] * rng.randrange(1, 15), rng.randrange(30))
        )
    plans += [(plans[3][0], 5, [1], 3)] * 3

    async def trajectory(
        prompt: list[int], first: int, tool: list[int], at: int
    ) -> tuple[Generation, ...]:
        while engine.stats().steps < at:
            await asyncio.sleep(0)
        turn = await engine.generate(prompt, SamplingParams(first, temperature=0.0))
        back = prompt + turn.token_ids + tool
        return turn, await engine.generate(back, SamplingParams(6, temperature=0.0))

    async def run() -> list[tuple[Generation, ...]]:
        return await asyncio.gather(*(trajectory(*plan) for plan in plans))

    return asyncio.run(run())


@pytest.mark.parametrize("seed", [0, 1])
def test_random_arrivals_decode_greedy_as_separate_prefills_do(seed: int) -> None:
    model = _model(LlamaConfig(**SMALL), torch.float64)

    def engine(step_tokens: int) -> TransformersEngine:
        return TransformersEngine(
            model, _Tokens(), set(), 8, slot_cache=True, batch_window_ms=0,
            step_tokens=step_tokens, feed_tokens=0,
        )  # fmt: skip

    separate, mixed = engine(0), engine(7)
    expected, got = _random_arrivals(separate, seed), _random_arrivals(mixed, seed)
    for want, have in zip(expected, got, strict=True):
        for a, b in zip(want, have, strict=True):
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    before, after = separate.stats(), mixed.stats()
    assert before.prefills > 0 and before.mixed_steps == 0
    assert after.prefills == 0 and after.mixed_steps > 0 and after.shared_tokens > 0


def test_the_engine_counts_chunks_and_copies_by_hand() -> None:
    """A 20-token prompt at 8 tokens a step: fed in 3 steps (8, 8, 4), the third samples the
    first token, 4 decoding steps more for 5 tokens. Two more samples of the same prompt follow
    the first: each copies 19 columns once the first holds them (after the third step) and
    feeds its last token at the fourth, a step behind it."""
    model = _model(LlamaConfig(**SMALL), torch.float64)
    engine = TransformersEngine(
        model, _Tokens(), set(), 8, slot_cache=True, batch_window_ms=0, step_tokens=8
    )
    prompt = list(range(10, 30))
    params = [SamplingParams(5, temperature=1.0, seed=s) for s in range(3)]
    first = asyncio.run(engine.generate(prompt, params[0]))
    stats = engine.stats()
    assert len(first.token_ids) == 5
    assert (stats.steps, stats.mixed_steps, stats.fed_tokens) == (7, 3, 20)
    assert stats.prefills == 0 and stats.rows_decoded == 5

    async def group() -> list[Generation]:
        return await asyncio.gather(*(engine.generate(prompt, p) for p in params))

    engine.prefixes.clear()
    samples = asyncio.run(group())
    stats = engine.stats().since(stats)
    assert samples[0].token_ids == first.token_ids  # seeded: the same draws
    assert stats.fed_tokens == 20 + 1 + 1 and stats.shared_tokens == 2 * 19
    assert stats.steps == 3 + 4 + 1


def test_a_request_is_fitted_to_the_models_context() -> None:
    """A model of 64 positions: a 60-token prompt asking 50 tokens gets the 4 left (`length`);
    a 64-token prompt is out of room (`ContextExceeded`), as a server's 400, before it runs."""
    config = LlamaConfig(**{**SMALL, "max_position_embeddings": 64})
    engine = TransformersEngine(
        _model(config, torch.float64), _Tokens(), set(), 4, slot_cache=True, batch_window_ms=0
    )
    fitted = asyncio.run(engine.generate(list(range(1, 61)), SamplingParams(50, temperature=0.0)))
    assert len(fitted.token_ids) == 4 and fitted.finish_reason == "length"
    before = engine.stats()
    with pytest.raises(ContextExceeded, match="64 tokens fills the model's context of 64"):
        asyncio.run(engine.generate(list(range(1, 65)), SamplingParams(1)))
    assert engine.stats() == before  # the second never ran
