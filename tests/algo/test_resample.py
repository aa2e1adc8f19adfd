import random
from collections import Counter

import pytest

from codeloop.algo.resample import PENALTY_FLOOR, _split, _split_released, penalty, resample
from codeloop.types import (
    ExecResult,
    ExecStatus,
    RolloutStatus,
    ToolCall,
    ToolCallRecord,
    Trajectory,
)


def _record(status: ExecStatus = ExecStatus.OK, parse_error: str | None = None) -> ToolCallRecord:
    call = None if parse_error else ToolCall("python", {"code": "1"}, "")
    return ToolCallRecord(call, ExecResult(status=status), parse_error)


def _traj(
    index: int = 0,
    reward: float | None = 1.0,
    text: str = "<answer>\\boxed{1}</answer>",
    calls: list[ToolCallRecord] | None = None,
    turns: int = 1,
) -> Trajectory:
    return Trajectory(
        "p",
        index,
        [1],
        [2],
        [1],
        [0.0],
        RolloutStatus.ANSWERED,
        calls or [],
        num_turns=turns,
        reward=reward,
        text=text,
    )


@pytest.mark.parametrize(
    ("calls", "p_err"),
    [
        ([], 0.5),  # no tool call
        ([_record()], 0.0),
        ([_record(), _record(ExecStatus.ERROR), _record(), _record()], 0.25),
        ([_record(ExecStatus.TIMEOUT), _record(parse_error="bad json")], 1.0),
        # an infrastructure fault is not the model's error (RL leaves such trajectories out)
        ([_record(ExecStatus.MEMORY), _record(), _record(ExecStatus.SANDBOX_ERROR)], 1 / 3),
    ],
)
def test_p_err_counts_every_status_the_model_caused(
    calls: list[ToolCallRecord], p_err: float
) -> None:
    assert penalty(_traj(calls=calls)).p_err == pytest.approx(p_err)


@pytest.mark.parametrize(
    ("text", "turns", "p_format"),
    [
        ("<answer>\\boxed{1}</answer>", 1, 0.0),  # one turn, one answer: clean
        ("no answer at all", 3, 1.0),
        ("<answer>1</answer> <answer>2</answer> <answer>3</answer>", 4, 0.5),  # (3 - 1) / 4
        ("<answer>1</answer><answer>2</answer>", 1, 1.0),  # min(1, 1 / 1)
        ("<answer>1</answer><answer>2</answer><answer>3</answer>", 1, 1.0),  # min(1, 2 / 1)
        ("<answer>1</answer><answer>2</answer>", 4, 0.25),
        ("<answer>\\boxed{1}", 2, 1.0),  # unclosed
        ("<answer>1</answer> then <answer>2", 2, 1.0),  # one closed, one unclosed
        ("<tool_response><answer>9</answer></tool_response><answer>1</answer>", 2, 0.0),
        ("<answer>1</answer>", 0, 0.0),  # an unset turn count is at least 1
    ],
)
def test_p_format_counts_answers_per_assistant_turn(text: str, turns: int, p_format: float) -> None:
    assert penalty(_traj(text=text, turns=turns)).p_format == pytest.approx(p_format)


@pytest.mark.parametrize(
    ("n_pos", "n_neg", "keep", "split"),
    [
        (10, 22, 16, (5, 11)),  # floor(22 / 2) negatives
        (1, 31, 16, (1, 15)),  # floor(31 / 2) = 15; the single positive stays
        (31, 1, 16, (16, 0)),  # floor(1 / 2) = 0
        (32, 0, 16, (16, 0)),  # all correct
        (0, 32, 16, (0, 16)),  # all wrong
        (3, 7, 10, (3, 7)),  # fewer than 2G sampled: keep what there is
        (16, 16, 16, (8, 8)),
    ],
)
def test_report_split(n_pos: int, n_neg: int, keep: int, split: tuple[int, int]) -> None:
    assert _split(n_pos, n_neg, keep) == split


@pytest.mark.parametrize(
    ("n_pos", "n_neg", "keep", "split"),
    [
        (10, 22, 16, (5, 11)),  # proportional: round(11.0)
        (31, 1, 16, (15, 1)),  # round(0.5) = 0 negatives, raised to the one there is
        (1, 31, 16, (1, 15)),  # the single positive is kept
        (30, 2, 16, (14, 2)),  # round(1.0) = 1, raised to the minimum of 2
        (2, 30, 16, (2, 14)),
        (32, 0, 16, (16, 0)),
    ],
)
def test_released_split(n_pos: int, n_neg: int, keep: int, split: tuple[int, int]) -> None:
    assert _split_released(n_pos, n_neg, keep) == split


def _group(rewards: list[float], clean: frozenset[int] = frozenset()) -> list[Trajectory]:
    dirty = [_record(ExecStatus.ERROR), _record()]  # p_err 0.5, p_format 0: p_total 0.5
    return [_traj(i, r, calls=[_record()] if i in clean else dirty) for i, r in enumerate(rewards)]


def test_roc_keeps_g_with_the_report_split_and_sample_order() -> None:
    group = _group([1, 0, 0, 1, 0, 0, 1, 0])  # 3 positives, 5 negatives, keep 4
    kept = resample(group, 4, "roc", random.Random(0))
    assert len(kept) == 4
    assert sum(t.reward == 0 for t in kept) == 2  # floor(5 * 4 / 8)
    assert [t.sample_index for t in kept] == sorted(t.sample_index for t in kept)


def test_roc_prefers_clean_positives_in_proportion_to_inverse_penalty() -> None:
    # Two positives, one to keep: p_total 0 (weight 1 / 0.05 = 20) against p_total 1.5.
    clean = _traj(0, 1.0, calls=[_record()])  # p_total 0
    dirty = _traj(
        1,
        1.0,
        text="<answer>1</answer><answer>2</answer>",
        calls=[_record(ExecStatus.ERROR)],
        turns=2,
    )  # p_err 1, p_format 0.5
    negatives = [_traj(i, 0.0) for i in range(2, 4)]
    w_clean, w_dirty = 1 / PENALTY_FLOOR, 1 / (1.5 + PENALTY_FLOOR)
    expected = w_clean / (w_clean + w_dirty)  # 0.9687
    runs = 4000
    picked = sum(
        resample([clean, dirty, *negatives], 2, "roc", random.Random(seed))[0].sample_index == 0
        for seed in range(runs)
    )
    assert abs(picked / runs - expected) < 0.015


def test_roc_is_seeded() -> None:
    group = _group([1, 0] * 8, clean=frozenset({0, 4}))
    first = [t.sample_index for t in resample(group, 8, "roc", random.Random(7))]
    assert first == [t.sample_index for t in resample(group, 8, "roc", random.Random(7))]
    others = {
        tuple(t.sample_index for t in resample(group, 8, "roc", random.Random(s)))
        for s in range(20)
    }
    assert len(others) > 1


def test_edge_groups() -> None:
    rng = random.Random(0)
    assert len(resample(_group([1.0] * 8), 4, "roc", rng)) == 4  # all correct
    all_wrong = resample(_group([0.0] * 8), 4, "roc", rng)
    assert len(all_wrong) == 4 and all(t.reward == 0 for t in all_wrong)
    single = resample(_group([0, 0, 0, 1, 0, 0, 0, 0]), 4, "roc", rng)
    assert [t.reward for t in single].count(1.0) == 1  # keep 4 - floor(7 / 2) = 1 positive
    no_tools = [_traj(i, 1.0) for i in range(4)]  # p_err 0.5 each: uniform among positives
    assert len(resample(no_tools, 2, "roc", rng)) == 2


def test_released_variant_keeps_negatives_in_sample_order() -> None:
    # Negatives 3, 4, 5; only 5 made clean tool calls. Sorting by penalty (removed by rStar
    # PR #50) would keep 5; the released code keeps the first two in sample order.
    group = _group([1, 1, 1, 0, 0, 0, 1, 1], clean=frozenset({1, 5, 6}))
    kept = resample(group, 4, "roc_released", random.Random(0))
    assert [t.sample_index for t in kept] == [1, 3, 4, 6]


def test_released_variant_is_deterministic_lowest_penalty() -> None:
    group = _group([1, 1, 1, 0, 0, 0, 1, 1], clean=frozenset({1, 6}))
    kept = resample(group, 4, "roc_released", random.Random(0))
    # round(3 * 4 / 8) = 2 negatives (the first two: equal penalties, ties by index) and the two
    # clean positives
    assert [t.sample_index for t in kept] == [1, 3, 4, 6]
    assert kept == resample(group, 4, "roc_released", random.Random(99))


def test_plain_grpo_takes_the_first_g() -> None:
    group = list(reversed(_group([1, 0, 1, 0, 1, 0])))
    assert [t.sample_index for t in resample(group, 3, "none", random.Random(0))] == [0, 1, 2]


def test_bad_input_is_an_error() -> None:
    with pytest.raises(ValueError, match="reward"):
        resample([_traj(0, None)], 1, "roc", random.Random(0))
    with pytest.raises(ValueError, match="reward"):  # one unscored among scored ones
        resample([_traj(0, 1.0), _traj(1, None)], 1, "roc", random.Random(0))
    with pytest.raises(ValueError, match="unknown mode 'rock'"):
        resample([_traj(0, 1.0)], 1, "rock", random.Random(0))


def test_roc_keeps_negatives_uniformly_at_random() -> None:
    # 2 positives, 6 negatives, keep 4: floor(6 x 4 / 8) = 3 negatives, each 3-subset of the 6
    # equally likely: chi-square of the 20 subsets' counts against uniform over 20,000 draws
    trajectories = [_traj(i, 1.0 if i < 2 else 0.0) for i in range(8)]
    rng = random.Random(0)
    counts: Counter[tuple[int, ...]] = Counter()
    draws = 20_000
    for _ in range(draws):
        kept = resample(trajectories, 4, "roc", rng)
        counts[tuple(t.sample_index for t in kept if t.reward == 0.0)] += 1
    assert len(counts) == 20 and all(len(subset) == 3 for subset in counts)
    expected = draws / 20
    chi_square = sum((n - expected) ** 2 / expected for n in counts.values())
    assert chi_square < 43.82  # the 99.9th percentile of chi-square with 19 degrees of freedom


def test_random_keeps_a_uniform_subset_whatever_the_rewards() -> None:
    # 8 sampled, 2 kept: every one of the 28 pairs about equally often, rewards ignored
    trajectories = [_traj(i, 1.0 if i < 2 else 0.0) for i in range(8)]
    rng = random.Random(1)
    counts: Counter[tuple[int, ...]] = Counter()
    for _ in range(28_000):
        counts[tuple(t.sample_index for t in resample(trajectories, 2, "random", rng))] += 1
    assert len(counts) == 28 and all(a < b for a, b in counts)  # in sample order
    chi_square = sum((n - 1000) ** 2 / 1000 for n in counts.values())
    assert chi_square < 55.48  # the 99.9th percentile of chi-square with 27 degrees of freedom
