"""`codeloop compare A B`: B against A over the problems both `codeloop eval` runs scored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from codeloop.errors import InputFileError
from codeloop.eval.evaluate import read_done
from codeloop.intervals import compare, interval, percent, verdict
from codeloop.rollout.score import Scores


def run_scores(given: str) -> dict[str, float]:
    """Each problem's share of correct samples in an evaluation (its output directory, or its
    `results.jsonl`)."""
    path = Path(given)
    folder = path.parent if path.name == "results.jsonl" else path
    if not (folder / "results.jsonl").is_file():
        raise InputFileError(
            f"{given}: no results.jsonl (give a codeloop eval output directory or its "
            "results.jsonl)"
        )
    return Scores.merged(map(Scores.from_result, read_done(folder).values())).per_problem


def compare_runs(a: str, b: str, *, seed: int = 0) -> dict[str, Any]:
    """`intervals.compare` of two evaluations, with each side's score and interval over the
    problems both scored (`a_interval95`, `b_interval95`) and where they came from."""
    scores_a, scores_b = run_scores(a), run_scores(b)
    if not set(scores_a) & set(scores_b):
        raise InputFileError(f"{a} and {b} share no problem id: nothing to pair")
    result = compare(scores_a, scores_b, seed)
    common = sorted(set(scores_a) & set(scores_b))
    for name, scores in (("a", scores_a), ("b", scores_b)):
        result[f"{name}_interval95"] = list(interval([scores[i] for i in common], seed))
    return {**result, "a_run": a, "b_run": b}


def comparison_lines(result: dict[str, Any]) -> list[str]:
    """`compare_runs`' result in words: each side, what was left out, the verdict."""
    lines = [
        f"{name}: {percent(result[name.lower()], result[name.lower() + '_interval95'])}  "
        f"{result[name.lower() + '_run']}"
        for name in ("A", "B")
    ]
    if result["only_in_a"] or result["only_in_b"]:
        lines.append(
            f"paired over the {result['problems']} problems both scored (left out: "
            f"{result['only_in_a']} only in A, {result['only_in_b']} only in B)"
        )
    return [*lines, verdict(result)]
