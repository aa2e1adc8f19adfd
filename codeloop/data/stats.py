"""`codeloop data stats FILE`: what a problem file holds, before training on it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from codeloop.data.problems import Problem
from codeloop.reward.integer import parse_integer


def problem_stats(problems: Sequence[Problem]) -> dict[str, Any]:
    """Counts, integer-answer share, duplicates (ignoring case and spacing), lengths."""
    texts = Counter(" ".join(p.problem.lower().split()) for p in problems)
    ids = Counter(p.id for p in problems)
    lengths = sorted(len(p.problem) for p in problems) or [0]
    integer = sum(parse_integer(p.answer) is not None for p in problems)
    return {
        "problems": len(problems),
        "integer_answers": integer,
        "integer_share": integer / len(problems) if problems else 0.0,
        "duplicate_problems": sum(n - 1 for n in texts.values()),
        "duplicate_ids": sum(n - 1 for n in ids.values()),
        "chars_median": lengths[len(lengths) // 2],
        "chars_max": lengths[-1],
    }
