"""A synthetic math task family for tiny runs, where the Python tool genuinely helps.

Problems are integer-answer arithmetic a tiny model cannot do in its head but can delegate:
copy the numbers into code, run it, copy the printed result into `\\boxed{}`. Difficulty
(1-3) sets the operation and the size of the numbers:
1. `a + b` with 2-3 digit numbers;
2. `a * b` with 2-3 digit numbers, or `a - b`;
3. `(a * b) mod m`, `a ** k mod m`, or how many integers in [1, n] are divisible by k.
Generation is deterministic from (seed, index). The split is by construction: a problem belongs
to `train` or `heldout` by a hash of its text, so the two sets never share a problem.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from codeloop.data.problems import Problem

Split = Literal["train", "heldout"]
HELDOUT_SHARE = 0.2


@dataclass(frozen=True)
class Task:
    text: str
    answer: int
    code: str  # a program that prints the answer
    difficulty: int


def make_task(rng: random.Random, difficulty: int) -> Task:
    if difficulty not in (1, 2, 3):
        raise ValueError(f"difficulty must be 1, 2 or 3, got {difficulty}")
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    if difficulty == 1:
        return Task(f"What is {a} + {b}?", a + b, f"print({a} + {b})", 1)
    if difficulty == 2:
        if rng.random() < 0.5:
            return Task(f"What is {a} * {b}?", a * b, f"print({a} * {b})", 2)
        return Task(f"What is {a} - {b}?", a - b, f"print({a} - {b})", 2)
    m, k = rng.randint(7, 97), rng.randint(2, 9)
    match rng.randrange(3):
        case 0:
            return Task(f"What is ({a} * {b}) mod {m}?", a * b % m, f"print(({a} * {b}) % {m})", 3)
        case 1:
            return Task(
                f"What is {a} ** {k} mod {m}?", pow(a, k, m), f"print(pow({a}, {k}, {m}))", 3
            )
        case _:
            n = a * b
            return Task(f"How many integers from 1 to {n} are divisible by {k}?", n // k,
                        f"print({n} // {k})", 3)  # fmt: skip


def split_of(text: str) -> Split:
    return "heldout" if zlib.crc32(text.encode()) % 100 < HELDOUT_SHARE * 100 else "train"


def tasks(seed: int, split: Split, difficulty: int) -> Iterator[Task]:
    """An endless deterministic stream of distinct tasks of one split and difficulty."""
    rng = random.Random(zlib.crc32(f"{seed}/{difficulty}".encode()))
    seen: set[str] = set()
    while True:
        task = make_task(rng, difficulty)
        if task.text not in seen and split_of(task.text) == split:
            seen.add(task.text)
            yield task


def problems(seed: int, split: Split, counts: dict[int, int]) -> list[Problem]:
    """`counts[d]` problems of difficulty d, as `Problem`s with ids like `train-d2-17`."""
    out = []
    for difficulty, count in sorted(counts.items()):
        stream = tasks(seed, split, difficulty)
        for i in range(count):
            task = next(stream)
            out.append(Problem(f"{split}-d{difficulty}-{i}", task.text, str(task.answer)))
    return out


def _call(code: str) -> str:
    # The tool name is the rollout's default tool (kept as text: data sits below rollout).
    arguments = json.dumps({"name": "execute_python_code_with_standard_io",
                            "arguments": {"code": code}})  # fmt: skip
    return f"<tool_call>\n{arguments}\n</tool_call>"


def demonstration(
    task: Task, rng: random.Random, imperfect_share: float = 0.3
) -> list[dict[str, str]]:
    """The assistant and tool turns of one SFT demonstration (the caller adds system + user).

    Most demonstrations are clean (compute with the tool, answer); `imperfect_share` of them are
    imperfect the way real traces are: a code error followed by a fix, or an answer given
    without the tool (then usually wrong), so the SFT policy learns the format, not the task.
    """
    answer = f"<answer>\\boxed{{{task.answer}}}</answer>"
    roll = rng.random()
    if roll < imperfect_share / 2:  # a typo, the error, then the fix
        broken = task.code[:-1]  # drop the closing parenthesis
        return [
            {"role": "assistant", "content": f"<reason>Compute it.</reason>\n{_call(broken)}"},
            {"role": "tool", "content": "SyntaxError: '(' was never closed"},
            {"role": "assistant", "content": f"<reason>Fix the code.</reason>\n{_call(task.code)}"},
            {"role": "tool", "content": str(task.answer)},
            {"role": "assistant", "content": answer},
        ]
    if roll < imperfect_share:  # no tool: a guess, right only by chance
        guess = task.answer + rng.choice([0, 1, -1, 10, -10, 100])
        text = f"<reason>I estimate it.</reason>\n<answer>\\boxed{{{guess}}}</answer>"
        return [{"role": "assistant", "content": text}]
    return [
        {"role": "assistant", "content": f"<reason>Compute it.</reason>\n{_call(task.code)}"},
        {"role": "tool", "content": str(task.answer)},
        {"role": "assistant", "content": answer},
    ]
