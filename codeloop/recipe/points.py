"""A recipe's points (one evaluation each: `points.json` of `codeloop demo` and `codeloop real`)
in words: a point's accuracy with its interval, and the sentence that ends a recipe."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from codeloop.intervals import compare, percent, verdict


def accuracy_text(point: Mapping[str, Any]) -> str:
    """A recipe point's accuracy with its interval (`12.5% [9.0, 16.5]`), or without it for a
    point that a run of an older version wrote."""
    bounds = point.get("accuracy_interval95")
    return percent(point["accuracy"], bounds) if bounds else f"{100 * point['accuracy']:.1f}%"


def first_vs_last(points: Sequence[Mapping[str, Any]], what: str) -> str:
    """The sentence that ends a recipe: its last point against its first (SFT), paired over the
    problems both scored, or why it cannot be said."""
    first, last = points[0], points[-1]
    if len(points) < 2:
        return f"{what}: only the {first['stage']} point so far"
    if "per_problem" not in first or "per_problem" not in last:
        return f"{what}: no per-problem scores in these points (written by an older codeloop)"
    result = compare(first["per_problem"], last["per_problem"])
    return f"{what}, {last['stage']} against {first['stage']}: " + verdict(
        result, first["stage"], last["stage"]
    )
