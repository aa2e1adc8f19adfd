"""What one step of the in-process engine forwards: one token budget for decoding and prompts.

A step forwards every decoding row's next token and, within `budget` tokens in all, chunks of
the prompts still going into their slots (new requests, and turns coming back from a tool with
the tokens the prefix cache lacks), oldest first; a long prompt is split across steps and no row
that is decoding ever waits for one. A row's logits are read only at the step that completes its
prompt, and at every step after. This is the scheduling of vLLM's chunked prefill and SGLang's
mixed chunked prefill; on the engine's slots it costs one forward a step (`SlotDecoder.step`).

Prompts that share a prefix the prefix cache lacks (the samples of one prompt, a system prompt
at the start of a run) compute it once: a later one follows an earlier one (`Follow`), waits
while that one feeds the shared part, then copies its columns and feeds only its own rest.
Pure functions of counts; the engine (`hf_engine.py`) holds the requests and the slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from codeloop.engine.kv_batch import SHARED_PREFIX_MIN, _common_prefix


class Follow(NamedTuple):
    """A prompt that takes its first `shared` tokens from row `leader`'s slot once that slot
    holds them."""

    leader: int
    shared: int


def plan_step(to_feed: Sequence[int], waiting: Sequence[bool], budget: int) -> list[int]:
    """The tokens each row forwards this step: a decoding row (nothing to feed) 1; rows with
    prompt tokens to feed, in order, as many as are left of `budget` after the decoding rows
    (at least one row's chunk a step, so prompts never starve); rows `waiting` for a leader 0."""
    counts = [0 if wait else int(feed == 0) for feed, wait in zip(to_feed, waiting, strict=True)]
    left = max(budget - sum(counts), 1)
    for row, (feed, wait) in enumerate(zip(to_feed, waiting, strict=True)):
        if feed and not wait and left:
            counts[row] = min(feed, left)
            left -= counts[row]
    return counts


def followers(
    prompts: Sequence[Sequence[int]], cached: Sequence[int], joining: Sequence[bool]
) -> dict[int, Follow]:
    """Which of the `joining` rows follow which earlier row: row j follows the earlier row whose
    prompt shares the longest prefix with its own, when that prefix spares it at least
    SHARED_PREFIX_MIN tokens past its `cached` ones, or all its prompt but the last token (the
    samples of one prompt). A leader may itself follow another: it holds the shared columns
    once its own leader's are copied and its own chunks fed."""
    plan: dict[int, Follow] = {}
    keys = [tuple(prompt) for prompt in prompts]
    for j, ids in enumerate(keys):
        if not joining[j]:
            continue
        best = Follow(-1, 0)
        for i in range(j):
            shared = _common_prefix(keys[i], ids, min(len(keys[i]), len(ids) - 1))
            if shared > best.shared:
                best = Follow(i, shared)
        spared = best.shared - cached[j]
        if spared >= SHARED_PREFIX_MIN or (spared > 0 and best.shared == len(ids) - 1):
            plan[j] = best
    return plan
