"""A tokenizer trained here (nothing downloaded) and a scripted engine for the rollout tests."""

from __future__ import annotations

import pytest

from codeloop.data.tokenizer import train_tokenizer
from codeloop.engine.protocol import Generation, SamplingParams
from codeloop.rollout.prompt import PromptFormat

CORPUS = [
    "Solve the problem step by step. What is 12345 + 678? The answer is 13023.",
    "print(sum(range(10)))\nx = [i * i for i in range(5)]\ndef f(n):\n    return n ** 2\n",
    '{"name": "execute_python_code_with_standard_io", "arguments": {"code": "print(1)"}}',
    "Traceback (most recent call last): ZeroDivisionError: division by zero",
]


@pytest.fixture(scope="session")
def fmt() -> PromptFormat:
    return PromptFormat(train_tokenizer(CORPUS * 20, vocab_size=400))


class ScriptedEngine:
    """Replays scripted assistant turns as sampled tokens, stopping the way an engine would."""

    def __init__(self, fmt: PromptFormat, turns: list[str], logprob: float = -0.25):
        self.fmt, self.turns, self.logprob = fmt, list(turns), logprob
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        ids = self.fmt.encode(self.turns.pop(0))
        if len(ids) > params.max_tokens:
            ids = ids[: params.max_tokens]
            return Generation(ids, [self.logprob] * len(ids), "length")
        return Generation(ids, [self.logprob] * len(ids), "stop")
