import json
import subprocess
import sys
from pathlib import Path

from codeloop.data.curate import curate, decontaminate, dedupe, integer_only, ngrams
from codeloop.data.problems import Problem

BENCH = [
    Problem(
        "aime-1",
        "Find the number of ordered pairs $(x,y)$ of integers such that "
        "$x^2 + y^2 = 2025$ and $x < y$.",
        "12",
    ),
    Problem(
        "aime-2", "Let $m/n$ be the probability that a fair die shows six twice in a row.", "37"
    ),
]


def test_ngrams_are_lower_case_whitespace_words() -> None:
    assert ngrams("A b  C\nd", 2) == {("a", "b"), ("b", "c"), ("c", "d")}
    assert ngrams("one two", 8) == {("one", "two")}  # shorter than n: the whole text
    assert ngrams("   ", 8) == set()


def test_copied_benchmark_text_is_found_even_with_other_case_and_spacing() -> None:
    train = [
        # the benchmark's first 9 words inside another problem, in capitals, on two lines
        Problem(
            "t1", "FIND THE NUMBER OF ORDERED PAIRS $(x,y)$ OF INTEGERS\nsuch that x > 3.", "1"
        ),
        # shares 7 consecutive words only: not contaminated at n = 8
        Problem("t2", "Find the number of ordered pairs $(x,y)$ with $x = y$.", "1"),
        Problem("t3", "What is 2 + 2?", "4"),
    ]
    kept, removed = decontaminate(train, BENCH, n=8)
    assert [p.id for p in kept] == ["t2", "t3"]
    assert [(r.id, r.reason) for r in removed] == [("t1", "contaminated")]
    assert removed[0].detail.startswith("aime-1: ")
    assert removed[0].detail.split(": ", 1)[1] in {
        " ".join(g) for g in ngrams(BENCH[0].problem, 8)
    }  # the shared n-gram is named
    kept7, _ = decontaminate(train, BENCH, n=7)
    assert [p.id for p in kept7] == ["t3"]


def test_a_short_benchmark_problem_copied_whole_is_found() -> None:
    bench = [Problem("b", "Compute 17 * 23.", "391")]
    train = [Problem("t", "compute 17 * 23.", "391"), Problem("u", "Compute 17 * 24.", "408")]
    kept, removed = decontaminate(train, bench, n=8)
    assert [p.id for p in kept] == ["u"] and removed[0].id == "t"


def test_integer_only_and_dedupe() -> None:
    problems = [
        Problem("a", "What is 1+1?", "2"),
        Problem("b", "Half of one?", "\\frac{1}{2}"),
        Problem("c", "what  is 1+1?", "2"),  # same words, other case and spacing
        Problem("d", "Big?", "1,000"),
        Problem("e", "Float?", "12.0"),
    ]
    kept, removed = integer_only(problems)
    assert [p.id for p in kept] == ["a", "c", "d", "e"]
    assert [(r.id, r.reason, r.detail) for r in removed] == [
        ("b", "non_integer_answer", "\\frac{1}{2}")
    ]
    kept, removed = dedupe(problems)
    assert [p.id for p in kept] == ["a", "b", "d", "e"]
    assert [(r.id, r.reason, r.detail) for r in removed] == [("c", "duplicate", "a")]


def test_curate_applies_the_filters_in_order_and_accounts_for_every_problem() -> None:
    problems = [Problem(str(i), f"Problem number {i % 3} here.", str(i)) for i in range(6)]
    problems.append(
        Problem(
            "x",
            "Let $m/n$ be the probability that a fair die shows six twice in a row. Find m+n.",
            "37",
        )
    )
    problems.append(Problem("y", "Ratio?", "3/4"))
    kept, removed = curate(problems, benchmarks=BENCH)
    assert [p.id for p in kept] == ["0", "1", "2"]
    reasons = {r.id: r.reason for r in removed}
    assert reasons == {
        "3": "duplicate",
        "4": "duplicate",
        "5": "duplicate",
        "x": "contaminated",
        "y": "non_integer_answer",
    }
    assert len(kept) + len(removed) == len(problems)


def _write(path: Path, problems: list[Problem]) -> None:
    path.write_text("".join(json.dumps(p.__dict__) + "\n" for p in problems))


def test_filter_and_decontaminate_commands(tmp_path: Path) -> None:
    train = [
        Problem("a", "What is 1+1?", "2"),
        Problem("b", "what is 1+1?", "2"),
        Problem("c", "Half?", "0.5"),
        Problem("d", BENCH[1].problem, "37"),
    ]
    _write(tmp_path / "train.jsonl", train)
    _write(tmp_path / "bench.jsonl", BENCH)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "codeloop", "data", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    done = run(
        "filter",
        str(tmp_path / "train.jsonl"),
        "--against",
        str(tmp_path / "bench.jsonl"),
        "--out",
        str(tmp_path / "kept.jsonl"),
    )
    assert done.returncode == 0, done.stderr
    kept = [json.loads(line) for line in (tmp_path / "kept.jsonl").read_text().splitlines()]
    assert kept == [{"id": "a", "problem": "What is 1+1?", "answer": "2"}]
    removed = [
        json.loads(line) for line in (tmp_path / "kept.removed.jsonl").read_text().splitlines()
    ]
    assert {r["id"]: r["reason"] for r in removed} == {
        "b": "duplicate",
        "c": "non_integer_answer",
        "d": "contaminated",
    }
    assert removed[-1]["detail"].startswith("bench.jsonl:aime-2: ")
    done = run(
        "decontaminate",
        str(tmp_path / "train.jsonl"),
        "--against",
        str(tmp_path / "bench.jsonl"),
        "--out",
        str(tmp_path / "clean.jsonl"),
    )
    assert done.returncode == 0, done.stderr
    clean = [json.loads(line)["id"] for line in (tmp_path / "clean.jsonl").read_text().splitlines()]
    assert clean == ["a", "b", "c"]  # decontamination only
    (tmp_path / "bad.jsonl").write_text('{"id": "z", "problem": "x"}\n')
    done = run("filter", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o.jsonl"))
    assert done.returncode == 2 and "bad.jsonl:1: missing field 'answer'" in done.stderr


def test_gym_problems_keep_answers_that_are_not_integers() -> None:
    """Their task scores the answer (a fraction, a time, a factor list), not the math verifier."""
    problems = [
        Problem("f", "Simplify 2/4.", "1/2", task="fraction_simplification"),
        Problem("m", "Half of 3?", "1.5"),
        Problem("i", "2 + 2?", "4"),
    ]
    kept, removed = integer_only(problems)
    assert [p.id for p in kept] == ["f", "i"] and [r.id for r in removed] == ["m"]
