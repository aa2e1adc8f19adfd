"""Non-reasoning SFT conversations for reasoning-gym problems: the task's program, run.

The gym recipe's stage 0 teaches the tool broadly, as the report's first stage does: beside
GSM8K's worked solutions (`gsm8k_sft.py`), problems of the families with demonstrations
(`families.json`'s `sft`) become conversations whose one code cell is the program its task asks
for (`data/gym_programs.py`: `math.gcd(...)`, `int(s, 2)`, `sorted(...)`, ...). The program runs
in the real sandbox; a problem is kept only when its task's own scorer gives full marks to the
answer block the conversation ends with, `<answer>\\boxed{printed}</answer>`: the answer is what
the program printed, so the policy learns to trust its tool's output. Conversations have the
shape of GSM8K's (a share shows a NameError and its fix).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from codeloop.data.gym_programs import program
from codeloop.data.problems import Problem
from codeloop.recipe.gsm8k_sft import Built, build
from codeloop.reward.extract import extract_answer
from codeloop.reward.task import TaskGold, task_score
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.tools import ToolExecutor


def task_cell(problem: Problem) -> str | None:
    """The program of the problem's task, or None (no task, or no generator for it)."""
    if not problem.task:
        return None
    return program(problem.task, json.loads(problem.metadata or "{}"), problem.problem)


def scored_answer(printed: str, problem: Problem) -> str | None:
    """What the program printed, when the task's scorer gives full marks to it as the
    conversation's answer block; else None."""
    answer = printed.strip()
    if not answer or "\n" in answer or not problem.task:
        return None
    extracted = extract_answer(f"<answer>\\boxed{{{answer}}}</answer>").answer
    gold = TaskGold(problem.task, problem.answer, problem.metadata or "{}")
    return answer if extracted is not None and task_score(extracted, gold) else None


async def build_gym(
    problems: Sequence[Problem],
    tools: ToolExecutor,
    fmt: PromptFormat,
    error_share: float = 0.15,
    *,
    seed: int = 0,
) -> Built:
    """One conversation per gym problem whose task's program prints an answer its scorer
    accepts (see the module docstring)."""
    return await build(
        problems, tools, fmt, error_share, seed=seed, cell=task_cell, check=scored_answer
    )
