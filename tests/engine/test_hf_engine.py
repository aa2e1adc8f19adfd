import asyncio
import copy
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from codeloop.bench.rollout import bandwidth_bound
from codeloop.engine.hf_engine import TransformersEngine
from codeloop.engine.protocol import Generation, SamplingParams
from codeloop.errors import ModelError
from codeloop.rollout.prompt import PromptFormat


def _tiny_llama(fmt: PromptFormat) -> Any:
    """A random two-layer Llama with grouped-query attention (seed 0) over the fmt's vocabulary."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fmt.tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    return AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module", params=[False, True], ids=["dynamic_cache", "slot_cache"])
def engine(fmt: PromptFormat, request: pytest.FixtureRequest) -> TransformersEngine:
    """The engine on each of its KV caches (kv_batch.py, slot_cache.py): every test that takes
    it holds for both."""
    return TransformersEngine(
        _tiny_llama(fmt),
        fmt.tokenizer,
        fmt.end_of_turn_ids,
        batch_window_ms=20,
        slot_cache=request.param,
    )


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
    before = engine.stats().prefills
    gens = asyncio.run(_many(engine, prompts, params))
    assert engine.stats().prefills == before + 1  # the three requests were prefilled together
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


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (lambda w: {"nope": torch.zeros(1)}, "no parameter 'nope'"),
        (lambda w: {"lm_head.weight": w[:-1]}, "has shape"),
        (lambda w: {"lm_head.weight": w.long()}, "not floating point"),
        (lambda w: {"lm_head.weight": w.index_fill(0, torch.tensor([3]), float("nan"))}, "NaN"),
    ],
)
def test_weights_that_do_not_fit_replace_nothing(
    engine: TransformersEngine, change: Any, refusal: str
) -> None:
    """A bad tensor after good ones: refused before any is copied, the version unchanged."""
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    version = engine.version
    first = "model.embed_tokens.weight"
    bad = {first: original[first] * 2.0, **change(original["lm_head.weight"])}
    with pytest.raises(ModelError, match=refusal):
        engine.update_weights(bad)
    assert engine.version == version
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, original[name]), name


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
        runs = [
            run_trajectory(
                engine, tools, fmt, cfg, prompt_id="p", sample_index=i, prompt_ids=prompt, seed=i
            )
            for i in range(4)
        ]
        return list(await asyncio.gather(*runs))

    before = engine.stats().steps
    trajectories = asyncio.run(main())
    sampled = sum(sum(t.loss_mask) for t in trajectories)
    assert engine.stats().steps - before < sampled  # trajectories shared decoding steps
    for t in trajectories:
        assert len(t.response_ids) <= 24 and t.status in set(RolloutStatus)
        sampled = [lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m]
        assert all(lp < 0 for lp in sampled)


def _bench_rollout(tmp_path: object, *args: str) -> dict[str, Any]:
    """`codeloop bench rollout` on a random 1 x 32 Llama; its JSON report."""
    import json
    from pathlib import Path

    from codeloop.bench import rollout as bench_rollout

    out = Path(str(tmp_path)) / "rollout.json"
    common = ["--model", "random", "--hidden", "32", "--layers", "1", "--out", str(out)]
    assert bench_rollout.main([*common, *args]) == 0
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_bench_rollout_compares_the_engines_with_their_baselines(tmp_path: object) -> None:
    report = _bench_rollout(
        tmp_path,
        "--requests",
        "3",
        "--gen-tokens",
        "5",
        "--trajectories",
        "4",
        "--tokens",
        "6",
        "--max-batch",
        "4",
        "--tool-turns",
        "2",
        "--tool-s",
        "0.1",
    )
    rows = report["rows"]
    assert set(rows) == {
        "generate",
        "generate_static",
        "continuous",
        "dynamic_cache",
        "slots_sdpa",
        "static",
        "tools_overlapped",
        "tools_serialised",
        "tools_dynamic_cache",
        "tools_static",
    }
    assert all(row["tokens_per_s"] > 0 for row in rows.values())
    for name in ("tools_serialised", "tools_overlapped", "tools_dynamic_cache", "tools_static"):
        # every call ran
        assert rows[name]["tool_calls"] == 4 * 2
        assert rows[name]["seconds"] >= 2 * 0.1
    # the Linears of the 1 x 32 Llama: q, k, v, o (32 x 32 each), MLP 3 x (32 x 128), and the
    # output layer (32 x the vocabulary of the bench's tokenizer, trained to 300)
    output_layer = report["flops_per_token"] // 2 - (4 * 32 * 32 + 3 * 32 * 128)
    assert output_layer % 32 == 0 and 256 < output_layer // 32 <= 300
    assert report["matmul_gflops"] > 0
    assert report["memory_bound"]["read_gbps"] > 0 and report["memory_bound"]["tokens_per_s"] > 0
    assert set(report["ratios"]) == {
        "continuous / generate",
        "continuous / best of transformers (generate)"
        if rows["generate"]["tokens_per_s"] >= rows["generate_static"]["tokens_per_s"]
        else "continuous / best of transformers (generate_static)",
        "continuous / dynamic_cache",
        "continuous / slots_sdpa",
        "continuous / static",
        "agent: continuous / dynamic_cache",
        "agent: continuous / static",
        "agent: overlapped / serialised",
        "agent: overlapped / plain continuous",
    }
    # the engines' own counters beside their rows: 3 requests of 5 tokens, prefilled together
    counted = rows["continuous"]["engine"]
    assert counted["prefills"] == 1 and counted["steps"] == 4 and counted["rows_per_step"] == 3
    assert rows["tools_overlapped"]["engine"]["prefills"] >= 3  # each turn joined
    assert "engine" not in rows["static"]  # it keeps no counters
    # float32 throughout: the engine's logprobs are the full forward pass's (padding only)
    assert report["logprob_gap"]["tokens"] == 3 * 5
    assert report["logprob_gap"]["max_abs"] < 1e-4
    host = report["host_work"]  # at --max-batch rows
    assert host["rows"] == 4 and host["draws_ms"] > 0 and host["every_tail_ms"] > 0
    free = report["host_time"]  # 256 rows of a model that costs nothing, 128 tokens each
    assert free["rows"] == 256 and free["rows_per_step"] == 256 and free["steps"] == 127
    assert 0 < free["between_steps_ms"] <= free["step_ms"]


def test_a_free_model_runs_through_the_engine_like_a_model(fmt: PromptFormat) -> None:
    from codeloop.bench.rollout import FreeModel

    engine = TransformersEngine(
        FreeModel(vocab=8), fmt.tokenizer, set(), max_batch=4, max_kv_tokens=1000
    )

    async def main() -> list[Generation]:
        params = [SamplingParams(6, 1.0, seed=i) for i in range(3)]
        return list(await asyncio.gather(*(engine.generate([5, 6, 7], p) for p in params)))

    generations = asyncio.run(main())
    free = FreeModel(vocab=8)
    expected = torch.log_softmax(free.row, -1)  # the same logits at every position
    for generation in generations:
        assert len(generation.token_ids) == 6 and all(0 <= t < 8 for t in generation.token_ids)
        assert generation.logprobs == pytest.approx(expected[generation.token_ids].tolist())
    assert len({tuple(g.token_ids) for g in generations}) > 1  # each its own seed
    assert engine.stats().steps == 5 and engine.stats().rows_decoded == 15


def test_bench_ratios_name_the_best_baseline_and_skip_rows_not_run() -> None:
    from codeloop.bench.rollout import _ratios

    def row(speed: float) -> dict[str, float]:
        return {"tokens_per_s": speed}

    # a GPU's rows: no static engine
    rows = {
        "generate": row(3000),
        "generate_static": row(2800),
        "generate_batch": row(1200),
        "continuous": row(15000),
        "tools_overlapped": row(900),
        "tools_serialised": row(300),
        "tools_joins_at_once": row(600),
    }
    assert _ratios(rows) == {
        "continuous / generate": 5.0,
        "continuous / best of transformers (generate)": 5.0,
        "agent: overlapped / serialised": 3.0,
        "agent: overlapped / plain continuous": 0.06,
        "agent: joins batched / joins at once": 1.5,
    }
    rows["generate_static"] = row(6000)
    rows["static"], rows["tools_static"] = row(1000), row(450)
    ratios = _ratios(rows)
    assert ratios["continuous / best of transformers (generate_static)"] == 2.5
    assert ratios["continuous / static"] == 15.0 and ratios["agent: continuous / static"] == 2.0
    rows["tools_separate"] = row(600)  # the engine without mixed steps
    assert _ratios(rows)["agent: mixed steps / separate prefills"] == 1.5


def test_bench_rollout_profiles_plain_generation_on_request(tmp_path: object) -> None:
    from pathlib import Path

    report = _bench_rollout(
        tmp_path,
        "--requests",
        "2",
        "--gen-tokens",
        "4",
        "--trajectories",
        "1",
        "--tokens",
        "2",
        "--tool-turns",
        "1",
        "--tool-s",
        "0.01",
        "--device",
        "cpu",
        "--profile",
    )
    assert report["device"].endswith("CPU threads")
    profiled = (Path(str(tmp_path)) / "rollout.profile.txt").read_text()
    summary, table = profiled.split("\n\n", 1)
    assert summary.startswith("  profiled:") and "tokens/s" in summary
    header, first = table.splitlines()[:2]
    assert header.split() == ["op", "calls", "seconds", "of", "wall"]
    assert first.startswith("aten::")  # torch's ops, by the host's time


def test_a_profile_that_fails_leaves_the_rest_of_the_bench(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pathlib import Path

    from codeloop.bench import rollout as bench_rollout

    def broken(*args: object) -> str:
        raise RuntimeError("no kineto")

    monkeypatch.setattr(bench_rollout, "profile_generation", broken)
    report = _bench_rollout(
        tmp_path,
        "--requests",
        "2",
        "--gen-tokens",
        "4",
        "--trajectories",
        "1",
        "--tokens",
        "2",
        "--tool-turns",
        "1",
        "--tool-s",
        "0.01",
        "--device",
        "cpu",
        "--profile",
    )
    assert {"continuous", "tools_overlapped", "tools_serialised"} <= set(report["rows"])
    profiled = (Path(str(tmp_path)) / "rollout.profile.txt").read_text()
    assert profiled == "  no profile: RuntimeError('no kineto')"


def test_the_memory_bound_by_hand() -> None:
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config)
    # float32 Linears: q, o 32 x 32; k, v 32 x 16 (2 KV heads of 8); MLP 3 x 32 x 128; output
    # 32 x 50 (tied to the embedding, read once); a token's KV: 2 x 1 layer x 2 heads x 8 x 4 B
    weights = 4 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 128 + 32 * 50)
    bound = bandwidth_bound(model, [[1, 2, 3], [1, 2, 3, 4, 5]], 2, read_gbps=1.0)
    assert bound["weight_mb"] == pytest.approx(weights / 1e6)
    assert bound["kv_kb_per_token"] == pytest.approx(0.128)
    # two steps over widths 5 and 6 for 2 rows: 2 x weights + 2 x (5 + 6) x 128 bytes at 1 GB/s
    assert bound["seconds"] == pytest.approx((2 * weights + 2 * 11 * 128) / 1e9)
    assert bound["tokens_per_s"] == pytest.approx(4 / bound["seconds"])


def test_bench_rollout_in_bfloat16_scores_its_tokens_in_float32(tmp_path: object) -> None:
    report = _bench_rollout(
        tmp_path,
        "--requests",
        "2",
        "--gen-tokens",
        "4",
        "--trajectories",
        "2",
        "--tokens",
        "3",
        "--tool-turns",
        "1",
        "--tool-s",
        "0.05",
        "--dtype",
        "bfloat16",
    )
    gap = report["logprob_gap"]
    # bfloat16 keeps 8 bits of mantissa: its logprobs differ from float32's, but by little
    assert gap["tokens"] == 2 * 4 and 0 < gap["mean_abs"] <= gap["max_abs"] < 0.2


def test_logprob_gap_by_hand(engine: TransformersEngine, fmt: PromptFormat) -> None:
    from codeloop.bench.rollout import logprob_gap

    prompt = fmt.encode("What is 2 + 3?")
    generation = asyncio.run(engine.generate(prompt, SamplingParams(4, temperature=0.5, seed=3)))
    exact = _recompute(engine, prompt, generation, 0.5)
    # off by 0.5 on the first token (ratio e^0.5 = 1.65: outside [0.8, 1.28]) and by -0.1 on
    # the second (ratio 0.905: inside)
    off = [exact[0] + 0.5, exact[1] - 0.1, *exact[2:]]
    moved = Generation(generation.token_ids, off, generation.finish_reason)
    gap = logprob_gap(engine.model, [prompt], [moved], 0.5)
    assert gap["tokens"] == 4
    assert gap["mean_abs"] == pytest.approx(0.6 / 4, abs=1e-4)
    assert gap["max_abs"] == pytest.approx(0.5, abs=1e-4)
    assert gap["outside_clip"] == pytest.approx(1 / 4)


def test_greedy_decoding_matches_model_generate(
    engine: TransformersEngine, fmt: PromptFormat
) -> None:
    prompts = [fmt.encode("What is 2 + 3?"), fmt.encode("print(sum(range(10)))"), fmt.encode("x")]
    params = SamplingParams(16, temperature=0)
    gens = asyncio.run(_many(engine, prompts, [params] * 3))  # decoded in one batch
    reference = copy.deepcopy(engine.model)
    assert reference.config._attn_implementation == "codeloop_decode"  # the engine's
    reference.set_attn_implementation("sdpa")  # generate as transformers runs it
    for prompt, gen in zip(prompts, gens, strict=True):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]),
                max_new_tokens=16,
                do_sample=False,
                min_new_tokens=16,
                pad_token_id=0,
            )
        assert gen.token_ids == out[0, len(prompt) :].tolist()


def test_a_request_joins_the_running_batch_and_leaves_when_it_stops(
    engine: TransformersEngine, fmt: PromptFormat
) -> None:
    long_prompt, short_prompt = fmt.encode("def f(n): return n ** 2"), fmt.encode("x")
    alone = asyncio.run(engine.generate(short_prompt, SamplingParams(4, seed=5)))
    finished: list[str] = []

    async def main() -> None:
        async def run(name: str, prompt: list[int], params: SamplingParams) -> Generation:
            gen = await engine.generate(prompt, params)
            finished.append(name)
            return gen

        first = asyncio.create_task(run("long", long_prompt, SamplingParams(60, seed=1)))
        while engine.stats().steps == steps_before:  # the long one is decoding
            await asyncio.sleep(0.001)
        short = await run("short", short_prompt, SamplingParams(4, seed=5))
        assert engine.running == 1  # the short one left; the long one runs on
        assert short.token_ids == alone.token_ids  # joining mid-batch changed nothing
        await first

    steps_before = engine.stats().steps
    asyncio.run(main())
    assert finished == ["short", "long"]
    # the short request's 3 decoding steps were shared with the long one's 59
    assert engine.stats().steps - steps_before == 59


def _recording_prefills(engine: TransformersEngine) -> list[tuple[list[int], int]]:
    """(the steps when each joining request arrived, the steps now) for every prefill of
    `engine` from now on."""
    prefills: list[tuple[list[int], int]] = []
    prefill = engine._prefill

    def recording(joining: Any, device: Any) -> Any:
        prefills.append(([r.arrived_step for r in joining], engine.stats().steps))
        return prefill(joining, device)

    engine._prefill = recording  # type: ignore[method-assign]
    return prefills


def test_a_joining_request_waits_for_others_a_few_steps_when_asked(
    engine: TransformersEngine, fmt: PromptFormat
) -> None:
    from codeloop.engine.hf_engine import JOIN_SHARE

    # max_batch 32: two requests that can join are a batch worth a prefill
    waiting = TransformersEngine(
        engine.model,
        fmt.tokenizer,
        set(),
        join_wait_steps=4,
        max_batch=2 * JOIN_SHARE,
        slot_cache=engine.slots is not None,
    )
    long = fmt.encode("def f(n): return n ** 2")
    rows = 2 * JOIN_SHARE - 3  # three slots stay free
    prompts = [fmt.encode(q) for q in ("x", "print(1)", "y = 2")]
    alone = [
        asyncio.run(engine.generate(p, SamplingParams(6, seed=i))) for i, p in enumerate(prompts)
    ]
    prefills = _recording_prefills(waiting)

    async def main() -> list[Generation]:
        first = [waiting.generate(long, SamplingParams(40, seed=s)) for s in range(rows)]
        running = asyncio.gather(*first)
        while waiting.stats().steps < 2:
            await asyncio.sleep(0.001)
        one = await waiting.generate(prompts[0], SamplingParams(6, seed=0))  # alone: it waits
        two = [waiting.generate(p, SamplingParams(6, seed=i)) for i, p in enumerate(prompts[1:], 1)]
        others = await asyncio.gather(*two)
        await running
        return [one, *others]

    gens = asyncio.run(main())
    assert len(prefills) == 3 and prefills[0] == ([0] * rows, 0)
    (arrived,), at = prefills[1]
    # alone, it waited until 4 steps had passed since the last join (step 0)
    assert arrived >= 2 and at == max(arrived, 4)
    arrived_together, at = prefills[2]
    assert arrived_together == [at, at]  # two were enough: they joined at the next step
    assert [g.token_ids for g in gens] == [g.token_ids for g in alone]  # waiting changed nothing


def test_a_long_queue_joins_in_batches_or_after_the_wait(
    engine: TransformersEngine, fmt: PromptFormat
) -> None:
    """Twice as many requests as slots, of many lengths: a freed slot is not filled at the
    next step (a prefill a step), but once a batch worth a prefill can join, or 8 steps after
    the last join."""
    from codeloop.engine.hf_engine import JOIN_SHARE

    batch = 2 * JOIN_SHARE
    queued = TransformersEngine(
        engine.model,
        fmt.tokenizer,
        set(),
        join_wait_steps=8,
        max_batch=batch,
        slot_cache=engine.slots is not None,
    )
    prefills = _recording_prefills(queued)
    prompt = fmt.encode("print(1)")
    params = [SamplingParams(3 + 7 * i % 29, seed=i) for i in range(2 * batch)]

    async def main() -> list[Generation]:
        return await asyncio.gather(*(queued.generate(prompt, p) for p in params))

    gens = asyncio.run(main())
    assert [len(g.token_ids) for g in gens] == [p.max_tokens for p in params]
    at = [step for _, step in prefills]
    joined = [len(arrived) for arrived, _ in prefills]
    assert at[0] == 0 and joined[0] == batch and sum(joined) == 2 * batch
    for k in range(1, len(prefills)):
        assert joined[k] >= 2 or at[k] - at[k - 1] >= 8, (k, joined, at)
    assert len(prefills) <= 1 + batch // 2  # not one per freed slot


def test_the_engine_counts_what_it_computed_and_what_the_cache_served(
    engine: TransformersEngine, fmt: PromptFormat
) -> None:
    counted = TransformersEngine(
        engine.model,
        fmt.tokenizer,
        set(),
        prefix_cache_tokens=4096,
        slot_cache=engine.slots is not None,
    )
    prompt = fmt.encode("What is 2 + 3?")
    first = asyncio.run(counted.generate(prompt, SamplingParams(5, seed=1)))
    follow = prompt + first.token_ids + fmt.encode("print(5)")
    asyncio.run(counted.generate(follow, SamplingParams(3, seed=2)))
    stats = counted.stats()
    reused = len(prompt) + 4  # the first turn's prompt and the 4 tokens fed back
    assert stats.reused_tokens == reused
    assert stats.prefill_tokens == len(prompt) + len(follow) - reused
    assert stats.prefills == 2 and stats.steps == 4 + 2 and stats.rows_decoded == 6
    assert stats.metrics()["prefix_reuse"] == pytest.approx(reused / (len(prompt) + len(follow)))
    assert stats.metrics()["rows_per_step"] == 1.0
    assert stats.decode_s > 0 and stats.prefill_s > 0


def test_max_batch_and_kv_tokens_cap_the_running_requests(
    engine: TransformersEngine, fmt: PromptFormat
) -> None:
    prompts = [fmt.encode("What is 2 + 3?"), fmt.encode("x"), fmt.encode("print(1)")]
    params = [SamplingParams(6, seed=i) for i in range(3)]
    free = asyncio.run(_many(engine, prompts, params))
    reserve = max(len(p) for p in prompts) + 6
    slots = engine.slots is not None
    for capped in (
        TransformersEngine(engine.model, fmt.tokenizer, set(), max_batch=1, slot_cache=slots),
        TransformersEngine(
            engine.model, fmt.tokenizer, set(), max_kv_tokens=reserve, slot_cache=slots
        ),
    ):
        gens = asyncio.run(_many(capped, prompts, params))
        assert capped.stats().prefills == 3 and capped.stats().steps == 3 * 5  # one after the other
        assert [g.token_ids for g in gens] == [g.token_ids for g in free]


def _uniform_by_hand(seed: int, counter: int) -> float:
    """`uniforms` in Python's integers: lowbias32 over the seed's halves, then the counter."""

    def mix(x: int) -> int:
        x ^= x >> 16
        x = x * 0x7FEB352D % 2**32
        x ^= x >> 15
        x = x * 0x846CA68B % 2**32
        return x ^ (x >> 16)

    key = mix(mix((seed % 2**32) ^ 0x9E3779B9) ^ (seed >> 32))
    other = mix(key ^ 0x85EBCA6B)
    return (mix((mix(counter ^ key) + other) % 2**32) >> 8) / 2**24


def test_draws_are_a_hash_of_seed_and_counter() -> None:
    from codeloop.engine.sampler import SEEDS, uniforms

    seeds = [0, 1, 2, 7, 2**32, 2**32 + 1, SEEDS - 1]
    counters = [0, 1, 5, 2**31, 2**32 - 1]
    grid = [(s, c) for s in seeds for c in counters]
    draws = uniforms(torch.tensor([s for s, _ in grid]), torch.tensor([c for _, c in grid]))
    assert draws.tolist() == pytest.approx([_uniform_by_hand(s, c) for s, c in grid], abs=0)
    alone = uniforms(torch.tensor([7]), torch.tensor([5]))  # in a batch or not
    assert float(alone) == float(draws[grid.index((7, 5))])
    # many seeds x steps: uniform on [0, 1), no two neighbouring seeds or steps alike
    table = uniforms(torch.arange(400).repeat_interleave(400), torch.arange(400).repeat(400))
    assert float(table.min()) >= 0 and float(table.max()) < 1
    counts = torch.histc(table, bins=10, min=0, max=1)  # 16,000 expected in each
    assert float(counts.min()) > 15_400 and float(counts.max()) < 16_600
    table = table.view(400, 400)
    first_steps = table[:, 0]
    assert len(set(first_steps.tolist())) == 400  # every seed starts somewhere else
    for a, b in ((table[:-1], table[1:]), (table[:, :-1], table[:, 1:])):
        correlation = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(float(correlation)) < 0.01


def test_a_draw_picks_where_the_cdf_passes_it() -> None:
    """Five rows, one draw for all, worked out by hand. A: probabilities 0.1, 0.6, 0.3; B: 0.3,
    0.1, 0.6; T = 1. Without top-p the CDF runs in id order (A: 0.1, 0.7, 1; B: 0.3, 0.4, 1);
    with top-p 0.65 in descending order, keeping 0.6 and then 0.3 (0.6 < 0.65), renormalised
    (A's tokens 1 then 2, B's 2 then 0, each 2/3 then 1/3); greedy ignores top-p (0.95 would
    keep all three)."""
    from codeloop.engine.sampler import sample

    a, b = torch.tensor([0.1, 0.6, 0.3]).log(), torch.tensor([0.3, 0.1, 0.6]).log()
    logits = torch.stack([a, a, b, a, b])  # [5, 3]
    params = [
        SamplingParams(1, temperature=1.0),
        SamplingParams(1, temperature=1.0, top_p=0.65),
        SamplingParams(1, temperature=1.0, top_p=0.65),
        SamplingParams(1, temperature=0, top_p=0.95),
        SamplingParams(1, temperature=1.0),
    ]
    expected = {  # draw -> the token of each row
        0.05: [0, 1, 2, 1, 0],
        0.35: [1, 1, 2, 1, 1],
        0.50: [1, 1, 2, 1, 2],
        0.69: [1, 2, 0, 1, 2],  # nucleus: 0.69 > 2/3
        0.71: [2, 2, 0, 1, 2],
        0.95: [2, 2, 0, 1, 2],
    }
    for draw, tokens in expected.items():
        picked, logprobs = sample(logits, params, torch.full((5,), draw))
        assert picked.tolist() == tokens, draw
        probs = torch.stack([a, a, b, a, b]).exp()
        chosen = probs[torch.arange(5), picked].log()  # under T = 1, before top-p
        assert logprobs.tolist() == pytest.approx(chosen.tolist(), abs=1e-6)


def test_top_p_reaches_past_the_64_most_likely_tokens_of_a_flat_distribution() -> None:
    """200 tokens, each a little less likely than the one before (id order is descending
    order): top-p 0.9 keeps about 180 of them, more than the 64 tried first, and a draw of 0.99
    lands among the last kept."""
    from codeloop.engine.sampler import sample

    logits = -0.001 * torch.arange(200.0).unsqueeze(0)  # [1, 200]
    params = [SamplingParams(1, temperature=1.0, top_p=0.9)]
    token, _ = sample(logits, params, torch.tensor([0.99]))
    probs = torch.softmax(logits[0], -1)
    kept = int((probs.cumsum(-1) - probs <= 0.9).sum())  # 181
    assert 150 < int(token) < kept


def test_a_row_stops_at_max_tokens_and_not_before() -> None:
    from codeloop.engine.stops import finish_reason

    params = SamplingParams(3)
    assert [finish_reason(None, set(), [7] * n, params) for n in (1, 2, 3)] == [
        None,
        None,
        "length",
    ]
    assert finish_reason(None, {7}, [7], params) == "stop"  # an end-of-turn token first


def test_sampling_follows_temperature_and_top_p() -> None:
    from codeloop.engine.sampler import sample, uniforms

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -8.0]]).repeat(4, 1)  # [4, 5]
    params = [
        SamplingParams(1, temperature=0.5, top_p=0.9),
        SamplingParams(1, temperature=1.0),
        SamplingParams(1, temperature=0),
        SamplingParams(1, temperature=2.0, top_p=0.5),
    ]
    probs_t05 = torch.softmax(logits[0] / 0.5, -1)  # [0.865, 0.117, 0.016, 0.002, ~0]
    probs_t1 = torch.softmax(logits[0], -1)  # [0.644, 0.237, 0.087, 0.032, ~0]
    counts = torch.zeros(4, 5)
    n = 4000
    for step in range(n):
        tokens, logprobs = sample(logits, params, uniforms(torch.arange(4), torch.full((4,), step)))
        counts[torch.arange(4), tokens] += 1
        # logprobs are under softmax(logits / T) before top-p; greedy's are the raw ones
        expected = [
            probs_t05.log()[tokens[0]],
            probs_t1.log()[tokens[1]],
            probs_t1.log()[tokens[2]],
            torch.log_softmax(logits[3] / 2, -1)[tokens[3]],
        ]
        assert logprobs.tolist() == pytest.approx([float(e) for e in expected], abs=1e-5)
    # T=0.5, top-p 0.9: tokens 0 and 1 (0.865 < 0.9, so the second is kept), renormalised
    kept = probs_t05[:2] / probs_t05[:2].sum()
    assert counts[0, :2] / n == pytest.approx(kept.tolist(), abs=0.02) and counts[0, 2:].sum() == 0
    assert counts[1] / n == pytest.approx(probs_t1.tolist(), abs=0.02)  # no top-p: all of them
    assert counts[2, 0] == n  # greedy
    # T=2: [0.454, 0.275, 0.167, ...]; 0.454 <= 0.5 precedes the second, so top-p keeps two
    probs_t2 = torch.softmax(logits[3] / 2, -1)[:2]
    assert counts[3, :2] / n == pytest.approx((probs_t2 / probs_t2.sum()).tolist(), abs=0.02)
    assert counts[3, 2:].sum() == 0


def test_a_next_turn_reuses_the_finished_turns_kv(
    engine: TransformersEngine, fmt: PromptFormat
) -> None:
    fresh = TransformersEngine(
        engine.model, fmt.tokenizer, engine.stop_token_ids, prefix_cache_tokens=0
    )
    prompt = fmt.encode("What is 2 + 3?")
    first = asyncio.run(engine.generate(prompt, SamplingParams(8, temperature=0.8, seed=3)))
    observation = fmt.encode("print(5)\nx")  # what a tool response would add
    follow = prompt + first.token_ids + observation
    before = engine.prefixes.reused_tokens
    params = SamplingParams(10, temperature=0.8, seed=4)
    second = asyncio.run(engine.generate(follow, params))
    # the prompt and 7 sampled tokens were in the cache (the 8th was never fed)
    assert engine.prefixes.reused_tokens - before == len(prompt) + 7
    assert second.logprobs == pytest.approx(_recompute(engine, follow, second, 0.8), abs=1e-4)
    assert second.token_ids == asyncio.run(fresh.generate(follow, params)).token_ids
    assert fresh.prefixes.reused_tokens == 0  # disabled
    engine.update_weights({})  # new weights: nothing cached is valid any more
    assert engine.prefixes.tokens == 0


@pytest.fixture(scope="module")
def model(fmt: PromptFormat) -> Any:
    """The engine fixture's model, for tests of the slot path alone."""
    return _tiny_llama(fmt).eval()


def _on_slots(model: Any, fmt: PromptFormat, **settings: Any) -> TransformersEngine:
    return TransformersEngine(
        model, fmt.tokenizer, set(), slot_cache=True, batch_window_ms=0, **settings
    )


def test_a_next_turn_with_few_new_tokens_is_fed_through_decoding_steps(
    model: Any, fmt: PromptFormat
) -> None:
    """On slots, a returning turn whose uncached tokens are at most `feed_tokens` takes them
    through decoding steps, a token a step, and samples what a prefill of them samples."""
    prompt = fmt.encode("What is 2 + 3?")
    observation = fmt.encode("print(5)\nx")
    new = len(observation) + 1  # the first turn's last token was never fed
    first_params = SamplingParams(8, temperature=0.8, seed=3)
    params = SamplingParams(10, temperature=0.8, seed=4)
    runs = {}
    for feed in (new, new - 1):  # fed at the bound; one token over it, prefilled
        served = _on_slots(model, fmt, feed_tokens=feed)
        first = asyncio.run(served.generate(prompt, first_params))
        follow = prompt + first.token_ids + observation
        runs[feed] = (served, follow, asyncio.run(served.generate(follow, params)))
    scorer, follow, second = runs[new]
    stats, prefilled = scorer.stats(), runs[new - 1][2]
    assert runs[new - 1][1] == follow  # the same first turn
    assert second.token_ids == prefilled.token_ids and len(second.token_ids) == 10
    assert second.logprobs == pytest.approx(prefilled.logprobs, abs=1e-5)
    assert second.logprobs == pytest.approx(_recompute(scorer, follow, second, 0.8), abs=1e-4)
    # one prefill (the first turn); 7 steps for its other tokens, then `new` steps feeding
    # the next turn (the last of them samples its first token) and 9 for the rest
    assert stats.prefills == 1 and stats.fed_tokens == new
    assert stats.steps == 7 + new + 9 and stats.rows_decoded == stats.steps
    assert stats.reused_tokens == len(prompt) + 7
    assert stats.prefill_tokens == len(prompt)
    other = runs[new - 1][0].stats()
    assert other.prefills == 2 and other.fed_tokens == 0 and other.steps == 7 + 9


def test_a_fed_turn_joins_at_the_next_step_while_a_prefilled_one_waits(
    model: Any, fmt: PromptFormat
) -> None:
    """Joins wait for a batch worth a prefill (here 2 of 32 slots) or 8 steps; a request to be
    fed needs no prefill and joins at the next step, beside the running rows."""
    observation = fmt.encode("print(5)")
    feed = len(observation) + 1  # the next turn's uncached tokens; a new prompt has more
    waiting = _on_slots(model, fmt, join_wait_steps=8, max_batch=32, feed_tokens=feed)
    prompt, other, new = (fmt.encode(q) for q in ("What is 2 + 3?", "x = 1 + 2 * 3", "def g(k): k"))
    assert min(len(prompt), len(other), len(new)) > feed
    first = asyncio.run(waiting.generate(prompt, SamplingParams(6, seed=1)))
    follow = prompt + first.token_ids + observation
    alone = asyncio.run(_on_slots(model, fmt).generate(follow, SamplingParams(5, seed=2)))
    joins: list[tuple[str, int, int]] = []
    prefill, join_fed = waiting._prefill, waiting._join_fed

    def recording_prefill(joining: Any, device: Any) -> Any:
        joins.extend(("prefill", r.arrived_step, waiting.stats().steps) for r in joining)
        return prefill(joining, device)

    def recording_feed(fed: Any) -> None:
        joins.extend(("fed", r.arrived_step, waiting.stats().steps) for r in fed)
        join_fed(fed)

    waiting._prefill = recording_prefill  # type: ignore[method-assign]
    waiting._join_fed = recording_feed  # type: ignore[method-assign]

    async def main() -> list[Generation]:
        long = asyncio.ensure_future(waiting.generate(other, SamplingParams(40)))
        while waiting.stats().steps < first_steps + 2:
            await asyncio.sleep(0.001)
        fresh = asyncio.ensure_future(waiting.generate(new, SamplingParams(4)))
        turn = await waiting.generate(follow, SamplingParams(5, seed=2))
        return [turn, await fresh, await long]

    first_steps = waiting.stats().steps
    turn = asyncio.run(main())[0]
    assert turn.token_ids == alone.token_ids
    assert [kind for kind, _, _ in joins] == ["prefill", "fed", "prefill"], joins
    kinds = {kind: (arrived, at) for kind, arrived, at in joins[1:]}
    arrived, at = kinds["fed"]
    assert at == arrived  # no wait
    arrived, at = kinds["prefill"]
    # alone, it waited until 8 steps had passed since the long one's prefill (the fed join
    # between them is not a prefill)
    assert at == max(arrived, first_steps + 8)


def test_identical_prompts_are_prefilled_once_and_sampled_apart(
    engine: TransformersEngine, fmt: PromptFormat
) -> None:
    prompt = fmt.encode("def f(n): return n ** 2")
    params = [SamplingParams(6, temperature=1.0, seed=s) for s in range(3)]
    gens = asyncio.run(_many(engine, [prompt] * 3, params))
    assert len({tuple(g.token_ids) for g in gens}) > 1  # three samples, not one copied
    for gen, p in zip(gens, params, strict=True):
        assert gen.logprobs == pytest.approx(_recompute(engine, prompt, gen, 1.0), abs=1e-4)
        alone = TransformersEngine(
            engine.model, fmt.tokenizer, engine.stop_token_ids, prefix_cache_tokens=0
        )
        assert asyncio.run(alone.generate(prompt, p)).token_ids == gen.token_ids


def test_the_prefix_cache_keeps_the_longest_entries_within_its_budget() -> None:
    from codeloop.engine.kv_batch import PrefixCache

    def kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.full((1, n, 2), float(n)), torch.zeros(1, n, 2))]

    cache = PrefixCache(max_tokens=10)
    cache.store((1, 2, 3), kv(3))
    cache.store((1, 2, 3, 4, 5), kv(5))  # supersedes its prefix (1, 2, 3)
    assert cache.tokens == 5
    n, entry = cache.lookup([1, 2, 3, 4, 9, 9])
    assert n == 4 and entry is not None and entry.ids == (1, 2, 3, 4, 5)
    assert cache.lookup([1, 2, 3, 4, 5])[0] == 4  # the last prompt token is always computed
    assert cache.lookup([7, 1, 2])[0] == 0
    cache.store((7, 7, 7, 7), kv(4))
    cache.store((8, 8, 8), kv(3))  # 12 tokens > 10: the least recently used entry goes
    assert cache.tokens == 7 and cache.lookup([1, 2, 3])[0] == 0
    assert cache.lookup([7, 7, 7, 7, 1])[0] == 4
    cache.store(tuple(range(11)), kv(11))  # larger than the whole budget: not kept
    assert cache.tokens == 7


def test_a_prefix_shared_by_a_batch_is_prefilled_once(
    engine: TransformersEngine, fmt: PromptFormat
) -> None:
    from codeloop.engine.kv_batch import SHARED_PREFIX_MIN

    system = fmt.encode("Solve the problem step by step. print(sum(range(10)))\n" * 4)
    assert len(system) > SHARED_PREFIX_MIN
    prompts = [system + fmt.encode(q) for q in ("What is 2 + 3?", "x = [i * i]", "def f(n):")]
    params = [SamplingParams(6, temperature=0.7, seed=s) for s in range(3)]
    engine.update_weights({})  # an empty prefix cache
    before = engine.prefixes.reused_tokens
    gens = asyncio.run(_many(engine, prompts, params))
    assert engine.prefixes.reused_tokens - before == 3 * len(system)
    alone = TransformersEngine(
        engine.model, fmt.tokenizer, engine.stop_token_ids, prefix_cache_tokens=0
    )
    expected = asyncio.run(_many(alone, prompts, params))
    for prompt, gen, reference in zip(prompts, gens, expected, strict=True):
        assert gen.token_ids == reference.token_ids
        assert gen.logprobs == pytest.approx(_recompute(engine, prompt, gen, 0.7), abs=1e-4)


def test_an_unset_kv_cap_is_a_quarter_of_the_free_memory(
    fmt: PromptFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    from codeloop.engine import hf_engine

    config = LlamaConfig(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = AutoModelForCausalLM.from_config(config)
    monkeypatch.setattr(hf_engine, "free_memory", lambda device: 1 << 30)
    # per token: 2 (K, V) x 2 layers x 2 KV heads x 16 (64 / 4 heads) x 4 bytes = 512 bytes
    assert hf_engine.default_kv_tokens(model) == (1 << 30) // 4 // 512
    engine = TransformersEngine(model, fmt.tokenizer, set())
    assert engine.kv_capacity_tokens == engine.max_kv_tokens == (1 << 28) // 512
    assert (
        TransformersEngine(model, fmt.tokenizer, set(), max_kv_tokens=99).kv_capacity_tokens == 99
    )


def _free_running(fmt: PromptFormat) -> TransformersEngine:
    """An engine on a random model that stops only at max_tokens."""
    return TransformersEngine(_tiny_llama(fmt), fmt.tokenizer, [], batch_window_ms=0)


def test_each_token_records_the_weights_that_sampled_it(fmt: PromptFormat) -> None:
    engine = _free_running(fmt)

    async def main() -> Generation:
        task = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(40, seed=1)))
        while engine.stats().steps < 5:
            await asyncio.sleep(0.001)
        engine.update_weights({}, version=7)  # between two decoding steps
        return await task

    versions = asyncio.run(main()).versions
    assert versions is not None and len(versions) == 40
    assert versions[0] == 0 and versions[-1] == 7  # a partial rollout: both weights
    assert versions == sorted(versions) and set(versions) == {0, 7}


def test_a_cancelled_request_leaves_the_batch(fmt: PromptFormat) -> None:
    engine = _free_running(fmt)

    async def main() -> tuple[Generation, int]:
        gone = asyncio.create_task(engine.generate([5, 6], SamplingParams(300, seed=1)))
        kept = asyncio.create_task(engine.generate([7, 8], SamplingParams(30, seed=2)))
        queued = asyncio.create_task(engine.generate([9], SamplingParams(30, seed=3)))
        while engine.stats().steps < 3:
            await asyncio.sleep(0.001)
        gone.cancel()
        queued.cancel()
        result = await kept
        while engine.running:  # the cancelled one must not decode on to its 300 tokens
            await asyncio.sleep(0.001)
        return result, engine.stats().steps

    result, steps = asyncio.run(main())
    assert len(result.token_ids) == 30
    assert steps < 60  # 29 decoding steps for the kept request, a few more at most


def test_on_a_cpu_steps_run_on_the_event_loops_thread(fmt: PromptFormat) -> None:
    import threading

    def run(engine: TransformersEngine) -> tuple[list[Generation], set[int]]:
        threads: set[int] = set()
        forward = engine._forward

        def spy(*args: object, **kwargs: torch.Tensor) -> torch.Tensor:
            threads.add(threading.get_ident())
            return forward(*args, **kwargs)  # type: ignore[arg-type]

        engine._forward = spy  # type: ignore[method-assign]
        prompts = [[5, 6, 7], [8, 9]]
        params = [SamplingParams(12, seed=1), SamplingParams(9, seed=2)]
        return asyncio.run(_many(engine, prompts, params)), threads

    on_loop = _free_running(fmt)
    assert on_loop.step_in_thread is False  # the default for a model on the CPU
    gens, threads = run(on_loop)
    assert threads == {threading.get_ident()}  # asyncio.run's loop runs on this thread
    in_thread = TransformersEngine(
        on_loop.model, fmt.tokenizer, [], batch_window_ms=0, step_in_thread=True
    )
    threaded, threads = run(in_thread)
    assert threading.get_ident() not in threads
    # where a step runs changes nothing in what it samples
    assert [g.token_ids for g in threaded] == [g.token_ids for g in gens]
    assert [len(g.token_ids) for g in gens] == [12, 9]


def test_an_evaluations_cap_only_lowers_what_the_engine_admits(fmt: PromptFormat) -> None:
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=len(fmt.tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    engine = TransformersEngine(model, fmt.tokenizer, set(), max_kv_tokens=100)
    with engine.reserving_at_most(1000):
        assert engine.max_kv_tokens == 100  # a cap above what it admits changes nothing
    with engine.reserving_at_most(50):
        assert engine.max_kv_tokens == 50
    with engine.reserving_at_most(0):
        assert engine.max_kv_tokens == 100
    assert engine.max_kv_tokens == 100  # restored


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (0.7, 1.0), (0.6, 0.95), (1.3, 0.3)])
def test_a_batch_of_one_setting_samples_what_rows_of_their_own_settings_sample(
    temperature: float, top_p: float
) -> None:
    from codeloop.engine.sampler import _sample_rows, sample, uniforms

    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 3000, generator=generator) * 3  # [B, V]
    draws = uniforms(torch.arange(16), torch.full((16,), 7))
    params = [SamplingParams(8, temperature, top_p, seed=i) for i in range(16)]
    tokens, logprobs = sample(logits, params, draws)
    row_tokens, row_logprobs = _sample_rows(logits, params, draws)
    assert torch.equal(tokens, row_tokens) and torch.equal(logprobs, row_logprobs)
    if temperature:  # the draws decide: not every row took the most likely token
        assert not torch.equal(tokens, logits.argmax(-1))
