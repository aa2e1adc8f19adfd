"""Curation of training problems as the report describes: integer answers, no duplicates, no
n-gram overlap with the benchmarks. Pure functions over `Problem` lists; every removal is
returned with its reason so that nothing is dropped silently.

Pass-rate filtering needs a policy and lives in `codeloop.eval.passrate` (stage 3 of the recipe
and `codeloop data filter --pass-band` use it).

Texts are compared as lower-case whitespace-separated words, punctuation and LaTeX kept (as
Open-R1's decontamination does): with punctuation stripped, formulas shrink to letters and
digits and unrelated problems share 8-grams such as `a 2 b 2 c 2 d 2`. Even so, any shared
8-gram (the report's rule) also matches contest boilerplate ("where $m$ and $n$ are relatively
prime positive integers"): each removal names the benchmark problem and the shared n-gram, so
the list can be checked.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from codeloop.data.problems import Problem
from codeloop.files import write_atomic
from codeloop.reward.integer import parse_integer


@dataclass(frozen=True)
class Removal:
    """One problem taken out by a filter, and why."""

    id: str
    reason: str  # "non_integer_answer", "duplicate", "contaminated", "pass_rate"
    detail: str  # the duplicate's first id, or the benchmark problem it overlaps


def words(text: str) -> list[str]:
    """Lower-case whitespace-separated words."""
    return text.lower().split()


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """The word n-grams of `text`; a text shorter than n words is one n-gram of all its words."""
    tokens = words(text)
    if len(tokens) < n:
        return {tuple(tokens)} if tokens else set()
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def integer_only(problems: Sequence[Problem]) -> tuple[list[Problem], list[Removal]]:
    """Keep problems whose gold answer is an integer (`1,000`, `12.0` and `\\text{42}` count),
    and every reasoning-gym problem (its task scores its answer, whatever the answer's form)."""
    kept, removed = [], []
    for p in problems:
        if not p.task and parse_integer(p.answer) is None:
            removed.append(Removal(p.id, "non_integer_answer", p.answer))
        else:
            kept.append(p)
    return kept, removed


def dedupe(problems: Sequence[Problem]) -> tuple[list[Problem], list[Removal]]:
    """Keep the first of problems whose texts are equal as word sequences."""
    first: dict[tuple[str, ...], str] = {}
    kept, removed = [], []
    for p in problems:
        key = tuple(words(p.problem))
        if key in first:
            removed.append(Removal(p.id, "duplicate", first[key]))
        else:
            first[key] = p.id
            kept.append(p)
    return kept, removed


def decontaminate(
    problems: Sequence[Problem], benchmarks: Iterable[Problem], n: int = 8
) -> tuple[list[Problem], list[Removal]]:
    """Remove problems that share any word n-gram with a benchmark problem (report: n = 8)."""
    owner: dict[tuple[str, ...], str] = {}
    for b in benchmarks:
        for gram in ngrams(b.problem, n):
            owner.setdefault(gram, b.id)
    kept, removed = [], []
    for p in problems:
        hit = min((g for g in ngrams(p.problem, n) if g in owner), default=None)
        if hit is None:
            kept.append(p)
        else:
            removed.append(Removal(p.id, "contaminated", f"{owner[hit]}: {' '.join(hit)}"))
    return kept, removed


def write_problems(path: str | Path, problems: Sequence[Problem]) -> None:
    """JSONL with the default field names (`id`, `problem`, `answer`; `solution` where a problem
    has one; `task` and `metadata` for a reasoning-gym problem): `load_problems` reads it back."""
    write_atomic(path, "".join(json.dumps(_record(p)) + "\n" for p in problems))


def _record(problem: Problem) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": problem.id,
        "problem": problem.problem,
        "answer": problem.answer,
    }
    if problem.solution:
        record["solution"] = problem.solution
    if problem.task:
        record.update(task=problem.task, metadata=json.loads(problem.metadata))
    return record


def write_removals(path: str | Path, removals: Sequence[Removal]) -> None:
    Path(path).write_text("".join(json.dumps(asdict(r)) + "\n" for r in removals))


def curate(
    problems: Sequence[Problem],
    integer_answers: bool = True,
    unique: bool = True,
    benchmarks: Sequence[Problem] = (),
    *,
    n: int = 8,
) -> tuple[list[Problem], list[Removal]]:
    """The report's filters in order: integer answers, duplicates, benchmark n-gram overlap."""
    kept, removed = list(problems), []
    if integer_answers:
        kept, out = integer_only(kept)
        removed += out
    if unique:
        kept, out = dedupe(kept)
        removed += out
    if benchmarks:
        kept, out = decontaminate(kept, benchmarks, n)
        removed += out
    return kept, removed
