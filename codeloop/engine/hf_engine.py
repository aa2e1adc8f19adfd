"""An in-process engine on a transformers causal LM, with continuous batching.

Every step serves every running request. On slots with the CPU attention kernel a step is
mixed (`step_tokens`, step_plan.py): one forward of every decoding row's next token and, within
one token budget, chunks of the prompts still going in, so a request that arrives (a new prompt,
or a trajectory's next turn) takes a slot at the next step with its cached prefix and never
stalls the rows that are decoding. Elsewhere a request joins at the next step with its prompt
prefilled (together with the others that arrived meanwhile) and its KV cache merged into the
running batch, which then decodes one token for every row. A request is fitted to the model's
context (`context_tokens`): its `max_tokens` cut to the room its prompt leaves, a prompt that
fills it `ContextExceeded`, as a server's 400. A row leaves
the moment it stops, and its slot and KV memory go to the next request; a trajectory's next turn
(after its tool call) therefore never waits for the rest of a batch. Admission is capped by
`max_batch` running requests and by `max_kv_tokens`: a request reserves its prompt plus its
`max_tokens` (as the kv_aware scheduler does), so a running request is never preempted. Unset
(0), `max_kv_tokens` is what a quarter of the memory free at start holds (`default_kv_tokens`),
and the engine reports it as `kv_capacity_tokens` to the scheduler.

The batch's KV cache is one of two. For Llama-family and Gemma 3 models, a cache of fixed slots
with a decoding step of static shapes (`slot_cache.py`): on a GPU captured as CUDA graphs and
replayed in one launch a step (transformers' forward driven one step at a time from Python
leaves a GPU waiting on the host); on a CPU run eagerly, its attention by a C kernel
(`cpu_attention.py`) that reads each row's own columns. Elsewhere (other models, or a CPU where
the kernel cannot be built), transformers' own `DynamicCache`, left-padded (`kv_batch.py`),
which measured faster than the slots' eager step with torch's attention on a CPU. `slot_cache`
chooses. A finished request leaves its KV in a prefix cache (`prefix_cache_tokens`, most
recently used first), so a trajectory's next turn and the other samples of a prompt prefill only
their new tokens; identical prompts in one prefill are computed once; new weights empty it. On
the slot path without mixed steps (with graphs, or `step_tokens=0`), a request with at most
`feed_tokens` tokens not in that cache (a trajectory's next turn: its tool's output and the turn
markers) is not prefilled at all: it takes a slot at the next step with its cached KV, and its
remaining tokens go through the decoding steps, one a step beside the running rows, its logits
unread until the last one is in.
transformers' continuous-batching manager (`generate_batch`, paged attention) measured at a
fraction of `generate`'s speed on 2-core CPUs and at 0.4x on an H200 (docs/benchmarks.md), which
is why this is hand-written.

Sampling is `sampler.py`'s, and the stop check `stops.py`'s. `update_weights`
copies new weights in place between steps and advances `version`; each token's
`Generation.versions` entry says which weights sampled it, so a request that spans an update
(a partial rollout) is told apart token by token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import DynamicCache

from codeloop.config import RolloutConfig
from codeloop.engine.attention import use_decode_attention
from codeloop.engine.kv_batch import KVBatch, PrefixCache
from codeloop.engine.model import end_of_turn_ids
from codeloop.engine.protocol import ContextExceeded, Generation, SamplingParams
from codeloop.engine.sampler import SEEDS, uniforms
from codeloop.engine.slot_cache import (
    MIN_COLUMNS,
    SlotBatch,
    SlotDecoder,
    cpu_kernel,
    unsupported_reason,
)
from codeloop.engine.step_plan import followers, plan_step
from codeloop.engine.stops import Completers, finish_reason, stop_completers
from codeloop.errors import ModelError
from codeloop.memory import free_memory, trim_when_above


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[Generation]
    seed: int  # of its draws (`uniforms`)
    completers: Completers | None  # of its stop strings (`stop_completers`), looked up once
    arrived_step: int  # the engine's decoding steps when it was queued
    to_feed: int = 0  # prompt tokens still to go into its slot through decoding steps
    follows: _Request | None = None  # a request whose slot will hold `shared` of its tokens
    shared: int = 0
    uncached: int | None = None  # prompt tokens the prefix cache lacked when first looked at
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_versions: list[int] = field(default_factory=list)
    finish: Literal["stop", "length"] | None = None

    @property
    def reserved_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens


@dataclass
class EngineStats:
    """What an engine did since it was made (`TransformersEngine.stats`): decoding steps and
    the rows they decoded, prefills and the prompt tokens they computed or took from the
    prefix cache, and where the time went. `prefill_s` and `decode_s` end at the step's one
    device synchronisation (the sampled tokens' copy to the host), so on a GPU they hold the
    device's work; `host_s` is the time between steps (results handed out, requests taken).
    A prefix shared by the prompts of one prefill is computed once and counted as served."""

    steps: int = 0
    rows_decoded: int = 0
    prefills: int = 0
    prefill_tokens: int = 0  # not served from the prefix cache (identical prompts once)
    fed_tokens: int = 0  # prompt tokens fed through decoding steps instead of a prefill
    reused_tokens: int = 0  # served from the prefix cache
    shared_tokens: int = 0  # copied from another request's slot (`step_plan.followers`)
    mixed_steps: int = 0  # steps that carried prompt tokens beside the decoding ones
    prefill_s: float = 0.0
    decode_s: float = 0.0
    mixed_s: float = 0.0  # in steps that carried prompt tokens (decoding too)
    host_s: float = 0.0
    graphs: int = 0

    def since(self, earlier: EngineStats) -> EngineStats:
        """What was done after `earlier` (an earlier `stats()` of the same engine)."""
        return EngineStats(**{k: v - getattr(earlier, k) for k, v in vars(self).items()})

    def __add__(self, other: EngineStats) -> EngineStats:
        return EngineStats(**{k: v + getattr(other, k) for k, v in vars(self).items()})

    def metrics(self) -> dict[str, float]:
        """Flat figures for logs and the bench: the counters, mean rows per step, and the
        share of prompt tokens served from the cache."""
        reused = self.reused_tokens + self.shared_tokens
        prompt = self.prefill_tokens + self.fed_tokens + reused
        return {
            "steps": self.steps,
            "prefills": self.prefills,
            "prefill_tokens": self.prefill_tokens,
            "fed_tokens": self.fed_tokens,
            "reused_tokens": self.reused_tokens,
            "shared_tokens": self.shared_tokens,
            "mixed_steps": self.mixed_steps,
            "rows_per_step": self.rows_decoded / max(self.steps, 1),
            "prefix_reuse": reused / prompt if prompt else 0.0,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "mixed_s": self.mixed_s,
            "host_s": self.host_s,
            "graphs": self.graphs,
        }


TRIM_EVERY_STEPS = 32  # decoding steps between checks that freed memory goes back (memory.py)
KV_MEMORY_SHARE = 0.25  # of the memory free when an engine starts, for its KV cache
PREFIX_CACHE_TOKENS = 32768  # the prefix cache without slots (a CPU's DynamicCache path)
# On the slot path with graphs, queued requests join in batches: every prefill is an eager
# forward of the whole model (hundreds of kernel launches) whatever its rows, and with 256
# trajectories in flight about two turns end every step. They join once a sixteenth of
# `max_batch` of them can (free slots and queued requests both), or when JOIN_WAIT_STEPS
# decoding steps have passed since the last join (not since the oldest arrival, which with a
# long queue has always passed): at most one prefill in JOIN_WAIT_STEPS steps beside the full
# batches.
JOIN_WAIT_STEPS = 8
JOIN_SHARE = 16
# On the slot path a request with at most FEED_TOKENS prompt tokens not in the prefix cache joins
# at the next step without a prefill: those tokens are fed through the decoding steps, one a
# step (a replayed step costs about the same for any rows up to its captured size). A prefill
# took ~53 ms on an H200 and ~95 ms on an H100 (an eager forward) against ~8-10 ms a step, and a
# returning turn brings ~40 new tokens. On a 2-core CPU a prefill beside 48 running rows took
# ~250 ms; 128 trajectories of one tool call each on SmolLM2 ran at 1.41 trajectories/s with
# turns fed and 1.26 with every turn prefilled (one run each).
FEED_TOKENS = 64
# The tokens one mixed step forwards (step_plan.py): the decoding rows' and, in what is left,
# prompt chunks. SmolLM2's agent workload (64 trajectories, bfloat16, 2-core AMD EPYC) ran at
# 143, 155 and ~150 tokens/s at 128, 256 and 512-2,048 (one or two runs each, +-10% between
# runs of one setting), against 126-140 with separate prefills; float32 at 512: 77 and 86
# against 62 and 69.
STEP_TOKENS = 512


def default_kv_tokens(model: Any) -> int:
    """The KV tokens that fit in KV_MEMORY_SHARE of the memory free now (the GPU's when the
    model is on one, else the machine's): 2 (keys, values) x layers x KV heads x head size x
    the model's bytes per value per token."""
    config = model.config
    layers = getattr(config, "num_hidden_layers", 0)
    heads = getattr(config, "num_attention_heads", 0)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // max(heads, 1)
    parameter = next(model.parameters())
    per_token: int = 2 * layers * kv_heads * head_dim * parameter.element_size()
    return max(1, int(KV_MEMORY_SHARE * free_memory(parameter.device)) // max(per_token, 1))


def _cpu_slots_fit(model: Any, rows: int, longest_response: int) -> bool:
    """Whether a CPU engine takes its slots (with the attention kernel, `cpu_kernel`): only when
    `rows` slots of `longest_response` tokens fit in half the free memory (each slot is as
    long as the longest request, though its pages (a memory map) cost only once written; the
    DynamicCache grows with what is used)."""
    if cpu_kernel(model) is None:
        return False
    columns = MIN_COLUMNS  # as SlotDecoder.ensure_columns grows them
    while columns < longest_response:
        columns *= 2
    return rows * columns <= 2 * default_kv_tokens(model)  # KV_MEMORY_SHARE is a quarter


def engine_from_config(
    model: Any, tokenizer: Any, rollout: RolloutConfig, *, longest_response: int = 0
) -> TransformersEngine:
    """The in-process engine `rollout` describes (`engine_max_batch`, `kv_capacity_tokens`, on a
    CPU `engine_step_tokens`) over `model` as it is (device, dtype), stopping at the
    tokenizer's turn ends (`end_of_turn_ids`); its KV slots planned for `longest_response`
    tokens now (`plan`: one that cannot fit is refused here; 0: planned by the first
    requests). On a CPU the slots are taken only with a plan that fits (`_cpu_slots_fit`),
    else the DynamicCache. `codeloop serve`, training and evaluation all build their engine
    here."""
    slots, step_tokens = None, None  # the engine's choice
    if next(model.parameters()).device.type == "cpu":
        slots = bool(longest_response) and _cpu_slots_fit(
            model, rollout.engine_max_batch, longest_response
        )
        step_tokens = rollout.engine_step_tokens if slots and cpu_kernel(model) else 0
    engine = TransformersEngine(
        model,
        tokenizer,
        end_of_turn_ids(tokenizer),
        max_batch=rollout.engine_max_batch,
        max_kv_tokens=rollout.kv_capacity_tokens,
        slot_cache=slots,
        step_tokens=step_tokens,
    )
    if longest_response:
        engine.plan(longest_response)
    return engine


def check_weights(state: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]) -> None:
    """A `ModelError` unless every tensor of `state` names a parameter of `targets`, has its
    shape, is floating point (another floating dtype is cast on copy) and is finite (read in one
    pass, with one device sync for the lot: the in-process engine checks every RL step's)."""
    for name, tensor in state.items():
        target = targets.get(name)
        if target is None:
            raise ModelError(f"bad weights: the model has no parameter {name!r}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelError(
                f"bad weights: {name} has shape {tuple(tensor.shape)}, the model's is "
                f"{tuple(target.shape)}"
            )
        if not tensor.is_floating_point():
            raise ModelError(f"bad weights: {name} is {tensor.dtype}, not floating point")
    if not state:
        return
    device = next(iter(state.values())).device
    finite = torch.stack([torch.isfinite(t).all().to(device) for t in state.values()])
    if not bool(finite.all()):
        name = list(state)[int((~finite).nonzero()[0])]
        raise ModelError(f"bad weights: {name} holds a NaN or an infinity")


class TransformersEngine:
    """`Engine` over a `transformers` model; see the module docstring."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        stop_token_ids: Iterable[int],
        max_batch: int = 64,
        *,
        max_kv_tokens: int = 0,
        prefix_cache_tokens: int | None = None,
        batch_window_ms: float = 5.0,
        step_in_thread: bool | None = None,
        slot_cache: bool | None = None,
        join_wait_steps: int | None = None,
        feed_tokens: int | None = None,
        step_tokens: int | None = None,
        compile_backend: str = "",
        pack_weights: bool | None = None,
    ) -> None:
        self.model = model.eval()
        # The KV cache: slots with a static decoding step (slot_cache.py; CUDA graphs on a GPU,
        # the C attention kernel on a CPU), or transformers' DynamicCache (kv_batch.py). None:
        # slots where the model's family is supported, on a CPU only with the kernel (without
        # it the DynamicCache path measured faster there).
        on_gpu = next(model.parameters()).device.type == "cuda"
        if slot_cache is None:
            supported = unsupported_reason(model) is None
            slot_cache = supported and (on_gpu or cpu_kernel(model) is not None)
        # `compile_backend` ("inductor" on a GPU): the slots' decoding steps compiled by
        # `torch.compile` (fused kernels; the first steps of each shape pay the compilation).
        # `pack_weights`: on a CPU the slots' matrix products use weights packed for oneDNN
        # (cpu_linear.py); None: where this torch can.
        self.slots = (
            SlotDecoder(model, max_batch, compile_backend=compile_backend, pack=pack_weights)
            if slot_cache
            else None
        )
        use_decode_attention(model)  # on a CPU: decoding steps without SDPA (attention.py)
        # Where a step runs. None: on a GPU a worker thread, so the event loop runs while the
        # GPU computes; on a CPU the event loop's own thread, blocked for the step (tool calls
        # run in sandbox processes meanwhile; results and new requests are taken between
        # steps). torch's CPU kernels run on OpenMP (libgomp) teams, and once the main thread
        # has one (loading a model starts it), a team started from another thread puts more
        # threads than cores on the machine, so libgomp sleeps between parallel regions
        # instead of spinning: a SmolLM2 decoding step of 16 rows took 55 ms on the main thread
        # and 83 ms on a worker thread (2-core AMD EPYC, bfloat16; 86 and 111 ms in float32).
        self.step_in_thread = (
            next(model.parameters()).device.type != "cpu"
            if step_in_thread is None
            else step_in_thread
        )
        self.tokenizer = tokenizer
        self.stop_token_ids = set(stop_token_ids)
        self.max_batch = max_batch
        self.max_kv_tokens = max_kv_tokens or default_kv_tokens(model)
        self.batch_window_s = batch_window_ms / 1000
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.version = 0  # of the weights: update_weights advances it
        # the most tokens a sequence may hold (the model's positions): a request is fitted to it
        config = getattr(model, "config", None)
        self.context_tokens = int(getattr(config, "max_position_embeddings", None) or (1 << 20))
        self._queue: list[_Request] = []
        self._running: list[_Request] = []
        self._batch: KVBatch | SlotBatch | None = None
        # The prefix cache. None: on slots as many tokens as the engine admits (a returning
        # turn of any trajectory in flight finds its KV), else PREFIX_CACHE_TOKENS.
        if prefix_cache_tokens is None:
            prefix_cache_tokens = self.max_kv_tokens if self.slots else PREFIX_CACHE_TOKENS
        self.prefixes = PrefixCache(prefix_cache_tokens)
        # Decoding steps a joining request may wait for others (JOIN_WAIT_STEPS); None: that
        # on slots with graphs, 0 (join at the next step) elsewhere.
        if join_wait_steps is None:
            join_wait_steps = JOIN_WAIT_STEPS if self.slots and self.slots.graphs_on else 0
        self.join_wait_steps = join_wait_steps
        # The most uncached prompt tokens fed through decoding steps rather than prefilled
        # (FEED_TOKENS); None: that on slots with graphs or the CPU kernel, 0 (every join
        # prefilled) elsewhere.
        if feed_tokens is None:
            fast = self.slots and (self.slots.graphs_on or self.slots.kernel is not None)
            feed_tokens = FEED_TOKENS if fast else 0
        self.feed_tokens = feed_tokens if self.slots else 0
        # The tokens a step forwards, decoding and prompt chunks together (STEP_TOKENS,
        # step_plan.py); None: that on slots with the CPU kernel, 0 elsewhere (a step decodes,
        # and joins are prefilled or fed as above).
        if step_tokens is None:
            step_tokens = STEP_TOKENS if self.slots and self.slots.kernel is not None else 0
        self.step_tokens = step_tokens if self.slots else 0
        self._last_join_step = -join_wait_steps  # the decoding steps when requests last joined
        self._stats = EngineStats()
        self._worker: asyncio.Task[None] | None = None
        self._weights_lock = threading.Lock()
        self._seeds = torch.Generator().manual_seed(0)  # of the requests without a seed
        # transformers 5 renamed `past_key_values` to `cache` (and warns on the old name)
        forward = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"

    def stats(self) -> EngineStats:
        """What the engine did since it was made (a copy)."""
        stats = EngineStats(**vars(self._stats))
        stats.reused_tokens = self.prefixes.reused_tokens
        stats.graphs = self.slots.captures if self.slots else 0
        return stats

    def plan(self, tokens: int) -> None:
        """Allocate the slots for sequences of `tokens` now (a `RunError` naming the sizes if
        they cannot fit) rather than at the first request that needs them; a no-op without
        slots."""
        if self.slots is not None:
            self.slots.ensure_columns(tokens)

    @contextlib.contextmanager
    def reserving_at_most(self, tokens: int) -> Iterator[None]:
        """Inside the block, admit at most `tokens` reserved KV tokens (0: as built), e.g. an
        evaluation's cap on an engine shared with training."""
        built = self.max_kv_tokens
        self.max_kv_tokens = min(tokens, built) if tokens else built
        try:
            yield
        finally:
            self.max_kv_tokens = built

    @property
    def waiting(self) -> int:
        """Requests not yet admitted."""
        return len(self._queue)

    @property
    def running(self) -> int:
        """Requests being decoded."""
        return len(self._running)

    @property
    def kv_capacity_tokens(self) -> int:
        """The KV tokens this engine admits (what a KV-aware scheduler may place on it)."""
        return self.max_kv_tokens

    @property
    def kv_tokens_used(self) -> int:
        """Tokens reserved by the running requests (prompt + max_tokens each)."""
        return sum(r.reserved_tokens for r in self._running)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if not prompt_ids:
            raise ValueError("generate: empty prompt")
        room = self.context_tokens - len(prompt_ids)
        if room < 1:  # as a server's 400 for a prompt past its context: out of room
            raise ContextExceeded(
                f"a prompt of {len(prompt_ids)} tokens fills the model's context of "
                f"{self.context_tokens}"
            )
        if params.max_tokens > room:  # as a server's budget fitted to its context
            params = dataclasses.replace(params, max_tokens=room)
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        seed = (
            int(torch.randint(SEEDS, (), generator=self._seeds))
            if params.seed is None
            else params.seed % SEEDS
        )
        completers = stop_completers(self.tokenizer, params.stop) if params.stop else None
        self._queue.append(
            _Request(list(prompt_ids), params, future, seed, completers, self._stats.steps)
        )
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._serve())
        return await future

    async def _serve(self) -> None:
        await asyncio.sleep(self.batch_window_s)  # let the requests of one burst prefill together
        ended: float | None = None  # when the last step ended
        while self._queue or self._running:
            if ended is not None:  # results handed out, callers run, requests taken
                self._stats.host_s += time.perf_counter() - ended
            joining = self._admit(everyone=self._join_now())
            try:
                if self.step_in_thread:
                    done = await asyncio.to_thread(self._step, joining)
                else:
                    done = self._step(joining)
                    await asyncio.sleep(0)  # callers, tool results and new requests run now
            except Exception as err:
                for request in [*self._running, *joining]:
                    if not request.future.done():
                        request.future.set_exception(err)
                self._running, self._batch = [], None
                continue
            for request in done:
                if not request.future.done():
                    request.future.set_result(
                        Generation(
                            request.out_ids,
                            request.out_logprobs,
                            request.finish or "stop",
                            request.out_versions,
                        )
                    )
            ended = time.perf_counter()

    def _join_now(self) -> bool:
        """Whether the queued requests join at this step (`join_wait_steps`): at once with
        nothing running, else once a batch worth a prefill can join or `join_wait_steps`
        steps have passed since the last join."""
        if not self._queue or not self._running or not self.join_wait_steps or self.step_tokens:
            return True
        joinable = min(len(self._queue), self.max_batch - len(self._running))
        if joinable <= 0:
            return False
        if joinable >= max(1, self.max_batch // JOIN_SHARE):
            return True
        return self._stats.steps - self._last_join_step >= self.join_wait_steps

    def _admit(self, *, everyone: bool) -> list[_Request]:
        """Queued requests that fit beside the running ones, in arrival order: all of them
        (`everyone`: a join now, `_join_now`) or only those to be fed (`_fed`), which need no
        prefill and never wait."""
        joining: list[_Request] = []
        waiting: list[_Request] = []
        reserved = self.kv_tokens_used
        full = False
        for request in self._queue:
            if request.future.cancelled():
                continue
            if full or len(self._running) + len(joining) >= self.max_batch:
                waiting.append(request)
                continue
            if not everyone and not self._fed(request):
                waiting.append(request)
                continue
            tokens = request.reserved_tokens
            alone = not self._running and not joining  # one too large for the cap runs alone
            if self.max_kv_tokens and reserved + tokens > self.max_kv_tokens and not alone:
                full = True  # none overtakes it
                waiting.append(request)
                continue
            joining.append(request)
            reserved += tokens
        self._queue = waiting
        return joining

    def _fed(self, request: _Request) -> bool:
        """Whether a request's prompt tokens not in the prefix cache are few enough to feed
        through decoding steps (`feed_tokens`). The count is taken when first asked: the cache
        may change before the request joins, and `_step` looks again."""
        if not self.feed_tokens:
            return False
        if request.uncached is None:
            prompt = request.prompt_ids
            request.uncached = len(prompt) - self.prefixes.peek(tuple(prompt[:-1]))
        return request.uncached <= self.feed_tokens

    def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int | None = None
    ) -> None:
        """Copy new weights into the model in place (between steps) and set `version` (by
        default the next one); cached prefixes are dropped (their KV came from the old
        weights). Weights that `check_weights` refuses replace nothing."""
        targets = self.model.state_dict()  # tied weights appear under each of their names
        check_weights(state_dict, targets)  # before anything is replaced
        with self._weights_lock, torch.no_grad():
            self.version = self.version + 1 if version is None else version
            self.prefixes.clear()
            for name, tensor in state_dict.items():
                targets[name].copy_(tensor)
            if self.slots is not None:
                self.slots.refresh()  # its merged projections

    @torch.no_grad()
    def _step(self, joining: list[_Request]) -> list[_Request]:
        """Prefill the joining requests, then decode one token for every running one; returns
        the requests that finished (already removed from the batch)."""
        if self.step_tokens:
            return self._mixed_step(joining)
        with self._weights_lock:
            device = next(self.model.parameters()).device
            finished: list[_Request] = []
            stats = self._stats
            fed = self._to_feed(joining)
            fed_ids = {id(r) for r in fed}
            prefilled = [r for r in joining if id(r) not in fed_ids]
            if prefilled:
                began = time.perf_counter()
                self._last_join_step = stats.steps  # fed joins do not count: no prefill
                stats.prefills += 1
                reused = self.prefixes.reused_tokens
                batch, logits = self._prefill(prefilled, device)
                done, joined = self._sample_and_retire(prefilled, batch, logits)
                finished += done
                if joined:
                    self._batch = batch if self._batch is None else self._batch.merge(batch)  # type: ignore[arg-type]
                    self._running += joined
                unique = {tuple(r.prompt_ids) for r in prefilled}  # prefilled once each
                stats.prefill_tokens += sum(map(len, unique)) - (
                    self.prefixes.reused_tokens - reused
                )
                stats.prefill_s += time.perf_counter() - began
            if fed:
                self._join_fed(fed)
            if self._running:
                assert self._batch is not None
                began = time.perf_counter()
                stats.steps += 1
                stats.rows_decoded += len(self._running)
                if stats.steps % TRIM_EVERY_STEPS == 0:
                    trim_when_above()  # KV buffers of changing sizes pile up in glibc otherwise
                inputs = [
                    r.prompt_ids[-r.to_feed] if r.to_feed else r.out_ids[-1] for r in self._running
                ]
                logits = self._batch.decode(self._forward, torch.tensor(inputs, device=device))
                for request in self._running:
                    if request.to_feed:
                        request.to_feed -= 1
                        stats.fed_tokens += 1
                done, self._running = self._sample_and_retire(self._running, self._batch, logits)
                finished += done
                stats.decode_s += time.perf_counter() - began
            if not self._running:
                self._batch = None
            return finished

    @torch.no_grad()
    def _mixed_step(self, joining: list[_Request]) -> list[_Request]:
        """One step of at most `step_tokens` tokens (step_plan.py): the joining requests take
        slots with their cached prefixes, then one forward of every decoding row's next token
        and the prompt chunks the budget leaves room for; returns the requests that finished."""
        with self._weights_lock:
            if joining:
                self._join_fed(joining)
                self._lead(joining)
                self._copy_from_leaders()
            if not self._running:
                self._batch = None
                return []
            began = time.perf_counter()
            stats, rows, batch = self._stats, self._running, self._batch
            assert isinstance(batch, SlotBatch) and self.slots is not None
            stats.steps += 1
            if stats.steps % TRIM_EVERY_STEPS == 0:
                trim_when_above()  # KV buffers of changing sizes pile up in glibc otherwise
            waiting = [r.follows is not None for r in rows]
            counts = plan_step([r.to_feed for r in rows], waiting, self.step_tokens)
            fed = sum(c for r, c in zip(rows, counts, strict=True) if r.to_feed)
            if fed or 0 in counts:
                logits = self._forward_chunks(rows, counts)
            else:  # decoding only: the in-place step (a captured graph on a GPU)
                ids = torch.tensor([r.out_ids[-1] for r in rows], device=self.slots.device)
                logits = batch.decode(self._forward, ids)
            ready = [r for r, c in zip(rows, counts, strict=True) if c and r.to_feed <= c]
            for request, count in zip(rows, counts, strict=True):
                request.to_feed = max(request.to_feed - count, 0)
            self._copy_from_leaders()  # before a leader that finishes now leaves
            self._sample(ready, batch, logits)
            done, self._running = self._retire(rows, batch)
            stats.rows_decoded += len(ready)
            stats.fed_tokens += fed
            elapsed = time.perf_counter() - began
            if fed:
                stats.mixed_steps += 1
                stats.mixed_s += elapsed
            else:
                stats.decode_s += elapsed
            if not self._running:
                self._batch = None
            return done

    def _forward_chunks(self, rows: list[_Request], counts: list[int]) -> torch.Tensor:
        """Forward `counts[i]` tokens of row i (its next token, or its prompt's next chunk) in
        one pass; the logits [m, V] of the rows whose prompt is then complete, in row order."""
        assert isinstance(self._batch, SlotBatch) and self.slots is not None
        lengths = self._batch.lengths
        tokens: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        out: list[int] = []
        for row, (request, count) in enumerate(zip(rows, counts, strict=True)):
            if not count:
                continue
            if request.to_feed:
                at = len(request.prompt_ids) - request.to_feed
                tokens += request.prompt_ids[at : at + count]
            else:
                tokens.append(request.out_ids[-1])
            slots += [row] * count
            positions += range(lengths[row], lengths[row] + count)
            lengths[row] += count
            if request.to_feed <= count:
                out.append(len(tokens) - 1)
        return self.slots.step(tokens, slots, positions, out)

    def _lead(self, joining: list[_Request]) -> None:
        """Which joining requests follow which request still feeding (`step_plan.followers`)."""
        assert isinstance(self._batch, SlotBatch)
        lengths = self._batch.lengths
        feeding = [(r, lengths[i]) for i, r in enumerate(self._running) if r.to_feed]
        new = {id(r) for r in joining}
        plan = followers(
            [r.prompt_ids for r, _ in feeding],
            [cached for _, cached in feeding],
            [id(r) in new for r, _ in feeding],
        )
        for j, (leader, shared) in plan.items():
            feeding[j][0].follows, feeding[j][0].shared = feeding[leader][0], shared

    def _copy_from_leaders(self) -> None:
        """Each follower whose leader's slot holds their shared prefix copies it and goes on to
        feed the rest; one whose leader has left feeds its own."""
        assert isinstance(self._batch, SlotBatch) and self.slots is not None
        lengths = self._batch.lengths
        row_of = {id(r): i for i, r in enumerate(self._running)}
        for row, request in enumerate(self._running):
            leader = request.follows
            if leader is None:
                continue
            source = row_of.get(id(leader))
            if source is not None and lengths[source] < request.shared:
                continue  # the leader does not hold them yet
            if source is not None:
                self.slots.move(source, row, request.shared)
                self._stats.shared_tokens += request.shared - lengths[row]
                lengths[row] = request.shared
                request.to_feed = len(request.prompt_ids) - request.shared
            request.follows = None

    def _prefill(
        self, joining: list[_Request], device: torch.device
    ) -> tuple[KVBatch | SlotBatch, torch.Tensor]:
        """The joining requests' batch (in the slots after the running rows, or a KVBatch to
        merge) and their next-token logits [n, V]."""
        prompts = [r.prompt_ids for r in joining]
        if self.slots is None:
            return KVBatch.prefill(
                self._forward, prompts, self.prefixes, pad_id=self.pad_id, device=device
            )
        columns = max(r.reserved_tokens for r in [*self._running, *joining])
        return SlotBatch.prefill(
            self.slots,
            prompts,
            self.prefixes,
            pad_id=self.pad_id,
            offset=len(self._running),
            columns=columns,
        )

    def _to_feed(self, joining: list[_Request]) -> list[_Request]:
        """The joining requests to feed through decoding steps: those with at most
        `feed_tokens` prompt tokens not in the prefix cache, counted now (the count `_fed`
        took at admission may be stale)."""
        if not self.feed_tokens or not joining:
            return []
        fed = []
        for request in joining:
            prompt = request.prompt_ids
            request.uncached = len(prompt) - self.prefixes.peek(tuple(prompt[:-1]))
            if request.uncached <= self.feed_tokens:
                fed.append(request)
        return fed

    def _join_fed(self, fed: list[_Request]) -> None:
        """Put requests to be fed in the slots after the running rows, with their cached KV;
        their remaining prompt tokens go in with the next decoding steps."""
        assert self.slots is not None
        columns = max(r.reserved_tokens for r in [*self._running, *fed])
        batch, cached = SlotBatch.feed(
            self.slots,
            [r.prompt_ids for r in fed],
            self.prefixes,
            offset=len(self._running),
            columns=columns,
        )
        for request, count in zip(fed, cached, strict=True):
            request.to_feed = len(request.prompt_ids) - count
        self._batch = batch if self._batch is None else self._batch.merge(batch)  # type: ignore[arg-type]
        self._running += fed

    def _forward(self, cache: DynamicCache, **inputs: torch.Tensor) -> torch.Tensor:
        """The model's last-position logits [B, V] (float32), extending `cache`."""
        output = self.model(**inputs, use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
        logits: torch.Tensor = output.logits[:, -1, :].float()
        return logits

    def _sample_and_retire(
        self, rows: list[_Request], batch: KVBatch | SlotBatch, logits: torch.Tensor
    ) -> tuple[list[_Request], list[_Request]]:
        """Sample a token for each row of `batch` but those still being fed their prompt
        (`_sample`), and cut finished rows out (`_retire`)."""
        self._sample(rows, batch, logits)
        return self._retire(rows, batch)

    def _sample(
        self, rows: list[_Request], batch: KVBatch | SlotBatch, logits: torch.Tensor
    ) -> None:
        """Sample a token for each of `rows` from its `logits` row and record it (but for rows
        still being fed their prompt), with whether the request is finished."""
        if not rows:
            return
        draws = uniforms(
            torch.tensor([r.seed for r in rows]), torch.tensor([len(r.out_ids) for r in rows])
        )
        tokens, logprobs = batch.sample(logits, [r.params for r in rows], draws)
        picked = torch.stack([tokens.double(), logprobs.double()]).tolist()  # one transfer
        for request, token, logprob in zip(rows, map(int, picked[0]), picked[1], strict=True):
            if request.to_feed:
                continue
            request.out_ids.append(token)
            request.out_logprobs.append(logprob)
            request.out_versions.append(self.version)
            request.finish = (
                "stop"
                if request.future.cancelled()  # its caller is gone
                else finish_reason(
                    self.tokenizer,
                    self.stop_token_ids,
                    request.out_ids,
                    request.params,
                    completers=request.completers,
                )
            )

    def _retire(
        self, rows: list[_Request], batch: KVBatch | SlotBatch
    ) -> tuple[list[_Request], list[_Request]]:
        """Cut the finished rows out of `batch` (their KV goes to the prefix cache: the prompt
        and every sampled token but the last); returns the finished requests and the others in
        the batch's new row order."""
        keep = [i for i, r in enumerate(rows) if r.finish is None]
        if len(keep) == len(rows):
            return [], rows
        if self.prefixes.max_tokens:
            for i, request in enumerate(rows):
                if request.finish is not None:
                    ids = (*request.prompt_ids, *request.out_ids[:-1])
                    self.prefixes.store(ids, batch.row_kv(i))
        order = batch.select(keep)
        return [r for r in rows if r.finish is not None], [rows[i] for i in order]
