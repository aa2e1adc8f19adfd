from __future__ import annotations

import json

import pytest

from codeloop.data.tokenizer import train_tokenizer
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.toolcall import TOOL_NAME

CORPUS = [
    "Solve the problem step by step. What is 12345 + 678? The answer is 13023.",
    "print(sum(range(10)))\nx = [i * i for i in range(5)]\n",
    '{"name": "execute_python_code_with_standard_io", "arguments": {"code": "print(1)"}}',
]


@pytest.fixture(scope="session")
def trainer_fmt() -> PromptFormat:
    return PromptFormat(train_tokenizer(CORPUS * 20, vocab_size=400))


def conversation(fmt: PromptFormat, a: int, b: int) -> list[dict[str, str]]:
    call = json.dumps({"name": TOOL_NAME, "arguments": {"code": f"print({a} + {b})"}})
    return [
        *fmt.messages(f"What is {a} + {b}?"),
        {
            "role": "assistant",
            "content": f"<reason>Compute it.</reason>\n<tool_call>\n{call}\n</tool_call>",
        },
        {"role": "tool", "content": str(a + b)},
        {"role": "assistant", "content": f"<answer>\\boxed{{{a + b}}}</answer>"},
    ]
