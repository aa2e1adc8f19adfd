"""A synthetic math task family for tiny runs, where the Python tool genuinely helps.

Every problem is `What is A op B?` with three-digit A and B and a three-digit answer: arithmetic
a tiny model cannot do in its head but can delegate: copy the expression into code, run it, copy
the printed result into `\\boxed{}`. Difficulty (1-3) sets the operation: 1. `+`; 2. `-`;
3. `%` (modular arithmetic). The shape is the same on purpose: both copies (problem -> code and
tool output -> answer) are then at one fixed distance, which a 2-layer model learns to copy
within a few hundred SFT steps; with mixed widths it stalled (docs/quickstart.md).
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


OPERATIONS = {1: "+", 2: "-", 3: "%"}


def make_task(rng: random.Random, difficulty: int) -> Task:
    if difficulty not in OPERATIONS:
        raise ValueError(f"difficulty must be 1, 2 or 3, got {difficulty}")
    op = OPERATIONS[difficulty]
    while True:  # draw until the answer has three digits (at most a few draws)
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        answer = {"+": a + b, "-": a - b, "%": a % b}[op]
        if 100 <= answer <= 999:
            return Task(f"What is {a} {op} {b}?", answer, f"print({a} {op} {b})", difficulty)


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
    arguments = json.dumps(
        {"name": "execute_python_code_with_standard_io", "arguments": {"code": code}}
    )
    return f"<tool_call>\n{arguments}\n</tool_call>"


def syntax_error(code: str) -> str:
    """What the sandbox reports for one line of code missing its closing parenthesis (a test
    holds this to the real sandbox's output)."""
    caret = " " * (4 + code.index("(")) + "^"
    return f"  File \"<code>\", line 1\n    {code}\n{caret}\nSyntaxError: '(' was never closed"


def demonstration(
    task: Task, rng: random.Random, error_share: float = 0.2, no_tool_share: float = 0.2
) -> list[dict[str, str]]:
    """The assistant and tool turns of one SFT demonstration (the caller adds system + user).

    Most demonstrations are clean (compute with the tool, answer); the others are imperfect the
    way real traces are: `error_share` have a code error followed by a fix, `no_tool_share`
    answer without the tool (a guess, right only by chance), so the SFT policy learns the
    format, not the task: RL has to learn to always compute, and RoC to avoid the errors.
    """
    answer = f"<answer>\\boxed{{{task.answer}}}</answer>"
    roll = rng.random()
    if roll < error_share:  # a typo, the error, then the fix
        broken = task.code[:-1]  # drop the closing parenthesis
        return [
            {"role": "assistant", "content": f"<reason>Compute it.</reason>\n{_call(broken)}"},
            {"role": "tool", "content": syntax_error(broken)},
            {"role": "assistant", "content": f"<reason>Fix the code.</reason>\n{_call(task.code)}"},
            {"role": "tool", "content": str(task.answer)},
            {"role": "assistant", "content": answer},
        ]
    if roll < error_share + no_tool_share:  # no tool: a guess of the same width
        guess = task.answer + rng.choice([0, 1, -1, 10, -10, 50, -50])
        text = f"<reason>I estimate it.</reason>\n<answer>\\boxed{{{guess}}}</answer>"
        return [{"role": "assistant", "content": text}]
    return [
        {"role": "assistant", "content": f"<reason>Compute it.</reason>\n{_call(task.code)}"},
        {"role": "tool", "content": str(task.answer)},
        {"role": "assistant", "content": answer},
    ]
