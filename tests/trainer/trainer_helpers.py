from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from codeloop.config import SFTConfig
from codeloop.data.tokenizer import train_tokenizer
from codeloop.engine.model import tiny_model
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.tools import PYTHON_TOOL
from codeloop.trainer.sft import train_sft

CORPUS = [
    "Solve the problem step by step. What is 12345 + 678? The answer is 13023.",
    "print(sum(range(10)))\nx = [i * i for i in range(5)]\n",
    '{"name": "execute_python_code_with_standard_io", "arguments": {"code": "print(1)"}}',
]


@pytest.fixture(scope="session")
def trainer_fmt() -> PromptFormat:
    return PromptFormat(train_tokenizer(CORPUS * 20, vocab_size=400))


PAIRS = [(1, 2), (3, 4), (10, 20), (7, 8)]


@pytest.fixture(scope="session")
def sft_weights(trainer_fmt: PromptFormat) -> dict[str, torch.Tensor]:
    """A tiny policy that has learnt the tool format on PAIRS' problems, but not perfectly."""
    model = tiny_model(len(trainer_fmt.tokenizer), hidden_size=64, layers=2)
    data = [conversation(trainer_fmt, a, b) for a, b in PAIRS]
    cfg = SFTConfig(epochs=60, lr=1e-2, warmup_steps=5, conversations_per_step=4)
    train_sft(model, trainer_fmt, data, cfg)
    return copy.deepcopy(model.state_dict())


def conversation(fmt: PromptFormat, a: int, b: int) -> list[dict[str, str]]:
    call = json.dumps({"name": PYTHON_TOOL, "arguments": {"code": f"print({a} + {b})"}})
    return [
        *fmt.messages(f"What is {a} + {b}?"),
        {
            "role": "assistant",
            "content": f"<reason>Compute it.</reason>\n<tool_call>\n{call}\n</tool_call>",
        },
        {"role": "tool", "content": str(a + b)},
        {"role": "assistant", "content": f"<answer>\\boxed{{{a + b}}}</answer>"},
    ]


def cli_inputs(fmt: PromptFormat, root: Path) -> tuple[Path, Path, Path]:
    """A tiny saved base model, SFT conversations and RL problems for the CLI tests."""
    base, sft_data, problems = root / "base", root / "sft.jsonl", root / "train.jsonl"
    tiny_model(len(fmt.tokenizer)).save_pretrained(base)
    fmt.tokenizer.save_pretrained(base)
    sft_data.write_text(
        "".join(
            json.dumps({"messages": conversation(fmt, a, b)}) + "\n"
            for a, b in [(1, 2), (3, 4), (5, 6)]
        )
    )
    rows = [{"id": f"q{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]
    problems.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return base, sft_data, problems


def rl_arguments(model: Path, problems: Path, run_dir: Path, prompts_per_step: int) -> list[str]:
    """`codeloop train` options for a two-sample, 32-token, checkpoint-every-step run. Groups
    without signal stay in the step rather than being refilled, so that a step's trajectories
    are the same in number whatever a barely trained policy gets right."""
    return [
        "--trainer.model",
        str(model),
        "--data.train",
        str(problems),
        "--trainer.output_dir",
        str(run_dir),
        "--trainer.prompts_per_step",
        str(prompts_per_step),
        "--algo.group_size",
        "2",
        "--rollout.max_response_tokens",
        "32",
        "--sandbox.workers",
        "1",
        "--reward.workers",
        "1",
        "--trainer.checkpoint_every",
        "1",
        "--algo.drop_zero_signal_groups",
        "false",
    ]


def recipe_config(
    path: Path,
    model: Path,
    problems: Path,
    run_dir: Path,
    stages: str,
    checkpoint_every: int = 1,
    refill: bool = True,
) -> Path:
    """A `codeloop recipe` config at `path`: two samples a group, 16 tokens, one sandbox and one
    verifier worker, over `model` and `problems`; `stages`: its [[recipe.stages]] as TOML."""
    path.write_text(f"""
[trainer]
model = "{model}"
output_dir = "{run_dir}"
prompts_per_step = 2
checkpoint_every = {checkpoint_every}
[data]
train = "{problems}"
[algo]
group_size = 2
drop_zero_signal_groups = {str(refill).lower()}
[rollout]
max_response_tokens = 16
[sandbox]
workers = 1
[reward]
workers = 1
{stages}""")
    return path
