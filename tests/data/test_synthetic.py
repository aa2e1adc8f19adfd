import random
import subprocess
import sys

import pytest

from codeloop.data.synthetic import make_task, problems, split_of, syntax_error, tasks


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_the_program_prints_the_answer(difficulty: int) -> None:
    rng = random.Random(difficulty)
    for _ in range(20):
        task = make_task(rng, difficulty)
        out = subprocess.run([sys.executable, "-c", task.code], capture_output=True, text=True)
        assert out.stdout.strip() == str(task.answer), task


def test_hand_checked_examples() -> None:
    rng = random.Random(0)
    for difficulty, op in ((1, "+"), (2, "-"), (3, "%")):
        task = make_task(rng, difficulty)
        left, right = task.text.removeprefix("What is ").removesuffix("?").split(f" {op} ")
        a, b = int(left), int(right)
        assert task.answer == {"+": a + b, "-": a - b, "%": a % b}[op]
        assert task.code == f"print({a} {op} {b})"


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_one_shape_three_digit_operands_and_answers(difficulty: int) -> None:
    rng = random.Random(difficulty)
    for _ in range(200):
        task = make_task(rng, difficulty)
        assert len(task.text) == len("What is 123 + 456?")
        assert 100 <= task.answer <= 999


def test_generation_is_deterministic_and_splits_are_disjoint() -> None:
    counts = {1: 30, 2: 30, 3: 30}
    train = problems(7, "train", counts)
    assert train == problems(7, "train", counts)
    heldout = problems(7, "heldout", counts)
    assert not {p.problem for p in train} & {p.problem for p in heldout}
    assert all(split_of(p.problem) == "heldout" for p in heldout)
    assert len({p.problem for p in train}) == len(train) == 90
    assert problems(8, "train", counts) != train


def test_bad_difficulty() -> None:
    with pytest.raises(ValueError, match="difficulty must be 1, 2 or 3"):
        next(tasks(0, "train", 4))


def test_demonstrations_mix_clean_and_imperfect_traces() -> None:
    from collections import Counter

    from codeloop.data.synthetic import demonstration

    rng = random.Random(3)
    kinds: Counter[str] = Counter()
    for _ in range(400):
        task = make_task(rng, 2)
        turns = demonstration(task, rng, error_share=0.2, no_tool_share=0.3)
        assert turns[0]["content"].startswith("<reason>")  # as the template opens turn 1
        assert turns[-1]["role"] == "assistant" and "<answer>\\boxed{" in turns[-1]["content"]
        calls = [t for t in turns if "<tool_call>" in t["content"]]
        if len(calls) == 2:
            kinds["fixed"] += 1
            broken = task.code[:-1]
            assert broken + '"}}' in calls[0]["content"]
            assert turns[1]["content"] == syntax_error(broken)
            assert task.code in calls[1]["content"] and turns[3]["content"] == str(task.answer)
        elif calls:
            kinds["clean"] += 1
            assert turns[-1]["content"] == f"<answer>\\boxed{{{task.answer}}}</answer>"
        else:
            kinds["no_tool"] += 1
    assert 0.4 < kinds["clean"] / 400 < 0.6
    assert 0.1 < kinds["fixed"] / 400 < 0.3 and 0.2 < kinds["no_tool"] / 400 < 0.4
