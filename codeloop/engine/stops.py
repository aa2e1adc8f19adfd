"""When a sampled row stops: an end-of-turn token, a stop string, or its `max_tokens`.

The decoded tail is checked, so a string that ends across token boundaries is found; the token
that completes it is kept. The tail is decoded only after a token that can complete a stop string
(`stop_completers`), which spares nearly every step a decode.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Literal

from codeloop.engine.protocol import SamplingParams

STOP_TAIL_TOKENS = 16  # a stop string must fit in the decoded last tokens


def finish_reason(
    tokenizer: Any,
    stop_token_ids: set[int],
    generated: list[int],
    params: SamplingParams,
    *,
    completers: Completers | None = None,
) -> Literal["stop", "length"] | None:
    """Why a row that sampled `generated` stops now, or None: an end-of-turn token, a stop
    string in the decoded tail (it may end across token boundaries), or `max_tokens`.
    `completers` (`stop_completers` of `params.stop`): the tail is decoded only after a token
    that can complete a stop string."""
    if generated[-1] in stop_token_ids:
        return "stop"
    if params.stop and (completers is None or completers.may_complete(generated[-1])):
        tail = tokenizer.decode(generated[-STOP_TAIL_TOKENS:])
        if any(stop in tail for stop in params.stop):
            return "stop"
    return "length" if len(generated) >= params.max_tokens else None


class Completers:
    """The token ids after which a stop string can newly be in a decoded tail: those whose own
    text holds the last character of one of them, or a replacement character (a piece of a
    character of several bytes, which only its neighbours complete); ids past the tokenizer's
    vocabulary are taken to complete one."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        self.vocabulary = len(texts)
        self.ids = completing_ids(texts, stops)

    def may_complete(self, token: int) -> bool:
        return token in self.ids or not 0 <= token < self.vocabulary


def completing_ids(texts: Sequence[str], stops: Sequence[str]) -> frozenset[int]:
    """The ids (positions in `texts`, each token's own text) that can complete a stop string."""
    ends = {stop[-1] for stop in stops if stop}
    return frozenset(
        i for i, text in enumerate(texts) if "\ufffd" in text or any(end in text for end in ends)
    )


_COMPLETERS: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], Completers]] = (
    weakref.WeakKeyDictionary()
)


def stop_completers(tokenizer: Any, stops: Sequence[str]) -> Completers:
    """`Completers` of `stops` for `tokenizer`, made once (the whole vocabulary is decoded:
    about 0.7 s for SmolLM2's 49,152 tokens on one CPU core)."""
    known = _COMPLETERS.setdefault(tokenizer, {})
    key = tuple(stops)
    if key not in known:
        known[key] = Completers(tokenizer, stops)
    return known[key]
