import json
import subprocess
import sys
from pathlib import Path

from codeloop.data.problems import Problem
from codeloop.data.stats import problem_stats


def test_hand_counted_stats() -> None:
    problems = [
        Problem("a", "What is 1 + 1?", "2"),
        Problem("b", "what is  1 + 1?", "2"),  # the same problem, other case and spacing
        Problem("b", "Find x.", "\\frac{1}{2}"),  # a repeated id
        Problem("c", "Count them", "1,000"),
    ]
    assert problem_stats(problems) == {
        "problems": 4,
        "integer_answers": 3,
        "integer_share": 0.75,
        "duplicate_problems": 1,
        "duplicate_ids": 1,
        "chars_median": 14,
        "chars_max": 15,
    }


def test_the_command(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": 1, "problem": "x", "answer": "3"}) + "\n")
    run = subprocess.run(
        [sys.executable, "-m", "codeloop", "data", "stats", str(path)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0 and json.loads(run.stdout)["integer_share"] == 1.0
    command = [
        sys.executable,
        "-m",
        "codeloop",
        "data",
        "stats",
        str(path),
        "--data.answer_field",
        "solution",
    ]
    bad = subprocess.run(command, capture_output=True, text=True)
    assert bad.returncode == 2 and "p.jsonl:1: missing field 'solution'" in bad.stderr
