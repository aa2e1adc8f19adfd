import asyncio
import json

from codeloop.config import SandboxConfig
from codeloop.data.problems import Problem
from codeloop.data.tokenizer import train_tokenizer
from codeloop.recipe.gsm8k_sft import Built, build, code_cell
from codeloop.rollout.prompt import PromptFormat
from codeloop.sandbox.pool import LocalSandbox
from codeloop.trainer.sft import encode_conversation

CLIPS = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May."
)


def test_the_annotations_become_a_cell_that_prints_the_answer() -> None:
    question = "Natalia sold clips to 48 of her friends in April, and half as many in May."
    assert code_cell(CLIPS, "72", question) == (
        "# Natalia sold 48/2 clips in May.\n"
        "x1 = 48/2\n"
        "# Natalia sold 48+x1 clips altogether in April and May.\n"
        "x2 = 48+x1\n"
        "print(x2)"
    )
    # the answer is an earlier result: that one is printed; no result equal to it: no cell
    two = "A = <<3*4=12>>12, B = <<12+1,000=1,012>>1,012"
    assert code_cell(two, "12") == "# A, B\nx1 = 3*4\nx2 = x1+1,000\nprint(x1)"
    assert code_cell("B = <<2+1000=1,002>>1,002", "1002") == "# B\nx1 = 2+1000\nprint(x1)"
    assert code_cell(CLIPS, "73") is None
    assert code_cell("No computation here.", "5") is None


def test_an_earlier_result_that_the_problem_states_stays_a_number() -> None:
    solution = "She has 3 * 4 = $<<3*4=12>>12.\nThen 12 + 12 = <<12+12=24>>24 in all."
    # 12 is in the question: both 12s may be the given one, so neither is renamed
    assert code_cell(solution, "24", "She earns $12 a day and 3 * 4...") == (
        "# She has 3 * 4.\nx1 = 3*4\n# Then 12 + 12 in all.\nx2 = 12+12\nprint(x2)"
    )
    assert code_cell(solution, "24", "3 times 4 dollars").endswith("x2 = x1+x1\nprint(x2)")


def _build(problems: list[Problem], error_share: float) -> tuple[Built, PromptFormat]:
    fmt = PromptFormat(train_tokenizer([CLIPS, "print(x2) NameError"] * 20, vocab_size=400))

    async def main() -> Built:
        async with LocalSandbox(SandboxConfig(workers=1)) as sandbox:
            return await build(problems, sandbox, fmt, error_share=error_share)

    return asyncio.run(main()), fmt


def test_conversations_carry_the_sandboxs_real_output() -> None:
    problems = [
        Problem("0", "How many clips?", "72", CLIPS),
        Problem("1", "Tuple?", "6", "It is <<(1,2)[5]=6>>6."),  # IndexError in the sandbox
        Problem("2", "Nothing?", "5", "Five."),
    ]
    built, fmt = _build(problems, error_share=0.0)
    assert built.dropped == {
        "the code does not print the answer": 1,
        "no computation gives the answer": 1,
    }
    (clean,) = built.conversations
    assert [m["role"] for m in clean] == ["system", "user", "assistant", "tool", "assistant"]
    call = clean[2]["content"]
    assert call.startswith("<reason>Compute it.</reason>\n<tool_call>\n")
    payload = json.loads(call.split("<tool_call>\n")[1].split("\n</tool_call>")[0])
    assert payload["arguments"]["code"] == code_cell(CLIPS, "72", "How many clips?")
    assert clean[3]["content"] == "72.0"  # what the sandbox printed (48/2 is a float)
    assert clean[4]["content"] == "<answer>\\boxed{72}</answer>"
    assert sum(encode_conversation(fmt, clean).loss_mask) > 0  # it renders for SFT


def test_an_error_then_its_fix() -> None:
    built, _ = _build([Problem("0", "How many clips?", "72", CLIPS)], error_share=1.0)
    (fixed,) = built.conversations
    roles = [m["role"] for m in fixed]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert "print(answer)" in fixed[2]["content"]
    assert fixed[3]["content"].startswith("Traceback (most recent call last):")
    assert fixed[3]["content"].endswith("NameError: name 'answer' is not defined")
    assert "print(x2)" in fixed[4]["content"] and fixed[5]["content"] == "72.0"  # 48/2 is a float
