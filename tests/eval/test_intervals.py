"""Intervals and paired comparisons of scores (`codeloop.intervals`, `codeloop compare`),
against values worked out by hand."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from codeloop.intervals import compare, interval, verdict
from codeloop.recipe.points import first_vs_last


def test_the_interval_of_equal_scores_is_that_score() -> None:
    assert interval([0.25] * 10) == (0.25, 0.25)


def test_the_interval_of_half_right_problems_is_about_two_standard_errors() -> None:
    # 50 problems always right, 50 never: mean 0.5, standard error 0.5 / sqrt(100) = 0.05
    low, high = interval([1.0] * 50 + [0.0] * 50)
    assert low == pytest.approx(0.5 - 1.96 * 0.05, abs=0.015)
    assert high == pytest.approx(0.5 + 1.96 * 0.05, abs=0.015)


def test_an_interval_near_zero_stays_inside_the_scores() -> None:
    low, high = interval([0.5] + [0.0] * 99)  # one correct sample of two on one problem
    assert low == 0.0 and 0.0 < high <= 0.02


def test_the_same_scores_compare_as_no_difference() -> None:
    a = {f"p{i}": i / 10 for i in range(10)}
    result = compare(a, dict(a))
    assert result["difference"] == 0.0 and result["interval95"] == [0.0, 0.0]
    assert result["p_value"] == 1.0
    assert verdict(result).startswith("no difference shown between A and B (inside the noise)")


def test_five_correct_against_one_is_inside_the_noise() -> None:
    # 100 problems x 2 samples; A is right once on each of p0-p4, B once on p0: the differences
    # are four -0.5 and zeros, and 2 of the 16 sign patterns of the four reach |sum| = 2
    a = {f"p{i}": 0.5 if i < 5 else 0.0 for i in range(100)}
    b = {f"p{i}": 0.5 if i == 0 else 0.0 for i in range(100)}
    result = compare(a, b)
    assert result["a"] == 0.025 and result["b"] == 0.005
    assert result["difference"] == pytest.approx(-0.02)
    assert result["p_value"] == pytest.approx(2 / 16, abs=0.01)
    assert "inside the noise" in verdict(result, "sft", "rl")


def test_a_consistent_gain_is_reported_as_one() -> None:
    a = {f"p{i}": 0.25 for i in range(20)}
    b = {f"p{i}": 0.75 for i in range(20)}
    result = compare(a, b)  # every sign the same: 2 of 2^20 patterns, below 1 / 10,001
    assert result["interval95"] == [0.5, 0.5] and result["p_value"] < 2e-4
    assert verdict(result, "sft", "rl").startswith("rl is better than sft: +50.0 points")
    assert verdict(compare(b, a), "sft", "rl").startswith("rl is worse than sft: -50.0 points")


def test_only_the_problems_both_scored_are_paired() -> None:
    result = compare({"x": 1.0, "y": 0.0, "z": 1.0}, {"y": 1.0, "z": 1.0, "w": 0.0})
    assert (result["problems"], result["only_in_a"], result["only_in_b"]) == (2, 1, 1)
    assert result["difference"] == 0.5
    with pytest.raises(ValueError, match="share no problem"):
        compare({"x": 1.0}, {"y": 1.0})


def test_a_recipe_ends_with_its_last_point_against_its_first() -> None:
    sft = {"stage": "sft", "pass@1": 0.25, "per_problem": {f"p{i}": 0.25 for i in range(20)}}
    rl = {"stage": "rl", "pass@1": 0.75, "per_problem": {f"p{i}": 0.75 for i in range(20)}}
    assert first_vs_last([sft, rl], "dev pass@1").startswith(
        "dev pass@1, rl against sft: rl is better than sft: +50.0 points"
    )


def _compare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "codeloop", "compare", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compare_command_pairs_two_evaluations(
    scripted_run: tuple[Path, dict], tmp_path: Path
) -> None:
    a = scripted_run[0]  # per-problem shares 0, 1/4, 2/4, 3/4, 1
    b = tmp_path / "b"
    b.mkdir()
    rows = [json.loads(line) for line in (a / "results.jsonl").read_text().splitlines()]
    lines = [json.dumps({**r, "correct": [True] * len(r["correct"])}) + "\n" for r in rows]
    (b / "results.jsonl").write_text("".join(lines))
    done = _compare(str(a), str(b / "results.jsonl"), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    # differences 1, 3/4, 1/2, 1/4, 0: mean 1/2; the four nonzero ones share a sign in 2 of 16
    assert result["difference"] == 0.5 and result["problems"] == 5
    assert result["p_value"] == pytest.approx(2 / 16, abs=0.01)
    text = _compare(str(a), str(b)).stdout.splitlines()
    assert text[0].startswith("A: 50.0% [") and text[1].startswith("B: 100.0% [100.0, 100.0]")
    assert text[2].startswith("no difference shown between A and B (inside the noise): +50.0")


def test_compare_names_what_it_cannot_read(tmp_path: Path) -> None:
    done = _compare(str(tmp_path), str(tmp_path))
    assert done.returncode == 2
    assert (
        done.stderr == f"codeloop compare: {tmp_path}: no results.jsonl (give a codeloop "
        "eval output directory or its results.jsonl)\n"
    )


def test_resampling_is_done_in_blocks_that_add_up_to_every_resample() -> None:
    from codeloop.intervals import RESAMPLES, _blocks

    for problems in (1, 100, 200, 201, 5_000, 50_000, 3_000_000):
        blocks = _blocks(problems)
        assert sum(blocks) == RESAMPLES and min(blocks) >= 1
        assert max(blocks) * problems <= max(2_000_000, problems)  # at most ~2M values at once
    assert _blocks(100) == [RESAMPLES]  # small benchmarks: one matrix, as drawn before


def test_the_p_value_counts_the_observed_pattern_among_the_resamples() -> None:
    """A sign-flip p-value is (hits + 1) / (resamples + 1): the observed signs are one of the
    patterns. With 20 problems all gaining, no resample of 10,000 flips every sign alike (2 in
    2^20), so p is exactly 1 / 10,001, never 0."""
    from codeloop.intervals import RESAMPLES

    a = {f"p{i}": 0.0 for i in range(20)}
    b = {f"p{i}": 1.0 for i in range(20)}
    assert compare(a, b)["p_value"] == 1 / (RESAMPLES + 1)
