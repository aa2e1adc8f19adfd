"""`codeloop bench rollout`: generation speed of the in-process engine, against baselines run in
the same process on the same model.

The model is SmolLM2-135M-Instruct when the `real` extra is installed (imported from its GGUF
file on first use), a directory given with `--model`, or else a randomly initialised Llama of
`--hidden` x `--layers` (`--model random`).

1. Plain generation: `--requests` requests of exactly `--gen-tokens` sampled tokens
   (temperature 0.6, top-p 0.95, no stop), by transformers' `model.generate` on the whole batch
   (the baseline; `generate_static` with its static cache too, and `generate_batch`, its
   continuous-batching manager, where the installed version has it), by the continuous-batching
   engine (`continuous`, its default: on its slot cache, with captured decoding steps on a GPU
   and the C attention kernel on a CPU where it builds), on a CPU also on transformers'
   DynamicCache (`dynamic_cache`) and on the slots with torch's SDPA (`slots_sdpa`), and by the
   static-batch engine it replaced (`static_engine.py`).
2. The agent workload: `--trajectories` trajectories of `--tool-turns` + 1 turns, each of 1 to
   2 x `--tokens` - 1 sampled tokens (uniform, seeded), every turn but the last ending in a tool
   call (its tokens appended to the sampled ones) that the real local sandbox runs: a
   `time.sleep` of 0 to 2 x `--tool-s` seconds (uniform, seeded per trajectory and turn).
   Overlapped is the agent loop as it is: a trajectory waiting on its tool call leaves the
   engine to the others (on a CPU also on the DynamicCache: `tools_dynamic_cache`). Serialised
   is the baseline where the rollout stops while a tool call
   runs (as a loop that calls its sandbox synchronously does): a call waits for the
   generations in flight to end, and no generation starts until the calls in flight end. The
   static engine runs the overlapped loop too.
3. Physical references: the model's matmul FLOPs per token (2 x its weights, the output layer
   included; attention over the context left out) against the rate the machine reaches on a
   large matmul in `--dtype`, so each row shows its share of that limit; and, since a decoding
   step of a few rows is bound by memory rather than FLOPs, the tokens/s plain generation
   would reach if each step only read the weights and the rows' KV at that machine's memory
   read rate (`bandwidth_bound`).
4. `--dtype bfloat16` runs every row with the model in bfloat16 (the baseline too), and scores
   the tokens the engine sampled in plain generation with the float32 model: the gap between
   the logprobs the engine returned and the float32 ones is what a float32 trainer would see
   in its importance ratios (`--dtype float32` reports the same gap, from batching alone).
5. `--against vllm` runs plain generation and the agent workload again through a live vLLM
   started on the same model (`against_vllm.py`), and each engine's time to a first token.
`--model DIR --random-weights` measures a model's shape (its config and tokenizer) with random
weights: the speed of a step does not depend on the weights' values, and a shape travels where
its weights cannot (a GPU machine without the hub). Prints tokens/s and the ratios; writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import importlib
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from codeloop.bench import against_vllm
from codeloop.bench.static_engine import StaticBatchEngine
from codeloop.config import RolloutConfig, SandboxConfig
from codeloop.data.problems import GSM8K_TRAIN, load_problems
from codeloop.engine.hf_engine import TransformersEngine
from codeloop.engine.model import require_cuda
from codeloop.engine.protocol import Engine, Generation, SamplingParams
from codeloop.engine.sampler import uniforms
from codeloop.engine.stops import STOP_TAIL_TOKENS, finish_reason, stop_completers
from codeloop.helpformat import HelpFormatter, count_or_zero, positive_count
from codeloop.rollout.agent import run_trajectory
from codeloop.rollout.prompt import STOP_STRINGS, PromptFormat
from codeloop.rollout.toolcall import CALL_CLOSE, CALL_OPEN
from codeloop.rollout.tools import ToolExecutor
from codeloop.trainer.profile import device_seconds, op_table, op_times, profiler, raw_events
from codeloop.types import ExecRequest, ExecResult

T = TypeVar("T")
TURN_SEED = 1000  # trajectory i samples turn t with seed i * TURN_SEED + t


class _Gate:
    """Serialised: tool calls wait for running generations to end and hold new ones back."""

    def __init__(self, serialised: bool) -> None:
        self.serialised = serialised
        self.generating = self.tools = 0
        self.changed = asyncio.Condition()

    async def run(self, tool: bool, work: Awaitable[T]) -> T:
        if not self.serialised:
            return await work
        async with self.changed:
            await self.changed.wait_for(lambda: not (self.generating if tool else self.tools))
            self.tools, self.generating = self.tools + tool, self.generating + (not tool)
        try:
            return await work
        finally:
            async with self.changed:
                self.tools, self.generating = self.tools - tool, self.generating - (not tool)
                self.changed.notify_all()


class _ToolCalling:
    """The model samples each turn; every turn but the last ends in a fixed tool call."""

    def __init__(
        self, engine: Engine, fmt: PromptFormat, tool_turns: int, tool_s: float, *, gate: _Gate
    ) -> None:
        self.engine, self.fmt, self.tool_turns, self.tool_s, self.gate = (
            engine,
            fmt,
            tool_turns,
            tool_s,
            gate,
        )
        self.tag_ids = set(fmt.encode(CALL_OPEN) + fmt.encode(CALL_CLOSE))

    def call_ids(self, seed: int) -> list[int]:
        """A call that sleeps uniformly 0 to 2 x `tool_s` (seeded by trajectory and turn)."""
        seconds = random.Random(seed).uniform(0, 2 * self.tool_s)
        code = f"import time\ntime.sleep({seconds:.3f})\nprint('done')"
        return self.fmt.encode(
            CALL_OPEN + '{"name": "execute_python_code_with_standard_io", '
            '"arguments": {"code": ' + json.dumps(code) + "}}" + CALL_CLOSE
        )

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        tokens = random.Random(-(params.seed or 0)).randint(1, 2 * params.max_tokens - 1)
        plain = SamplingParams(tokens, params.temperature, params.top_p, [], params.seed)
        generation = await self.gate.run(False, self.engine.generate(prompt_ids, plain))
        seed = params.seed or 0
        if seed % TURN_SEED >= self.tool_turns:
            return generation
        ids, logprobs, call = generation.token_ids, generation.logprobs, self.call_ids(seed)
        cut = next((i for i, t in enumerate(ids) if t in self.tag_ids), len(ids))  # a random
        return Generation(
            ids[:cut] + call,  # model can sample a tag: keep the call whole
            logprobs[:cut] + [0.0] * len(call),
            "stop",
        )


class _GatedTools:
    def __init__(self, tools: ToolExecutor, gate: _Gate) -> None:
        self.tools, self.gate = tools, gate

    async def execute(self, request: ExecRequest) -> ExecResult:
        result: ExecResult = await self.gate.run(True, self.tools.execute(request))
        return result


async def _measure_tools(
    engine: Engine, fmt: PromptFormat, args: argparse.Namespace, serialised: bool
) -> dict[str, float]:
    from codeloop.sandbox.pool import LocalSandbox

    gate = _Gate(serialised)
    wrapped = _ToolCalling(engine, fmt, args.tool_turns, args.tool_s, gate=gate)
    cfg = RolloutConfig(
        max_response_tokens=100_000, max_turns=args.tool_turns + 1, max_tokens_per_turn=args.tokens
    )
    prompt = fmt.prompt_ids("What is 123 + 456?")
    sandbox_cfg = SandboxConfig(
        workers=args.trajectories, timeout_s=2 * args.tool_s + 10, preload=[]
    )
    async with LocalSandbox(sandbox_cfg) as sandbox:
        tools = _GatedTools(sandbox, gate)
        start = time.perf_counter()
        runs = [
            run_trajectory(
                wrapped,
                tools,
                fmt,
                cfg,
                prompt_id="p",
                sample_index=i,
                prompt_ids=prompt,
                seed=i * TURN_SEED,
            )
            for i in range(args.trajectories)
        ]
        trajectories = await asyncio.gather(*runs)
        seconds = time.perf_counter() - start
    calls = [r for t in trajectories for r in t.tool_calls]
    expected, ok = args.trajectories * args.tool_turns, sum(not r.failed for r in calls)
    if len(calls) != expected or ok != expected:
        failed = next((r.result for r in calls if r.failed), None)
        raise RuntimeError(
            f"{ok} of {len(calls)} tool calls succeeded; expected {expected}; a failure: {failed}"
        )
    sampled = sum(
        sum(m and lp != 0.0 for m, lp in zip(t.loss_mask, t.logprobs, strict=True))
        for t in trajectories
    )
    return {
        "seconds": seconds,
        "trajectories_per_s": args.trajectories / seconds,
        "tokens_per_s": sampled / seconds,
        "tool_calls": len(calls),
    }


TEMPERATURE, TOP_P = 0.6, 0.95  # of plain generation


async def _measure(engine: Engine, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Plain generation's speed, and the generations (`generations`)."""
    start = time.perf_counter()
    calls = [
        engine.generate(p, SamplingParams(tokens, TEMPERATURE, TOP_P, [], i))
        for i, p in enumerate(prompts)
    ]
    done = await asyncio.gather(*calls)
    seconds = time.perf_counter() - start
    sampled = sum(len(g.token_ids) for g in done)
    return {"seconds": seconds, "tokens_per_s": sampled / seconds, "generations": done}


@torch.no_grad()
def logprob_gap(
    reference: Any, prompts: list[list[int]], generations: list[Generation], temperature: float
) -> dict[str, float]:
    """How far the logprobs an engine returned are from `reference`'s on the same tokens
    (each prompt + its generation scored alone, under logits / temperature): the mean and the
    largest absolute difference, and the share of tokens whose ratio exp(difference) leaves
    [0.8, 1.28], the report's clip range (a token there carries no gradient)."""
    gaps = []
    device = next(reference.parameters()).device
    for prompt, generation in zip(prompts, generations, strict=True):
        ids = torch.tensor([prompt + generation.token_ids], device=device)
        logits = reference(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        scored = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        gaps.append(torch.tensor(generation.logprobs) - scored.cpu())
    gap = torch.cat(gaps)
    clipped = (gap.exp() < 0.8) | (gap.exp() > 1.28)
    return {
        "mean_abs": float(gap.abs().mean()),
        "max_abs": float(gap.abs().max()),
        "outside_clip": float(clipped.float().mean()),
        "tokens": gap.numel(),
    }


def host_work(tokenizer: Any, rows: int, steps: int = 50) -> dict[str, float]:
    """The engine's own host work in a decoding step of `rows` agent rows, besides the model's
    and the sampling's kernels (ms a step, averaged over `steps` steps): the draws
    (`uniforms`), and the stop-string checks after a token that can complete one against
    decoding every row's tail. The rows are GSM8K's worked solutions with their calculations
    written as tool calls (the packaged training split, cycled)."""
    solutions = [p.solution for p in load_problems(str(GSM8K_TRAIN))]
    texts = [solutions[i % len(solutions)] for i in range(rows)]
    ids = [
        tokenizer.encode(t.replace("<<", CALL_OPEN).replace(">>", CALL_CLOSE)) * 4 for t in texts
    ]
    params = SamplingParams(1 << 20, stop=[CALL_CLOSE])
    completers = stop_completers(tokenizer, params.stop)
    ends = [STOP_TAIL_TOKENS + step for step in range(steps)]

    def per_step(check: Callable[[int], object]) -> float:
        start = time.perf_counter()
        for end in ends:
            check(end)
        return 1000 * (time.perf_counter() - start) / steps

    seeds = torch.arange(rows)
    return {
        "rows": rows,
        "draws_ms": per_step(lambda end: uniforms(seeds, torch.full((rows,), end))),
        "stops_ms": per_step(
            lambda end: [
                finish_reason(tokenizer, set(), row[:end], params, completers=completers)
                for row in ids
            ]
        ),
        "every_tail_ms": per_step(
            lambda end: [finish_reason(tokenizer, set(), row[:end], params) for row in ids]
        ),
    }


class FreeModel(torch.nn.Module):
    """A causal LM whose forward costs next to nothing: every position's logits are one fixed
    row over the first `vocab` token ids, and its KV is one number a token in one layer. An
    engine around it does all of its own work (admitting rows, the cache's bookkeeping, drawing
    and sampling over `vocab` ids, stop checks, handing tokens back), so its time a decoding
    step is its host time."""

    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # where the engine finds the device
        self.row = torch.randn(vocab, generator=torch.Generator().manual_seed(0))

    def forward(self, input_ids: torch.Tensor, past_key_values: Any = None, **_: Any) -> Any:
        rows, length = input_ids.shape
        kv = torch.zeros(rows, 1, length, 1)  # [B, heads, T, head_dim]
        past_key_values.update(kv, kv, 0)
        return argparse.Namespace(logits=self.row.expand(rows, 1, -1))


def engine_host_ms(tokenizer: Any, rows: int = 256, tokens: int = 128) -> dict[str, float]:
    """The in-process engine's host time per decoding step at `rows` rows (ms), over `tokens`
    steps of a `FreeModel`: `rows` requests of 32 prompt tokens that each sample `tokens`
    tokens with the agent's stop strings, joined in one prefill."""
    engine = TransformersEngine(
        FreeModel(), tokenizer, set(), max_batch=rows, max_kv_tokens=rows * (32 + tokens)
    )
    params = [SamplingParams(tokens, TEMPERATURE, TOP_P, STOP_STRINGS, seed=i) for i in range(rows)]
    prompts = [[3 + (i + j) % 61 for j in range(32)] for i in range(rows)]

    async def generate_all() -> None:
        await asyncio.gather(*(engine.generate(p, q) for p, q in zip(prompts, params, strict=True)))

    began = time.perf_counter()
    asyncio.run(generate_all())
    wall = time.perf_counter() - began
    found = engine.stats().metrics()
    steps = max(found["steps"], 1)
    return {
        "rows": rows,
        "steps": steps,
        "rows_per_step": found["rows_per_step"],
        "step_ms": 1000 * (found["decode_s"] + found["host_s"]) / steps,
        "between_steps_ms": 1000 * found["host_s"] / steps,
        "prefill_ms": 1000 * found["prefill_s"],
        "wall_s": wall,
    }


def profile_generation(
    engine: Engine, prompts: list[list[int]], tokens: int, device: torch.device
) -> str:
    """Plain generation under torch.profiler: a summary line (wall time, and on a GPU the time
    its kernels ran: when that is a small share, the host sets the pace), then the ops that
    took the most of it (the kernels on a GPU; on a CPU the CPU ops, each with the ops it
    calls)."""
    cuda = device.type == "cuda"
    with profiler(device) as prof:
        measured = asyncio.run(_measure(engine, prompts, tokens))
        _sync(device)
    times = op_times(raw_events(prof), device=cuda)
    summary = (
        f"  profiled: {measured['seconds']:.1f} s wall, {measured['tokens_per_s']:.1f} tokens/s"
    )
    if cuda:
        kernels = device_seconds(times)
        summary += (
            f"; GPU kernels {kernels:.1f} s "
            f"({100 * kernels / measured['seconds']:.0f}% of the wall time)"
        )
    return summary + "\n\n" + op_table(times, measured["seconds"])


def _measure_generate(
    model: Any, prompts: list[list[int]], tokens: int, pad_id: int, **options: Any
) -> dict[str, float]:
    """transformers' `generate` on the whole batch, left-padded; `options` go to it (the
    static cache: `cache_implementation="static"`)."""
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # [B, T] left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=True,
        temperature=TEMPERATURE,
        top_p=TOP_P,
        top_k=0,
        pad_token_id=pad_id,
        **options,
    )
    _sync(device)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens_per_s": (out.shape[1] - width) * len(prompts) / seconds}


def _measure_generate_batch(model: Any, prompts: list[list[int]], tokens: int) -> dict[str, float]:
    """transformers' continuous-batching manager (`generate_batch`), sampling as the others;
    its own paged cache and, on a GPU, its captured steps. It may stop a row at the model's
    end-of-sequence token: the tokens it returned are counted."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=tokens, do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, top_k=0
    )
    device = next(model.parameters()).device
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config)
    _sync(device)
    seconds = time.perf_counter() - start
    sampled = sum(len(out.generated_tokens) for out in outputs.values())
    return {"seconds": seconds, "tokens_per_s": sampled / seconds}


def _baseline(name: str, measure: Callable[[], dict[str, float]]) -> dict[str, float] | None:
    """A transformers baseline, or None (and a line saying why) where the installed version
    lacks it or it fails: the engine's rows are still measured."""
    try:
        return measure()
    except Exception as err:  # a baseline of another package: report it, measure the rest
        print(f"  {name:17} not measured: {type(err).__name__}: {str(err)[:200]}", flush=True)
        return None


def _sync(device: torch.device) -> None:
    """Wait for the GPU's queued work, so that a timer measures it (nothing on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _matmul_gflops(dtype: torch.dtype, device: torch.device) -> float:
    """The device's matmul rate on 1024 x 1024 matrices in `dtype` (4096 on a GPU), best of 5:
    a CPU without bfloat16 instructions emulates them, and 2048 x 2048 took minutes."""
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / _best_of_5(lambda: a @ b, device) / 1e9


def _best_of_5(work: Callable[[], object], device: torch.device) -> float:
    """The shortest of five timed runs of `work` (after one untimed), in seconds."""
    work()
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        work()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _read_gbps(device: torch.device) -> float:
    """The device's memory read rate: a sum over 256 MB of float32 (1 GB on a GPU), best of 5."""
    tensor = torch.ones((256 if device.type == "cuda" else 64) * 2**20, device=device)
    return tensor.numel() * 4 / _best_of_5(tensor.sum, device) / 1e9


def bandwidth_bound(
    model: Any, prompts: list[list[int]], tokens: int, read_gbps: float
) -> dict[str, float]:
    """The fastest plain generation of `tokens` per prompt could run if every decoding step
    only read what it must from memory at `read_gbps`: the weights of the linear layers (the
    output layer included) once a step, and each row's keys and values over the batch's
    width (the longest prompt plus the tokens so far); prefill and attention FLOPs left out."""
    config = model.config
    size = next(model.parameters()).element_size()
    weight_bytes = sum(
        m.weight.numel() * size for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    kv_bytes = 2 * config.num_hidden_layers * kv_heads * head_dim * size  # a token of a row
    width = max(len(p) for p in prompts)
    read = sum(weight_bytes + len(prompts) * (width + step) * kv_bytes for step in range(tokens))
    seconds = read / (read_gbps * 1e9)
    return {
        "weight_mb": weight_bytes / 1e6,
        "kv_kb_per_token": kv_bytes / 1e3,
        "read_gbps": read_gbps,
        "seconds": seconds,
        "tokens_per_s": len(prompts) * tokens / seconds,
    }


# Published shapes measured with random weights (`--model NAME`): the speed of a step does not
# depend on the weights' values. Their vocabulary is the model's own (151,936); prompts come from
# SmolLM2's tokenizer (or a trained one), whose ids all lie inside it.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2},
    "qwen2.5-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2},
    # Gemma 3 270M: five local layers (a window of 512) to one global, 262,144 tokens
    "gemma3-270m": {"hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
                    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256},
}  # fmt: skip
QWEN_VOCAB = 151_936
GEMMA3_VOCAB = 262_144


def _shaped(shape: str, args: argparse.Namespace) -> tuple[Any, PromptFormat, str]:
    """A model of a published shape (`SHAPES`: Qwen2.5, Gemma 3) with random weights;
    `--layers` keeps only that many of its layers (a dry run's size)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig, Qwen2Config

    dims = {**SHAPES[shape], **({"num_hidden_layers": args.layers} if args.layers else {})}
    config: Any
    if shape.startswith("gemma3"):
        layers = dims["num_hidden_layers"]
        kinds = [("full" if (i + 1) % 6 == 0 else "sliding") + "_attention" for i in range(layers)]
        config = Gemma3TextConfig(
            vocab_size=GEMMA3_VOCAB,
            sliding_window=512,
            query_pre_attn_scalar=256,
            max_position_embeddings=32_768,
            layer_types=kinds,
            **dims,
        )
    else:
        rope = {"rope_theta": 1e6, "rope_type": "default"}
        config = Qwen2Config(
            vocab_size=QWEN_VOCAB, tie_word_embeddings=True, rope_parameters=rope, **dims
        )
    model = _drawn(AutoModelForCausalLM, config).eval()
    try:
        from codeloop.data.pretrained import PretrainedError, smollm2

        fmt = PromptFormat(AutoTokenizer.from_pretrained(str(smollm2())))
    except PretrainedError:
        from codeloop.data.tokenizer import train_tokenizer

        fmt = PromptFormat(train_tokenizer(["What is 123 + 456? print(123 + 456)"] * 50, 300))
    layers = dims["num_hidden_layers"]
    return model, fmt, f"{shape} shape, random weights ({layers} layers)"


def _drawn(auto: Any, config: Any) -> Any:
    """`auto.from_config(config)` in float32, tied as the config says, each weight matrix drawn
    once from a uniform of the config's standard deviation, biases zero: the constructors' own
    initialisation (torch's, then transformers' normal draws) passes over every weight twice,
    tens of seconds for a 1.5B shape on a CPU."""
    try:
        skipped: Any = importlib.import_module("transformers.initialization").no_init_weights
    except (ImportError, AttributeError):  # transformers 4: its draws run too, then ours
        skipped = contextlib.nullcontext
    torch.manual_seed(0)
    with skipped():
        model = auto.from_config(config, dtype=torch.float32)
    model.tie_weights()  # skipped with the initialisation: the output layer is the embedding
    bound = config.initializer_range * 3**0.5  # a uniform on [-b, b] has deviation b / sqrt(3)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() >= 2:
                weight.uniform_(-bound, bound)
            elif name.endswith("bias"):
                weight.zero_()
    return model


def _load(args: argparse.Namespace) -> tuple[Any, PromptFormat, str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    if args.model in SHAPES:
        return _shaped(args.model, args)
    path = "" if args.model == "random" else args.model
    if path == "smollm2":
        from codeloop.data.pretrained import PretrainedError, smollm2

        try:
            path = str(smollm2())
        except PretrainedError as err:
            print(f"{err}; measuring a random model instead")
            path = ""
    if path and args.random_weights:
        from transformers import AutoConfig

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        shaped = f"{path} (its shape, random weights)"
        return model.float().eval(), PromptFormat(AutoTokenizer.from_pretrained(path)), shaped
    if path:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model.eval(), PromptFormat(AutoTokenizer.from_pretrained(path)), path
    from codeloop.data.tokenizer import train_tokenizer

    fmt = PromptFormat(train_tokenizer(["What is 123 + 456? print(123 + 456)"] * 50, 300))
    hidden, layers = args.hidden or 256, args.layers or 4
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fmt.tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    model = AutoModelForCausalLM.from_config(config)  # random weights: speed, not quality
    return model.eval(), fmt, f"random {layers} x {hidden}"


def _print(name: str, row: dict[str, float], peak_gflops: float) -> None:
    share = 100 * row["gflops"] / peak_gflops
    print(
        f"  {name:17} {row['tokens_per_s']:8.1f} tokens/s  {row['gflops']:6.1f} GFLOP/s "
        f"({share:4.1f}% of the matmul rate)  {row['seconds']:6.1f} s"
        + (f" (first run, compiling: {row['compile_s']:.1f} s)" if "compile_s" in row else ""),
        flush=True,
    )


def _print_stats(engine: Engine) -> dict[str, float]:
    """The engine's own counters (`EngineStats`) under its row; returns them for the report."""
    if not isinstance(engine, TransformersEngine):
        return {}
    found = engine.stats().metrics()
    busy = found["prefill_s"] + found["decode_s"] + found["mixed_s"] + found["host_s"]
    print(
        f"    {found['steps']:.0f} steps of {found['rows_per_step']:.1f} rows sampled, "
        f"{found['mixed_steps']:.0f} of them with prompt tokens mixed in; "
        f"{found['prefills']:.0f} prefills of {found['prefill_tokens']:.0f} tokens, "
        f"{found['fed_tokens']:.0f} prompt tokens fed through steps, "
        f"{100 * found['prefix_reuse']:.0f}% of prompt tokens from the prefix cache or copied; "
        f"time in prefill {found['prefill_s']:.2f} s, decoding {found['decode_s']:.2f} s, "
        f"mixed steps {found['mixed_s']:.2f} s, between steps {found['host_s']:.2f} s "
        f"({100 * found['host_s'] / max(busy, 1e-9):.0f}%); {found['graphs']:.0f} graphs captured",
        flush=True,
    )
    return found


def _plain_rows(
    model: Any,
    fmt: PromptFormat,
    prompts: list[list[int]],
    args: argparse.Namespace,
    *,
    cpu: bool,
    record: Callable[[str, Any], None],
    record_stats: Callable[[str, Any], None],
    sampled: list[Generation],
) -> None:
    """Plain generation by transformers' baselines and the engines, each run `--repeat` times
    (the last one recorded: the first pays compilation and graph capture)."""
    pad_id = fmt.tokenizer.pad_token_id or 0
    tokens = args.gen_tokens
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # its notices
    baselines: dict[str, Callable[[], dict[str, float]]] = {
        "generate": lambda: _measure_generate(model, prompts, tokens, pad_id),
        "generate_static": lambda: _measure_generate(
            model, prompts, tokens, pad_id, cache_implementation="static"
        ),
        "generate_batch": lambda: _measure_generate_batch(model, prompts, tokens),
    }
    for name, measure in baselines.items():
        if name != "generate" and name not in args.baselines.split(","):
            continue
        if cpu and name == "generate_batch":  # 8.8 s for 8 x 32 tokens of a tiny model, 23x
            continue  # slower than generate on a 2-core EPYC: a GPU's baseline
        # `generate` compiles nothing: a short warm-up, then one timed run (a minute on a GPU
        # at 256 x 512); the others may compile on their first run, which `--repeat` leaves out
        if name == "generate":
            _measure_generate(model, prompts[:2], 2, pad_id)
        for _ in range(1 if name == "generate" else args.repeat):
            measured = _baseline(name, measure)
        if measured is not None:
            record(name, measured)
    engines: dict[str, Engine] = {
        "continuous": TransformersEngine(
            model, fmt.tokenizer, set(), args.max_batch, step_tokens=args.step_tokens
        )
    }
    if args.compile and not cpu:  # its first run compiles: `compile_s` is that run's time
        engines["continuous_compiled"] = TransformersEngine(
            model, fmt.tokenizer, set(), args.max_batch, compile_backend=args.compile
        )
    # on a GPU the static engine samples row by row: minutes for 256 x 512 tokens
    if cpu and not args.quick:  # the CPU's other KV caches and attentions
        engines["dynamic_cache"] = TransformersEngine(
            model, fmt.tokenizer, set(), args.max_batch, slot_cache=False
        )
        engines["slots_sdpa"] = _slots_with_sdpa(model, fmt, args.max_batch)
        engines["static"] = StaticBatchEngine(model, fmt.tokenizer, set(), args.max_batch)
    for name, engine in engines.items():
        first_s = 0.0
        for _ in range(max(args.repeat, 2 if name == "continuous_compiled" else 1)):
            began = time.perf_counter()
            timed = asyncio.run(_measure(engine, prompts, tokens))
            first_s = first_s or time.perf_counter() - began
        if name == "continuous_compiled":
            timed["compile_s"] = first_s
        if name == "continuous":  # the recorded run's tokens, for the logprob gap
            sampled += timed.pop("generations")
        record(name, {k: v for k, v in timed.items() if k != "generations"})
        record_stats(name, _print_stats(engine))


def _slots_with_sdpa(model: Any, fmt: PromptFormat, max_batch: int) -> TransformersEngine:
    """The engine on its slots with torch's SDPA for attention instead of the C kernel."""
    engine = TransformersEngine(model, fmt.tokenizer, set(), max_batch, slot_cache=True)
    assert engine.slots is not None
    engine.slots.kernel = None
    return engine


def _ratios(rows: dict[str, Any]) -> dict[str, float]:
    """The speed ratios between the rows measured."""

    def speed(name: str) -> float:
        return float(rows[name]["tokens_per_s"])

    best = max(
        (r for r in ("generate", "generate_static", "generate_batch") if r in rows), key=speed
    )
    ratios = {
        "continuous / generate": speed("continuous") / speed("generate"),
        f"continuous / best of transformers ({best})": speed("continuous") / speed(best),
    }
    if "continuous_compiled" in rows:
        ratios["compiled / continuous"] = speed("continuous_compiled") / speed("continuous")
    for other in ("dynamic_cache", "slots_sdpa", "static"):
        if other in rows:
            ratios[f"continuous / {other}"] = speed("continuous") / speed(other)
    if "tools_dynamic_cache" in rows:
        ratios["agent: continuous / dynamic_cache"] = speed("tools_overlapped") / speed(
            "tools_dynamic_cache"
        )
    if "tools_static" in rows:
        ratios["agent: continuous / static"] = speed("tools_overlapped") / speed("tools_static")
    if "tools_serialised" in rows:
        serialised = speed("tools_serialised")
        ratios["agent: overlapped / serialised"] = speed("tools_overlapped") / serialised
    ratios["agent: overlapped / plain continuous"] = speed("tools_overlapped") / speed("continuous")
    if "tools_separate" in rows:
        separate = speed("tools_separate")
        ratios["agent: mixed steps / separate prefills"] = speed("tools_overlapped") / separate
    if "tools_unpacked" in rows:
        unpacked = speed("tools_unpacked")
        ratios["agent: packed weights / unpacked"] = speed("tools_overlapped") / unpacked
    if "tools_prefilled" in rows:
        prefilled = speed("tools_prefilled")
        ratios["agent: turns fed / turns prefilled"] = speed("tools_overlapped") / prefilled
    if "vllm" in rows:
        ratios["plain: codeloop / vLLM"] = speed("continuous") / speed("vllm")
        ratios["agent: codeloop / vLLM"] = speed("tools_overlapped") / speed("vllm_tools")
    if "tools_joins_at_once" in rows:
        at_once = speed("tools_joins_at_once")
        batched = speed(next(r for r in ("tools_prefilled", "tools_overlapped") if r in rows))
        ratios["agent: joins batched / joins at once"] = batched / at_once
    return ratios


def _diagnostics(
    reference: Any,
    fmt: PromptFormat,
    prompts: list[list[int]],
    sampled: list[Generation],
    *,
    max_batch: int,
) -> dict[str, Any]:
    """The logprob gap against float32 scoring, the engine's host work a step, and its host
    time a step with a model that costs nothing, each printed."""
    gap = logprob_gap(reference, prompts, sampled, TEMPERATURE)
    print(
        f"  the engine's logprobs against float32 scoring of the same {gap['tokens']} tokens: "
        f"mean |diff| {gap['mean_abs']:.4f}, max {gap['max_abs']:.3f}, "
        f"{100 * gap['outside_clip']:.2f}% outside the clip range",
        flush=True,
    )
    host = host_work(fmt.tokenizer, max_batch)
    print(
        f"  the engine's host work a step at {host['rows']} rows: draws {host['draws_ms']:.2f} "
        f"ms, stop checks {host['stops_ms']:.2f} ms (decoding every row's tail "
        f"{host['every_tail_ms']:.2f} ms: {host['every_tail_ms'] / host['stops_ms']:.1f}x)",
        flush=True,
    )
    free = engine_host_ms(fmt.tokenizer)
    print(
        f"  the engine's host time a decoding step at {free['rows']} rows of a model that "
        f"costs nothing: {free['step_ms']:.2f} ms ({free['between_steps_ms']:.2f} ms between "
        f"steps; {free['steps']:.0f} steps of {free['rows_per_step']:.0f} rows)",
        flush=True,
    )
    return {"logprob_gap": gap, "host_work": host, "host_time": free}


def _against_vllm(
    reference: Any,
    engine: TransformersEngine,
    fmt: PromptFormat,
    prompts: list[list[int]],
    args: argparse.Namespace,
    record: Callable[[str, Any], None],
) -> tuple[dict[str, float], dict[str, Any]]:
    """vLLM's rows (`against_vllm.py`), recorded; returns the first-token seconds of both
    engines and what else vLLM's run reported."""
    with torch.no_grad():
        ours = asyncio.run(against_vllm.first_token_s(engine, fmt))
    print(f"  first token, idle    codeloop {1000 * ours:7.1f} ms", flush=True)

    async def plain(server: Engine) -> dict[str, Any]:
        timed = await _measure(server, prompts, args.gen_tokens)
        return {k: v for k, v in timed.items() if k != "generations"}

    async def agent(server: Engine) -> dict[str, Any]:
        return await _measure_tools(server, fmt, args, False)

    print(f"vLLM ({args.vllm_python or 'make vllm'}'s), the same work:", flush=True)
    served = against_vllm.measure_vllm(reference, fmt, prompts, args, plain=plain, agent=agent)
    for row, measured in served.pop("rows").items():
        record(row, measured)
    theirs = served.pop("first_token_s")
    print(f"  first token, idle    vLLM     {1000 * theirs:7.1f} ms", flush=True)
    return {"codeloop": ours, "vllm": theirs}, served


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="codeloop bench rollout",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="smollm2",
        help="a model directory, smollm2 (if installed), random (--hidden x --layers), or a "
        f"published shape with random weights ({', '.join(SHAPES)})",
    )
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="with a model directory: its config and tokenizer, random weights",
    )
    parser.add_argument(
        "--baselines",
        default="generate_static,generate_batch",
        help="transformers' baselines beside generate, comma-separated "
        "(generate_batch runs on a GPU only)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        choices=range(1, 10),
        metavar="N",
        help="plain generation: runs of each row, the last one timed (2 on a "
        "GPU leaves compilation and graph capture out)",
    )
    parser.add_argument(
        "--compile",
        default="",
        metavar="BACKEND",
        help="on a GPU, also the engine with its decoding steps compiled by torch.compile "
        "with this backend (inductor): the continuous_compiled row, its first run's seconds "
        "(compilation included) as compile_s",
    )
    parser.add_argument("--hidden", type=positive_count, help="random model: width (default 256)")
    parser.add_argument(
        "--layers",
        type=positive_count,
        help="random model: layers (default 4); a shape: keep this many",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the engine's plain and agent rows beside transformers' baselines: no slot "
        "cache or static engine on a CPU, no serialised or joins-at-once agent baselines, "
        "logprob gap, host-work or free-model measurements",
    )
    parser.add_argument(
        "--requests", type=positive_count, default=16, help="plain generation: requests"
    )
    parser.add_argument(
        "--gen-tokens", type=positive_count, default=128, help="plain generation: tokens"
    )
    parser.add_argument(
        "--trajectories", type=positive_count, default=16, help="agent workload: trajectories"
    )
    parser.add_argument(
        "--tokens", type=positive_count, default=32, help="mean sampled tokens per turn"
    )
    parser.add_argument("--max-batch", type=positive_count, default=32, help="the engines' rows")
    parser.add_argument(
        "--step-tokens",
        type=count_or_zero,
        default=None,
        help="the tokens one engine step forwards, decoding and prompt chunks together "
        "(default: the engine's; 0: separate prefills)",
    )
    parser.add_argument("--tool-turns", type=int, default=2, help="tool calls per trajectory")
    parser.add_argument("--tool-s", type=float, default=1.0, help="mean seconds of a tool call")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the model's dtype in every row (bfloat16 pays on CPUs with AMX-BF16 or AVX512-BF16)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the model runs (auto: the GPU when there is one)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also run plain generation once more under torch.profiler: the "
        "kernels that take the GPU's time and the GPU's busy share (on a "
        "CPU, the ops), written beside --out",
    )
    parser.add_argument("--out", default="bench-results/rollout.json", help="JSON report")
    against_vllm.add_arguments(parser)
    args = parser.parse_args(argv)

    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    if device.type == "cuda":
        require_cuda("--device cuda", ", or measure on the CPU (--device cpu)")
    reference, fmt, name = _load(args)
    reference.to(device)
    dtype = getattr(torch, args.dtype)
    model = reference if dtype == torch.float32 else copy.deepcopy(reference).to(dtype)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    flops_per_token = 2 * weights
    peak = _matmul_gflops(dtype, device)
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{torch.get_num_threads()} CPU threads"
    )
    print(
        f"model: {name} in {args.dtype}; {flops_per_token / 1e6:.0f} MFLOP per token; "
        f"{args.dtype} matmul rate {peak:.0f} GFLOP/s on {where}"
    )
    questions = [f"What is {17 * i + 3} times {i + 11}? Explain." for i in range(args.requests)]
    prompts = [fmt.prompt_ids(q) for q in questions]
    rows: dict[str, Any] = {}

    def record(row: str, measured: dict[str, float]) -> None:
        rows[row] = {**measured, "gflops": measured["tokens_per_s"] * flops_per_token / 1e9}
        _print(row, rows[row], peak)

    def record_stats(row: str, found: dict[str, float]) -> None:
        if found:
            rows[row]["engine"] = found

    print(f"plain generation: {args.requests} requests x {args.gen_tokens} tokens", flush=True)
    sampled: list[Generation] = []
    cpu = device.type == "cpu"
    with torch.no_grad():
        _plain_rows(
            model,
            fmt,
            prompts,
            args,
            cpu=cpu,
            record=record,
            record_stats=record_stats,
            sampled=sampled,
        )
    if args.profile:
        engine = TransformersEngine(model, fmt.tokenizer, set(), args.max_batch)
        try:
            with torch.no_grad():
                profiled = profile_generation(engine, prompts, args.gen_tokens, device)
        except Exception as err:  # noqa: BLE001 - torch's profiler differs between versions
            profiled = f"  no profile: {err!r}"  # the rows after it still run
        text = Path(args.out).with_suffix(".profile.txt")
        text.parent.mkdir(parents=True, exist_ok=True)
        text.write_text(profiled)
        print(profiled.split("\n\n")[0] + f" (the ops: {text})", flush=True)
    bound = bandwidth_bound(model, prompts, args.gen_tokens, _read_gbps(device))
    print(
        f"  memory-bound limit {bound['tokens_per_s']:8.1f} tokens/s: each step reads the "
        f"weights ({bound['weight_mb']:.0f} MB) and every row's KV "
        f"({bound['kv_kb_per_token']:.0f} KB a token) at {bound['read_gbps']:.0f} GB/s; "
        f"continuous at {100 * rows['continuous']['tokens_per_s'] / bound['tokens_per_s']:.0f}%"
        f", generate at {100 * rows['generate']['tokens_per_s'] / bound['tokens_per_s']:.0f}%",
        flush=True,
    )
    found = (
        {}
        if args.quick
        else _diagnostics(reference, fmt, prompts, sampled, max_batch=args.max_batch)
    )
    print(
        f"agent workload: {args.trajectories} trajectories, {args.tool_turns} tool calls each "
        f"of {args.tool_s} s on average",
        flush=True,
    )

    def agent_row(
        row: str,
        serialised: bool,
        join_wait: int | None = None,
        feed: int | None = None,
        slots: bool | None = None,
        step: int | None = None,
        pack: bool | None = None,
    ) -> TransformersEngine:
        engine = TransformersEngine(
            model,
            fmt.tokenizer,
            set(),
            args.max_batch,
            join_wait_steps=join_wait,
            feed_tokens=feed,
            slot_cache=slots,
            step_tokens=args.step_tokens if step is None else step,
            pack_weights=pack,
        )
        with torch.no_grad():
            record(row, asyncio.run(_measure_tools(engine, fmt, args, serialised)))
        record_stats(row, _print_stats(engine))
        return engine

    overlapped = agent_row("tools_overlapped", False)
    if not args.quick:
        agent_row("tools_serialised", True)
    if overlapped.step_tokens:  # the baseline of separate prefills, kept by --quick too
        agent_row("tools_separate", False, step=0)
    elif overlapped.feed_tokens:  # the baseline of fed turns, kept by --quick too
        agent_row("tools_prefilled", False, feed=0)
    if overlapped.slots and overlapped.slots.packed:  # the baseline of weights as the model's
        agent_row("tools_unpacked", False, pack=False)
    if overlapped.join_wait_steps and not args.quick:
        agent_row("tools_joins_at_once", False, 0, feed=0)  # the baseline of batched joins
    if cpu and not args.quick:
        agent_row("tools_dynamic_cache", False, slots=False)
        static = StaticBatchEngine(model, fmt.tokenizer, set(), args.max_batch)
        with torch.no_grad():
            record("tools_static", asyncio.run(_measure_tools(static, fmt, args, False)))
    first_token: dict[str, float] = {}
    if args.against == "vllm":
        first_token, served = _against_vllm(reference, overlapped, fmt, prompts, args, record)
        found["vllm"] = served
    ratios = _ratios(rows)
    if first_token:
        ratios["first token: vLLM s / codeloop s"] = first_token["vllm"] / first_token["codeloop"]
    for ratio_name, ratio in ratios.items():
        print(f"  {ratio_name:52} {ratio:5.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = {
        "args": vars(args),
        "model": name,
        "device": where,
        "flops_per_token": flops_per_token,
        "matmul_gflops": peak,
        "memory_bound": bound,
        "rows": rows,
        "ratios": ratios,
        "first_token_s": first_token,
        **found,
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0
