"""Non-reasoning SFT conversations from GSM8K's worked solutions (the report's stage 0, on GSM8K).

As in the report, SFT teaches the format and the tool, not reasoning. A solution's calculator
annotations (`48/2 = <<48/2=24>>24`) become one code cell, a line per computation (`x1 = 48/2`),
and the cell prints the last variable whose annotated result is the `####` answer. Each line of
the solution with a computation also becomes a comment (its sentence, results taken out), and a
number that is an earlier result becomes that result's variable: without them (bare
`x2 = 48+24`), SmolLM2 solved nothing. The cell runs in the real sandbox, and the tool response
is what the rollout would show (`format_observation`); a conversation is kept only when the
printed value equals the answer, so every demonstration is right by construction.
A share (`error_share`) first calls the cell printing a name that does not exist, gets the
sandbox's real NameError traceback, and then calls the fixed cell: SFT shows an error and its
repair, and Resample-on-Correct has tool errors to act on. The last turn is the answer:
`<answer>\\boxed{72}</answer>`.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from codeloop.data.problems import Problem
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.toolcall import CALL_CLOSE, CALL_OPEN, format_observation
from codeloop.rollout.tools import PYTHON_TOOL, ToolExecutor
from codeloop.types import ExecRequest, ExecResult, ExecStatus

ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>]*)>>")
# an annotation with the result written after it (`= $<<48/2=24>>24`): taken out of a comment
RESULT = re.compile(r"\s*=?\s*\$?<<[^<>]*>>\$?(?:\d+(?:,\d{3})*(?:\.\d+)?)?")
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.]*\w)")
UNDEFINED = "answer"  # the name the erroneous first cell prints
Conversation = list[dict[str, str]]


@dataclass(frozen=True)
class Built:
    conversations: list[Conversation]  # system, user, assistant and tool turns
    dropped: Counter[str]  # why problems gave no conversation
    ids: list[str] = field(default_factory=list)  # each conversation's problem


def code_cell(solution: str, answer: str, question: str = "") -> str | None:
    """The solution's computations as Python printing the answer, or None when no annotated
    result equals the answer. Each line of the solution with a computation becomes a comment
    (the sentence with its annotated results taken out) and one assignment per computation
    (`x1 = 48/2`). A number in a later computation or sentence that is an earlier result and
    not a number of `question` becomes that result's variable (`x2 = 48 + x1`): the policy
    copies numbers from the problem and names what the tool computed, never working an
    intermediate result out in its head."""
    lines: list[str] = []
    results: dict[float, str] = {}  # an earlier result -> its (latest) variable
    given = {_value(n) for n in NUMBER.findall(question.replace(",", ""))}
    printed, n = "", 0

    def named(text: str) -> str:
        def swap(match: re.Match[str]) -> str:
            value = _value(match.group())
            return results[value] if value in results and value not in given else match.group()

        return NUMBER.sub(swap, text)

    for line in solution.splitlines():
        found = ANNOTATION.findall(line)
        if not found:
            continue
        comment = " ".join(named(RESULT.sub("", line)).split())
        lines.append(f"# {comment}")
        assignments = []
        for expression, result in found:
            n += 1
            assignments.append(f"x{n} = {named(expression.strip())}")
            if _same_number(result, answer):
                printed = f"x{n}"
            if (value := _value(result.replace(",", ""))) is not None:
                results[value] = f"x{n}"
        lines += assignments
    if not printed:
        return None
    return "\n".join([*lines, f"print({printed})"])


def _value(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None


def _same_number(text: str, answer: str) -> bool:
    try:
        return abs(float(text.strip().replace(",", "")) - float(answer)) < 1e-6
    except ValueError:
        return False


def _call(code: str) -> str:
    payload = json.dumps({"name": PYTHON_TOOL, "arguments": {"code": code}})
    return f"{CALL_OPEN}\n{payload}\n{CALL_CLOSE}"


def solution_cell(problem: Problem) -> str | None:
    """GSM8K's code cell (`code_cell`) of a problem's worked solution."""
    return code_cell(problem.solution, problem.answer, problem.problem)


def printed_gold(printed: str, problem: Problem) -> str | None:
    """The gold answer when the cell printed it (as a number), else None."""
    return problem.answer if _same_number(printed, problem.answer) else None


Cell = Callable[[Problem], "str | None"]  # a problem's program, or None: no demonstration
Check = Callable[[str, Problem], "str | None"]  # printed output -> the answer to write, or None


async def build(
    problems: Sequence[Problem],
    tools: ToolExecutor,
    fmt: PromptFormat,
    error_share: float = 0.15,
    *,
    seed: int = 0,
    max_tool_chars: int = 2048,
    concurrency: int = 32,
    cell: Cell = solution_cell,
    check: Check = printed_gold,
) -> Built:
    """One conversation per problem whose program (`cell`: by default the cell of its worked
    solution) prints, in the sandbox, what `check` accepts; the last turn answers what `check`
    returns."""
    rng = random.Random(seed)
    dropped: Counter[str] = Counter()
    cells = [(p, cell(p), rng.random() < error_share) for p in problems]
    gate = asyncio.Semaphore(concurrency)

    async def run(code: str) -> ExecResult:
        async with gate:
            return await tools.execute(ExecRequest(code=code))

    async def one(problem: Problem, cell: str | None, with_error: bool) -> Conversation | None:
        if cell is None:
            dropped["no computation gives the answer"] += 1
            return None
        result = await run(cell)
        answer = check(result.stdout, problem) if result.status == ExecStatus.OK else None
        if answer is None:
            dropped["the code does not print the answer"] += 1
            return None
        turns = fmt.messages(problem.problem)
        if with_error:
            broken = cell[: cell.rindex("print(")] + f"print({UNDEFINED})"
            failed = await run(broken)
            if failed.status != ExecStatus.ERROR or "NameError" not in failed.stderr:
                dropped["the broken cell did not fail with a NameError"] += 1
                return None
            turns += [
                {"role": "assistant", "content": f"<reason>Compute it.</reason>\n{_call(broken)}"},
                {"role": "tool", "content": format_observation(failed, max_tool_chars)},
                {
                    "role": "assistant",
                    "content": f"<reason>Print the variable that holds the result.</reason>\n"
                    f"{_call(cell)}",
                },
            ]
        else:
            turns.append(
                {"role": "assistant", "content": f"<reason>Compute it.</reason>\n{_call(cell)}"}
            )
        turns += [
            {"role": "tool", "content": format_observation(result, max_tool_chars)},
            {"role": "assistant", "content": f"<answer>\\boxed{{{answer}}}</answer>"},
        ]
        return turns

    built = await asyncio.gather(*(one(*c) for c in cells))
    kept = [(p.id, c) for p, c in zip(problems, built, strict=True) if c is not None]
    return Built([c for _, c in kept], dropped, [i for i, _ in kept])
