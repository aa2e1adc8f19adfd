"""The slot cache's forward against transformers' own, its bookkeeping worked out by hand, and
(with the `gpu` marker) its captured decoding steps against eager ones."""

import asyncio
import copy
from typing import Any

import pytest
import torch
from engine_helpers import SMALL
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from codeloop.engine import slot_cache
from codeloop.engine.hf_engine import TransformersEngine
from codeloop.engine.kv_batch import PrefixCache
from codeloop.engine.protocol import SamplingParams
from codeloop.engine.slot_cache import SlotBatch, SlotDecoder, ladder, unsupported_reason
from codeloop.rollout.prompt import PromptFormat


def _model(config: Any) -> Any:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if config.model_type == "gemma3_text":  # its norms start at w = 0, where (1 + w) is 1
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.normal_(0.0, 0.5)
    return model


def _gemma3(**changes: Any) -> Any:
    """A small Gemma 3: two local layers that see the last 8 positions (rotary base 10,000),
    then a global one (1,000,000), QK-norm, head size 16 with a query scale of its own."""
    layers = ["sliding_attention", "sliding_attention", "full_attention"]
    config = {**SMALL, "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 24}
    return Gemma3TextConfig(**{**config, "sliding_window": 8, "layer_types": layers, **changes})


def _last_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(**SMALL),
        Qwen2Config(**SMALL),
        Qwen3Config(head_dim=16, **SMALL),
        LlamaConfig(**{**SMALL, "num_key_value_heads": 4}),
        _gemma3(),
        _gemma3(final_logit_softcapping=2.0),
    ],
    ids=["llama_gqa", "qwen2_bias", "qwen3_qk_norm", "llama_mha", "gemma3", "gemma3_softcap"],
)
def test_prefill_and_decode_logits_equal_transformers(config: Any) -> None:
    model = _model(config)
    decoder = SlotDecoder(model, rows=6)
    prefixes = PrefixCache(1000)
    prompts = [[1, 2, 3, 4, 5], [7, 8], list(range(20, 60)), [1, 2, 3, 4, 5]]
    batch, logits = SlotBatch.prefill(decoder, prompts, prefixes, pad_id=0, offset=0, columns=64)
    assert logits.shape == (4, 300)
    for prompt, row in zip(prompts, logits, strict=True):
        torch.testing.assert_close(row, _last_logits(model, prompt), atol=1e-5, rtol=1e-5)
    tokens = [3, 4, 5, 6]
    logits = batch.decode(None, torch.tensor(tokens))
    assert batch.lengths == [6, 3, 41, 6]
    for prompt, token, row in zip(prompts, tokens, logits, strict=True):
        torch.testing.assert_close(row, _last_logits(model, [*prompt, token]), atol=1e-5, rtol=1e-5)


def test_a_prefix_from_the_cache_is_loaded_and_only_the_rest_prefilled() -> None:
    model = _model(LlamaConfig(**SMALL))
    decoder = SlotDecoder(model, rows=4)
    prefixes = PrefixCache(1000)
    first = list(range(30, 70))
    batch, _ = SlotBatch.prefill(decoder, [first], prefixes, pad_id=0, offset=0, columns=128)
    prefixes.store(tuple(first), batch.row_kv(0))
    decoder.kv.fill_(1e4)  # a reused prefix must come from the cache, not the slot
    turn = [*first, 5, 6, 7]
    _, logits = SlotBatch.prefill(decoder, [turn], prefixes, pad_id=0, offset=2, columns=128)
    assert prefixes.reused_tokens == len(first)
    torch.testing.assert_close(logits[0], _last_logits(model, turn), atol=1e-5, rtol=1e-5)


def test_rows_that_leave_are_filled_by_the_last_rows() -> None:
    model = _model(LlamaConfig(**SMALL))
    decoder = SlotDecoder(model, rows=5)
    prompts = [[i + 1] * (i + 2) for i in range(5)]  # lengths 2..6, slot i holds token i + 1
    batch, _ = SlotBatch.prefill(decoder, prompts, PrefixCache(0), pad_id=0, offset=0, columns=16)
    before = [decoder.kv[:, :, slot, :, : len(p)].clone() for slot, p in enumerate(prompts)]
    order = batch.select([0, 2, 4])  # rows 1 and 3 leave: row 4 moves into slot 1
    assert order == [0, 4, 2]
    assert batch.lengths == [2, 6, 4]
    for slot, source in enumerate(order):
        assert torch.equal(decoder.kv[:, :, slot, :, : len(prompts[source])], before[source])


def test_joining_rows_are_prefilled_after_the_running_ones_and_merged() -> None:
    model = _model(LlamaConfig(**SMALL))
    decoder = SlotDecoder(model, rows=4)
    running, _ = SlotBatch.prefill(
        decoder, [[1, 2, 3]], PrefixCache(0), pad_id=0, offset=0, columns=16
    )
    joining, _ = SlotBatch.prefill(
        decoder, [[4, 5], [6]], PrefixCache(0), pad_id=0, offset=1, columns=16
    )
    assert joining.offset == 1
    merged = running.merge(joining)
    logits = merged.decode(None, torch.tensor([9, 9, 9]))
    for prompt, row in zip([[1, 2, 3], [4, 5], [6]], logits, strict=True):
        torch.testing.assert_close(row, _last_logits(model, [*prompt, 9]), atol=1e-5, rtol=1e-5)


def test_the_cache_grows_under_running_rows(
    monkeypatch: pytest.MonkeyPatch, fmt: PromptFormat
) -> None:
    monkeypatch.setattr(slot_cache, "MIN_COLUMNS", 16)
    monkeypatch.setattr(slot_cache, "MIN_WIDTH", 4)
    model = _model(LlamaConfig(**{**SMALL, "vocab_size": len(fmt.tokenizer)}))
    engine = TransformersEngine(model, fmt.tokenizer, set(), slot_cache=True, batch_window_ms=0)
    assert engine.slots is not None and engine.slots.columns == 16
    short, long = fmt.encode("x"), fmt.encode("What is 2 + 3?")
    greedy = SamplingParams(40, temperature=0)

    async def main() -> list[list[int]]:
        first = asyncio.create_task(engine.generate(short, SamplingParams(8, temperature=0)))
        while engine.stats().steps == 0:
            await asyncio.sleep(0)
        second = await engine.generate(long, greedy)  # joins and needs 64 columns
        return [(await first).token_ids, second.token_ids]

    outputs = asyncio.run(main())
    assert engine.slots.columns == 64
    for prompt, out, n in zip((short, long), outputs, (8, 40), strict=True):
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=n,
                do_sample=False,
                min_new_tokens=n,
                pad_token_id=0,
            )
        assert out == expected[0, len(prompt) :].tolist()


def test_the_batch_ladder_and_the_read_width() -> None:
    assert ladder(5) == [1, 2, 4, 5]
    assert ladder(16) == [1, 2, 4, 8, 16]
    assert ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    decoder = SlotDecoder(_model(LlamaConfig(**SMALL)), rows=2)
    assert decoder.columns == slot_cache.MIN_COLUMNS == 1024
    assert [decoder.width(n) for n in (1, 128, 129, 600, 5000)] == [128, 128, 256, 1024, 1024]


def test_models_outside_the_llama_family_keep_the_dynamic_cache(fmt: PromptFormat) -> None:
    gpt2 = _model(GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2))
    assert "gpt2" in (unsupported_reason(gpt2) or "")
    with pytest.raises(ValueError, match="cannot run this model: model type 'gpt2'"):
        SlotDecoder(gpt2, rows=2)
    sliding = _model(MistralConfig(**SMALL, sliding_window=16))
    assert unsupported_reason(sliding) == "sliding-window attention"
    assert unsupported_reason(_model(MistralConfig(**SMALL, sliding_window=None))) is None
    llama = _model(LlamaConfig(**{**SMALL, "vocab_size": len(fmt.tokenizer)}))
    assert TransformersEngine(llama, fmt.tokenizer, set()).slots is None  # a CPU: by default


# On CUDA: the captured decoding steps.


def test_gemma3_on_slots_decodes_greedy_tokens_as_transformers(fmt: PromptFormat) -> None:
    """Rows of different lengths, past the local layers' window of 8, joining together: each
    row's greedy tokens are those of transformers' full forward."""
    model = _model(_gemma3(vocab_size=len(fmt.tokenizer)))
    engine = TransformersEngine(model, fmt.tokenizer, set(), slot_cache=True)
    assert engine.slots is not None and engine.slots.layer_types[0] == "sliding_attention"
    prompts = [fmt.encode(q) for q in ("What is 2 + 3?", "print(sum(range(10)))", "x")]
    assert sorted(map(len, prompts))[1] > 8  # two past the window, one inside it
    gens = asyncio.run(_many(engine, prompts, SamplingParams(12, temperature=0)))
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.token_ids == _greedy(model, prompt, 12)


def test_gemma3_with_soft_capped_attention_keeps_the_dynamic_cache() -> None:
    assert unsupported_reason(_model(_gemma3())) is None
    capped = _model(_gemma3(attn_logit_softcapping=50.0))
    assert unsupported_reason(capped) == "attention logits soft-capped"


def _cuda_engine(fmt: PromptFormat, family: str = "llama") -> TransformersEngine:
    vocab = len(fmt.tokenizer)
    config = _gemma3(vocab_size=vocab) if family == "gemma3" else LlamaConfig(**SMALL)
    config.vocab_size = vocab
    model = _model(config).cuda()
    return TransformersEngine(model, fmt.tokenizer, set(), batch_window_ms=20)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_replayed_step_equals_the_eager_step(fmt: PromptFormat, family: str) -> None:
    engine = _cuda_engine(fmt, family)
    decoder = engine.slots
    assert decoder is not None and decoder.graphs_on  # the default on a GPU
    prompts = [fmt.encode(q) for q in ("What is 2 + 3?", "x", "print(1)")]
    batch, _ = SlotBatch.prefill(decoder, prompts, PrefixCache(0), pad_id=0, offset=0, columns=64)
    saved = decoder.kv.clone()
    tokens = torch.tensor([5, 6, 7], device="cuda")
    replayed = batch.decode(None, tokens).clone()
    assert decoder.captures == 1  # 3 rows run in the graph of 4
    decoder.kv.copy_(saved)
    decoder.graphs_on = False
    batch.lengths = [len(p) for p in prompts]
    eager = batch.decode(None, tokens)
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_weights_copied_in_place_are_seen_by_the_replay(fmt: PromptFormat) -> None:
    engine = _cuda_engine(fmt)
    prompt = fmt.encode("What is 2 + 3?")
    greedy = SamplingParams(12, temperature=0)
    asyncio.run(engine.generate(prompt, greedy))  # captures the graphs
    assert engine.slots is not None and engine.stats().graphs > 0
    other = _model(LlamaConfig(**{**SMALL, "vocab_size": len(fmt.tokenizer)}))
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(3.0)
    engine.update_weights(other.state_dict())
    after = asyncio.run(engine.generate(prompt, greedy))
    assert after.token_ids == _greedy(other.cuda(), prompt, 12)


@pytest.mark.gpu
def test_the_cache_grows_under_captured_graphs(fmt: PromptFormat) -> None:
    engine = _cuda_engine(fmt)
    prompt = fmt.encode("What is 2 + 3?")
    greedy = SamplingParams(12, temperature=0)
    short = asyncio.run(engine.generate(prompt, greedy))  # captures graphs on 1,024 columns
    assert engine.slots is not None and engine.stats().graphs > 0
    long = prompt + [5] * (slot_cache.MIN_COLUMNS + 10)  # needs the cache doubled
    grown = asyncio.run(engine.generate(long, greedy))
    assert engine.slots.columns == 2 * slot_cache.MIN_COLUMNS
    assert grown.token_ids == _greedy(engine.model, long, 12)
    assert asyncio.run(engine.generate(prompt, greedy)).token_ids == short.token_ids


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """n tokens, each the argmax of a full forward pass (no logits processors: generate's
    min_new_tokens would mask the end-of-sequence token)."""
    ids = list(prompt)
    device = next(model.parameters()).device
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_on_the_gpu_equals_generate(fmt: PromptFormat, family: str) -> None:
    engine = _cuda_engine(fmt, family)
    prompts = [fmt.encode(q) for q in ("What is 2 + 3?", "print(sum(range(10)))", "x")]
    gens = asyncio.run(_many(engine, prompts, SamplingParams(24, temperature=0)))
    reference = copy.deepcopy(engine.model)
    for prompt, gen in zip(prompts, gens, strict=True):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt], device="cuda"),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                pad_token_id=0,
            )
        assert gen.token_ids == out[0, len(prompt) :].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_turns_fed_through_replayed_steps_decode_greedy_as_a_full_forward(
    fmt: PromptFormat, family: str
) -> None:
    """Next turns join running rows through the captured steps (`feed_tokens`, the default on
    a GPU) and decode what a full forward pass decodes."""
    engine = _cuda_engine(fmt, family)
    assert engine.feed_tokens > 0
    greedy = SamplingParams(8, temperature=0)
    prompts = [fmt.encode(q) for q in ("What is 2 + 3?", "print(sum(range(10)))", "x = 7")]
    firsts = asyncio.run(_many(engine, prompts, greedy))
    follows = [
        p + g.token_ids + fmt.encode(f"print({i})\n{i}")
        for i, (p, g) in enumerate(zip(prompts, firsts, strict=True))
    ]

    async def beside_running_rows() -> list[Any]:
        running = [engine.generate([5, 6, 7, 8 + i], SamplingParams(40)) for i in range(5)]
        return (await asyncio.gather(*running, *(engine.generate(f, greedy) for f in follows)))[5:]

    before = engine.stats()
    turns = asyncio.run(beside_running_rows())
    found = engine.stats().since(before)
    # every prompt here has at most 64 tokens not in the prefix cache: no prefill at all
    uncached = 5 * 4 + sum(
        len(f) - len(p) - len(g.token_ids) + 1
        for f, p, g in zip(follows, prompts, firsts, strict=True)
    )
    assert found.prefills == 0 and found.fed_tokens == uncached
    for follow, turn in zip(follows, turns, strict=True):
        assert turn.token_ids == _greedy(engine.model, follow, 8)


async def _many(
    engine: TransformersEngine, prompts: list[list[int]], params: SamplingParams
) -> list[Any]:
    return list(await asyncio.gather(*(engine.generate(p, params) for p in prompts)))


def test_a_cache_that_cannot_fit_is_refused_with_its_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    from codeloop.errors import RunError

    model = _model(LlamaConfig(**SMALL))  # 2 layers x 2 (K, V) x 2 KV heads x 8 x 4 bytes
    per_token = 2 * 2 * 2 * (32 // 4) * 4  # 256 bytes
    decoder = SlotDecoder(model, rows=4)  # 4 rows x 1,024 columns: 1 MiB
    assert decoder.kv.numel() * 4 == 4 * 1024 * per_token
    monkeypatch.setattr(slot_cache, "free_memory", lambda device: 3 * 2**20)
    decoder.ensure_columns(2000)  # 2 MiB: fits in 3
    assert decoder.columns == 2048
    with pytest.raises(RunError) as refused:
        decoder.ensure_columns(3000)  # 4 MiB
    assert str(refused.value).startswith(
        "the engine's KV slots for 3,000 tokens need 4.0 MiB (4 rows x 4,096 tokens x 256 "
        "bytes a token) and the machine has 3.0 MiB free"
    )
    assert decoder.columns == 2048  # what it held is kept


@pytest.mark.parametrize(
    "config",
    [LlamaConfig(**SMALL), Qwen2Config(**SMALL), Qwen3Config(head_dim=16, **SMALL), _gemma3()],
    ids=["llama", "qwen2_bias", "qwen3_qk_norm", "gemma3"],
)
def test_the_merged_forward_in_bfloat16_matches_transformers(config: Any) -> None:
    """Merged projections and the one-op RMSNorm round like transformers' own bfloat16
    forward: the same greedy tokens, logits within bfloat16's resolution."""
    model = _model(config).to(torch.bfloat16)
    decoder = SlotDecoder(model, rows=4)
    prompts = [[1, 2, 3, 4, 5], list(range(20, 60))]
    batch, logits = SlotBatch.prefill(
        decoder, prompts, PrefixCache(0), pad_id=0, offset=0, columns=64
    )
    for prompt, row in zip(prompts, logits, strict=True):
        expected = _last_logits(model, prompt)
        torch.testing.assert_close(row, expected, atol=0.05, rtol=0.02)
        assert int(row.argmax()) == int(expected.argmax())
    tokens = [int(row.argmax()) for row in logits]
    logits = batch.decode(None, torch.tensor(tokens))
    for prompt, token, row in zip(prompts, tokens, logits, strict=True):
        expected = _last_logits(model, [*prompt, token])
        torch.testing.assert_close(row, expected, atol=0.05, rtol=0.02)


def test_new_weights_reach_the_merged_projections(fmt: PromptFormat) -> None:
    """`update_weights` copies into the model and then into the decoder's merged q/k/v and
    gate/up matrices: the next tokens are the new weights' (the slots run eagerly here)."""
    config = LlamaConfig(**{**SMALL, "vocab_size": len(fmt.tokenizer)})
    engine = TransformersEngine(_model(config), fmt.tokenizer, set(), slot_cache=True)
    prompt = fmt.encode("What is 2 + 3?")
    greedy = SamplingParams(12, temperature=0)
    asyncio.run(engine.generate(prompt, greedy))
    other = _model(config)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(3.0)
    engine.update_weights(other.state_dict())
    assert asyncio.run(engine.generate(prompt, greedy)).token_ids == _greedy(other, prompt, 12)


@pytest.mark.parametrize("config", [LlamaConfig(**SMALL), _gemma3()], ids=["llama", "gemma3"])
def test_the_compiled_decoding_step_computes_the_eager_one(config: Any) -> None:
    """`compile_backend`: the layers of a decoding step traced whole by torch.compile (here
    its `aot_eager` backend: the trace without code generation; a GPU runs `inductor`) give
    the eager step's logits and write the same KV. The prefill stays eager."""
    from torch._dynamo.utils import counters

    model = _model(config)
    eager, compiled = SlotDecoder(model, 8), SlotDecoder(model, 8, compile_backend="aot_eager")
    traced = counters["stats"]["unique_graphs"]
    logits = []
    for decoder in (eager, compiled):
        batch, _ = SlotBatch.prefill(
            decoder, [[1, 2, 3, 4, 5], [6, 7, 8]], PrefixCache(0), pad_id=0, offset=0, columns=64
        )
        logits += [
            batch.decode(None, torch.tensor([9, 10])),
            batch.decode(None, torch.tensor([11, 12])),
        ]
    torch.testing.assert_close(logits[2], logits[0])
    torch.testing.assert_close(logits[3], logits[1])
    torch.testing.assert_close(compiled.kv, eager.kv)
    assert counters["stats"]["unique_graphs"] > traced  # the steps ran compiled


@pytest.mark.gpu
def test_bfloat16_parity_at_smollm2s_shape_in_a_256_row_bucket() -> None:
    """SmolLM2-135M's shape (random weights) in bfloat16: a replayed decoding step of 256 rows
    against transformers' forward of the same tokens, row by row."""
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    model = _model(config).to("cuda", torch.bfloat16)
    decoder = SlotDecoder(model, 256)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 49152, (256, 24), generator=generator)
    batch, _ = SlotBatch.prefill(
        decoder, prompts.tolist(), PrefixCache(0), pad_id=0, offset=0, columns=64
    )
    nxt = torch.randint(0, 49152, (256,), generator=generator)
    replayed = batch.decode(None, nxt.cuda()).float()  # [256, V]
    assert decoder.captures == 1
    with torch.no_grad():
        ids = torch.cat([prompts, nxt[:, None]], dim=1).cuda()
        expected = model(input_ids=ids).logits[:, -1].float()
    torch.testing.assert_close(replayed, expected, atol=0.1, rtol=0.05)
    agree = (replayed.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.97


@pytest.mark.gpu
def test_replay_while_rows_join_and_leave_across_width_buckets(fmt: PromptFormat) -> None:
    """Requests of many lengths arrive while others decode, leave at their own lengths and
    cross from reading 128 columns to 256: each decodes what a full forward pass decodes."""
    engine = _cuda_engine(fmt)
    base = fmt.encode("print(sum(range(10)))")
    prompts = [(base * 20)[: 90 + 9 * i] for i in range(6)]  # 90 to 135 tokens
    lengths = [40 - 5 * i for i in range(6)]  # some pass position 128, one starts past it

    async def staggered() -> list[Any]:
        calls = []
        for prompt, n in zip(prompts, lengths, strict=True):
            calls.append(asyncio.ensure_future(engine.generate(prompt, SamplingParams(n, 0.0))))
            await asyncio.sleep(0.02)  # the next joins a running batch
        return list(await asyncio.gather(*calls))

    gens = asyncio.run(staggered())
    assert engine.stats().prefills + bool(engine.stats().fed_tokens) >= 2  # joined mid-batch
    for prompt, n, gen in zip(prompts, lengths, gens, strict=True):
        assert gen.token_ids == _greedy(engine.model, prompt, n)


@pytest.mark.gpu
@pytest.mark.slow  # inductor's compilation: left out of `codeloop bench gpu`
def test_the_compiled_step_replayed_decodes_greedy_as_a_full_forward(fmt: PromptFormat) -> None:
    config = LlamaConfig(**{**SMALL, "vocab_size": len(fmt.tokenizer)})
    model = _model(config).cuda()
    engine = TransformersEngine(model, fmt.tokenizer, set(), compile_backend="inductor")
    prompts = [fmt.encode(q) for q in ("What is 2 + 3?", "print(sum(range(10)))", "x")]
    gens = asyncio.run(_many(engine, prompts, SamplingParams(12, temperature=0)))
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.token_ids == _greedy(model, prompt, 12)


# ops that only re-describe a tensor (no kernel on a GPU)
VIEWS = {
    "view",
    "_unsafe_view",
    "t",
    "slice",
    "select",
    "unsqueeze",
    "permute",
    "expand",
    "split",
    "split_with_sizes",
    "lift_fresh",
    "alias",
    "detach",
}


def test_a_decoding_step_stays_within_its_operation_count() -> None:
    """The operations of one decoding step a layer, views aside, counted as torch dispatches
    them on a CPU (where RMSNorm still runs as its parts): four matrix products (merged q/k/v,
    output, merged gate/up, down: `mm`, or oneDNN's product where the weights are packed),
    rotary as a roll and two products a tensor, the attention mask made once for all layers;
    31 operations in all (39 with separate projections,
    transformers' rotary and a boolean mask). More mean a fusion was undone."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def per_layer(layers: int) -> list[str]:
        decoder = SlotDecoder(_model(LlamaConfig(**{**SMALL, "num_hidden_layers": layers})), 8)
        SlotBatch.prefill(
            decoder, [[1, 2, 3], [4, 5]], PrefixCache(0), pad_id=0, offset=0, columns=64
        )
        with torch.no_grad(), Count() as counted:
            decoder.forward(torch.tensor([[3], [4]]), torch.tensor([[3], [2]]), None, 128)
        return [op for op in counted.ops if op not in VIEWS]

    one, three = per_layer(1), per_layer(3)
    layer = {op: (three.count(op) - one.count(op)) // 2 for op in set(three)}
    assert layer.get("mm", 0) + layer.get("_linear_pointwise", 0) == 4, layer
    assert sum(layer.values()) <= 31, layer


def test_a_cpu_cache_takes_memory_only_where_it_is_written() -> None:
    """The CPU's cache is a memory map of its own: 256 MiB of zeros cost no resident memory
    until rows are written, and then about what was written (Linux's resident pages,
    /proc/self/statm), however much of the heap earlier work freed."""

    def resident_mib() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096 / 2**20

    before = resident_mib()
    cache = slot_cache._zeros((64, 1024, 1024), torch.float32, torch.device("cpu"))  # 256 MiB
    assert resident_mib() - before < 16
    assert cache.shape == (64, 1024, 1024) and cache.dtype == torch.float32
    cache[:8] = 1.0  # 32 MiB written
    assert 24 < resident_mib() - before < 48
    assert float(cache[8:16].abs().sum()) == 0.0 and float(cache[:8].mean()) == 1.0
