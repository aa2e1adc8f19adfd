"""Token entropy analysis (the report's "forking" and "reflection" tokens).

For each trajectory the policy's next-token entropy (softmax at temperature 1) is computed at
every token it sampled; tokens the environment inserted get none. The top `top_fraction` (20%)
of all policy tokens by entropy are split into those right after a tool response (among the
first `window` policy tokens of an assistant turn that follows one) and the rest, and the most
frequent tokens of each group are listed. `codeloop view` colours tokens by these entropies.

Input: trajectories with token ids (`trajectories.jsonl` of `codeloop eval`); training dumps do
not keep token ids.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from codeloop.algo.loss import token_entropy
from codeloop.data.problems import DataError


@dataclass(frozen=True)
class EntropyReport:
    top_fraction: float
    threshold: float  # the lowest entropy inside the top fraction
    policy_tokens: int
    high_after_tool: int  # high-entropy tokens right after a tool response
    high_other: int
    after_tool: list[tuple[str, int]]  # most frequent high-entropy tokens, with counts
    other: list[tuple[str, int]]


@torch.no_grad()
def response_entropies(
    model: Any, prompt_ids: Sequence[int], response_ids: Sequence[int], loss_mask: Sequence[int]
) -> list[float | None]:
    """Entropy of the distribution each sampled response token was drawn from; None if inserted."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=device)  # [1, P + R]
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]  # [R, V]
    entropies = token_entropy(logits[None])[0].tolist()  # [R]
    return [h if m else None for h, m in zip(entropies, loss_mask, strict=True)]


def after_tool_flags(loss_mask: Sequence[int], window: int) -> list[bool]:
    """True for the first `window` policy tokens after each inserted span (a tool response)."""
    flags, since_insert = [], window  # the first turn follows the prompt, not a tool response
    for m in loss_mask:
        if not m:
            since_insert = 0
            flags.append(False)
            continue
        flags.append(since_insert < window)
        since_insert += 1
    return flags


def analyse(
    trajectories: Sequence[tuple[list[str], list[float | None], list[bool]]],
    top_fraction: float = 0.2,
    most_common: int = 20,
) -> EntropyReport:
    """Top-entropy tokens split by position; input: (token texts, entropies, after-tool flags)."""
    policy = [
        (h, tok, after)
        for toks, hs, flags in trajectories
        for tok, h, after in zip(toks, hs, flags, strict=True)
        if h is not None
    ]
    if not policy:
        raise DataError("entropy analysis: no policy tokens in the trajectories")
    top = sorted(policy, key=lambda item: -item[0])[: max(1, math.ceil(top_fraction * len(policy)))]
    after = Counter(tok for _, tok, is_after in top if is_after)
    other = Counter(tok for _, tok, is_after in top if not is_after)
    return EntropyReport(
        top_fraction,
        top[-1][0],
        len(policy),
        sum(after.values()),
        sum(other.values()),
        after.most_common(most_common),
        other.most_common(most_common),
    )


def analyse_file(
    model: Any,
    tokenizer: Any,
    path: str | Path,
    *,
    top_fraction: float = 0.2,
    window: int = 8,
    limit: int = 0,
) -> dict[str, Any]:
    """Entropies and the report for the trajectories in a JSONL file (`limit` > 0: the first)."""
    from codeloop.progress import progress_bar

    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    lines = lines[:limit] if limit else lines
    model.eval()
    per_trajectory, items = [], []
    for number, line in enumerate(progress_bar(lines, desc="entropy", unit="trajectory"), 1):
        record = json.loads(line)
        missing = [k for k in ("prompt_ids", "response_ids", "loss_mask") if k not in record]
        if missing:
            raise DataError(f"{path}:{number}: no {', '.join(missing)} (use codeloop eval output)")
        hs = response_entropies(
            model, record["prompt_ids"], record["response_ids"], record["loss_mask"]
        )
        texts = [tokenizer.decode([i]) for i in record["response_ids"]]
        items.append((texts, hs, after_tool_flags(record["loss_mask"], window)))
        tokens = [[t, h] for t, h in zip(texts, hs, strict=True)]
        key = {"prompt_id": record["prompt_id"], "sample_index": record["sample_index"]}
        per_trajectory.append({**key, "tokens": tokens})
    report = analyse(items, top_fraction)
    return {"report": {**asdict(report), "window": window}, "trajectories": per_trajectory}
