"""The in-process engine as it was before continuous batching, kept as `bench rollout`'s baseline.

Concurrent `generate` calls are gathered for `batch_window_ms` (or until `max_batch` wait) and
decoded together as one static batch: a batch decodes until its longest row stops, finished rows
keep their slot, a request that arrives meanwhile (a trajectory's next turn after its tool
call) waits for the whole batch, and sampling runs row by row. Not used for training.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from codeloop.engine.protocol import Generation, SamplingParams
from codeloop.engine.stops import finish_reason


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[Generation]


class StaticBatchEngine:
    """The static-batch engine; see the module docstring."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        stop_token_ids: Iterable[int],
        max_batch: int = 32,
        *,
        batch_window_ms: float = 5.0,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.stop_token_ids = set(stop_token_ids)
        self.max_batch = max_batch
        self.batch_window_s = batch_window_ms / 1000
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._queue: list[_Request] = []
        self._worker: asyncio.Task[None] | None = None
        self._default_generator = torch.Generator().manual_seed(0)
        self._forward_args = inspect.signature(model.forward).parameters

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if not prompt_ids:
            raise ValueError("generate: empty prompt")
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._queue.append(_Request(list(prompt_ids), params, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._serve())
        return await future

    async def _serve(self) -> None:
        while self._queue:
            await asyncio.sleep(self.batch_window_s)
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            try:
                results = await asyncio.to_thread(self._generate_batch, batch)
            except Exception as err:
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(err)
                continue
            for request, result in zip(batch, results, strict=True):
                if not request.future.done():
                    request.future.set_result(result)

    @torch.no_grad()
    def _generate_batch(self, batch: list[_Request]) -> list[Generation]:
        return self._decode(batch)

    def _decode(self, batch: list[_Request]) -> list[Generation]:
        device = next(self.model.parameters()).device
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [B, T]
        mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        for row, request in enumerate(batch):
            ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            mask[row, width - len(request.prompt_ids) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        generators = [self._generator(r.params) for r in batch]
        out_ids: list[list[int]] = [[] for _ in batch]
        out_logprobs: list[list[float]] = [[] for _ in batch]
        finish: list[str | None] = [None] * len(batch)
        cache, step_ids = DynamicCache(), ids  # extended in place by every forward
        for _ in range(max(r.params.max_tokens for r in batch)):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            cache_arg = {"cache" if "cache" in self._forward_args else "past_key_values": cache}
            output = self.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **cache_arg,
            )
            logits = output.logits[:, -1, :].float()  # [B, V]
            next_ids = torch.full((len(batch),), self.pad_id, dtype=torch.long)
            for row, request in enumerate(batch):
                if finish[row] is None:
                    token, logprob = _sample(logits[row], request.params, generators[row])
                    next_ids[row] = token
                    out_ids[row].append(token)
                    out_logprobs[row].append(logprob)
                    finish[row] = self._finished(out_ids[row], request.params)
            if all(f is not None for f in finish):
                break
            step_ids = next_ids.unsqueeze(-1).to(device)  # [B, 1]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        return [
            Generation(i, lp, "stop" if f == "stop" else "length")
            for i, lp, f in zip(out_ids, out_logprobs, finish, strict=True)
        ]

    def _finished(self, generated: list[int], params: SamplingParams) -> str | None:
        return finish_reason(self.tokenizer, self.stop_token_ids, generated, params)

    def _generator(self, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default_generator
        return torch.Generator().manual_seed(params.seed)


def _sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """One token from [V] logits and its logprob (see the module docstring)."""
    if params.temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        return token, float(logprobs[token])
    logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = logprobs.exp()
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p  # keep the first one
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
    return token, float(logprobs[token])
