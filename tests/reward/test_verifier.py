"""Scoring end to end: extraction, the fast path, and the killable verifier workers."""

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from codeloop.config import RewardConfig
from codeloop.reward import RewardResult, Verdict, Verifier, score
from codeloop.reward.extract import Reason
from codeloop.reward.workers import Check, VerifierPool
from codeloop.types import RolloutStatus, Trajectory

# math-verify's own SIGALRM timeout cannot stop this (C-level big-integer work).
TOWER = r"\dfrac{5^{(5^{(5^{(5^5)})} - 4)} - 5}{16}"
DEADLINE_S = 1.0
OVERHEAD_S = 1.0  # killing a worker and forking its replacement, on a loaded 2-core machine


@pytest.fixture(scope="module")
def verifier() -> Iterator[Verifier]:
    with Verifier(RewardConfig(deadline_s=DEADLINE_S, workers=2)) as v:
        yield v


def _pids(pool: VerifierPool) -> list[int]:
    """The worker processes' ids (to kill one)."""
    return [w.pid for w in pool._workers]


def _answer(value: str) -> str:
    return f"Let me think. <answer>So the result is \\boxed{{{value}}}.</answer>"


INTEGER_GOLD = [
    ("42", "42", True),
    ("042", "42", True),
    ("42.0", "42", True),
    ("42.00", "42", True),
    ("4{,}200", "4200", True),
    ("4,200", "4200", True),
    ("4\\,200", "4200", True),
    ("4 200", "4200", True),
    ("\\text{4200}", "4200", True),
    ("4200 \\text{ meters}", "4200", True),
    ("\\$4200", "4200", True),
    ("4200^\\circ", "4200", True),
    ("-3", "-3", True),
    ("3", "-3", False),
    ("41", "42", False),
    ("43", "42", False),
    ("420", "42", False),
    ("4.2", "42", False),
    ("2500", "25", False),
    ("0.25", "25", False),
    ("25.1", "25", False),
    ("24.99", "25", False),
    ("103.99", "104", False),
    ("104.01", "104", False),
    ("1,000", "1000", True),
    ("1,0000", "10000", False),
    ("10", "1000", False),
    ("\\frac{50}{2}", "25", True),
    ("5^2", "25", True),
    ("\\sqrt{625}", "25", True),
    ("\\frac{51}{2}", "25", False),
    ("x = 25", "25", True),
    ("n=25", "25", True),
]


@pytest.mark.parametrize(("pred", "gold", "correct"), INTEGER_GOLD)
def test_integer_golds(verifier: Verifier, pred: str, gold: str, correct: bool) -> None:
    result = verifier.score(_answer(pred), gold)
    assert result.reward == (1.0 if correct else 0.0), result
    assert result.reason == (Verdict.CORRECT if correct else Verdict.WRONG)
    assert result.extracted == pred and result.extraction == Reason.OK


def test_the_fast_path_starts_no_worker() -> None:
    with Verifier(RewardConfig(workers=1)) as v:
        results = v.score_batch([(_answer(str(i)), str(i % 3)) for i in range(100)])
        assert [r.reward for r in results] == [1.0 if i < 3 else 0.0 for i in range(100)]
        assert v._pool is None


def test_a_number_printed_by_the_tool_is_never_the_answer(verifier: Verifier) -> None:
    text = (
        "<tool_call>print(7)</tool_call><tool_response>\\boxed{7}</tool_response>"
        "Hmm. <answer>\\boxed{8}</answer>"
    )
    assert verifier.score(text, "7").reason == Verdict.WRONG
    cut = "<answer>\\boxed{1}</answer><tool_response><answer>\\boxed{7}</answer>"
    assert verifier.score(cut, "7").extracted == "1"


@pytest.mark.parametrize(
    ("text", "extraction"),
    [
        ("The answer is 7.", Reason.NO_ANSWER_TAG),
        ("<answer>7</answer>", Reason.NO_BOXED),
        ("<answer>\\boxed{7", Reason.UNCLOSED_ANSWER_TAG),
        ("<answer>\\boxed{7</answer>", Reason.UNBALANCED_BRACES),
        ("<answer>\\boxed{}</answer>", Reason.EMPTY_BOXED),
    ],
)
def test_a_missing_answer_is_a_reason(verifier: Verifier, text: str, extraction: Reason) -> None:
    assert verifier.score(text, "7") == RewardResult(0.0, Verdict.NO_ANSWER, None, extraction)


def test_fallbacks_follow_the_config() -> None:
    text = "so \\boxed{7} and the answer is 7"
    assert Verifier().score(text, "7").reason == Verdict.NO_ANSWER
    boxed = Verifier(RewardConfig(fallback_last_boxed=True)).score(text, "7")
    assert (boxed.reward, boxed.extraction) == (1.0, Reason.FALLBACK_BOXED)
    phrase = Verifier(RewardConfig(fallback_answer_phrase=True)).score("the answer is 7", "7")
    assert (phrase.reward, phrase.extraction) == (1.0, Reason.FALLBACK_PHRASE)
    lenient = Verifier(RewardConfig(fallback_last_number=True))
    number = lenient.score("8 + 6 = 14<|im_end|>", "14")
    assert (number.reward, number.extraction) == (1.0, Reason.FALLBACK_NUMBER)
    assert lenient.score("It costs 1,234 dollars.", "1234").reward == 1.0
    assert lenient.score("8 + 6 = 15", "14").reward == 0.0


def _trajectory(text: str, status: RolloutStatus) -> Trajectory:
    return Trajectory("p", 0, [1], [2], [1], [-0.5], status=status, text=text)


@pytest.mark.parametrize(
    ("status", "verdict"),
    [
        (RolloutStatus.ANSWERED, Verdict.CORRECT),
        (RolloutStatus.TRUNCATED_LENGTH, Verdict.TRUNCATED),
        (RolloutStatus.TRUNCATED_TURNS, Verdict.TRUNCATED),
        (RolloutStatus.ERROR, Verdict.ROLLOUT_ERROR),
    ],
)
def test_truncated_trajectories_get_zero(
    verifier: Verifier, status: RolloutStatus, verdict: Verdict
) -> None:
    result = verifier.score(_trajectory(_answer("7"), status), "7")
    assert (result.reason, result.extracted) == (verdict, "7")
    assert result.reward == (1.0 if verdict == Verdict.CORRECT else 0.0)


def test_a_batch_keeps_its_order_across_fast_and_slow_items(verifier: Verifier) -> None:
    items: list[tuple[Trajectory | str, str]] = []
    expected = []
    for i in range(40):
        match i % 4:
            case 0:
                items.append((_answer(str(i)), str(i)))
                expected.append(1.0)
            case 1:
                items.append((_answer(f"\\frac{{{i}}}{{2}}"), f"{i / 2}"))
                expected.append(1.0)
            case 2:
                items.append((_answer(f"\\sqrt{{{i}}}"), f"\\sqrt{{{i + 1}}}"))
                expected.append(0.0)
            case _:
                items.append((_trajectory(_answer("1"), RolloutStatus.ANSWERED), "\\frac{2}{2}"))
                expected.append(1.0)
    assert [r.reward for r in verifier.score_batch(items)] == expected


def test_a_pathological_answer_costs_at_most_the_deadline(verifier: Verifier) -> None:
    start = time.monotonic()
    result = verifier.score(_answer(TOWER), "25")
    elapsed = time.monotonic() - start
    assert result == RewardResult(0.0, Verdict.TIMEOUT, TOWER, Reason.OK)
    assert DEADLINE_S <= elapsed < DEADLINE_S + OVERHEAD_S
    assert verifier.score(_answer("\\frac{1}{2}"), "0.5").reward == 1.0  # replaced, still serving


def test_pathological_answers_run_in_parallel_and_do_not_stall_the_batch() -> None:
    with Verifier(RewardConfig(deadline_s=DEADLINE_S, workers=2)) as v:
        items = [(_answer(TOWER), "25"), (_answer(TOWER), "26")]
        items += [(_answer(f"\\sqrt{{{i * i}}}"), f"{i}") for i in range(20)]
        assert len(_pids(v.pool)) == 2  # started before the clock
        start = time.monotonic()
        results = v.score_batch(items)
        elapsed = time.monotonic() - start
        assert [r.reason for r in results[:2]] == [Verdict.TIMEOUT, Verdict.TIMEOUT]
        assert all(r.reward == 1.0 for r in results[2:])
        assert elapsed < 2 * DEADLINE_S  # one deadline on each worker, at the same time
        assert v.pool.replaced == 2


@pytest.mark.slow
def test_ten_thousand_trajectories_with_traps() -> None:
    items, expected = [], []
    for i in range(10_000):
        if i % 1000 == 7:
            items.append((_answer(TOWER), "25"))
            expected.append(Verdict.TIMEOUT)
        elif i % 100 == 3:
            items.append((_answer(f"\\frac{{{i}}}{{3}}"), f"\\dfrac{{{2 * i}}}{{6}}"))
            expected.append(Verdict.CORRECT)
        else:
            items.append((_answer(str(i % 997)), str(i % 991)))
            expected.append(Verdict.CORRECT if i % 997 == i % 991 else Verdict.WRONG)
    with Verifier(RewardConfig(deadline_s=DEADLINE_S, workers=2)) as v:
        assert [r.reason for r in v.score_batch(items)] == expected


def test_a_repeated_answer_is_checked_once() -> None:
    with Verifier(RewardConfig(deadline_s=DEADLINE_S, workers=1)) as v:
        results = v.score_batch([(_answer(TOWER), "25")] * 3 + [(_answer("\\sqrt{4}"), "2")])
        assert [r.reason for r in results] == [Verdict.TIMEOUT] * 3 + [Verdict.CORRECT]
        assert v.pool.replaced == 1


def test_a_worker_that_dies_costs_only_its_item() -> None:
    with VerifierPool(workers=1, deadline_s=30) as pool:
        victim = _pids(pool)[0]
        threading.Timer(0.5, os.kill, (victim, 9)).start()
        assert pool.check([(TOWER, "25"), ("\\frac{2}{4}", "0.5")]) == [
            Check.VERIFIER_ERROR,
            Check.EQUAL,
        ]
        assert _pids(pool)[0] != victim and pool.replaced == 1


def test_scoring_works_from_threads() -> None:
    # math-verify's own timeout raises outside the main thread.
    results: list[RewardResult] = []
    worker = threading.Thread(target=lambda: results.append(score(_answer("2^{-1}"), "0.5")))
    worker.start()
    worker.join()
    assert results[0].reason == Verdict.CORRECT


def test_a_script_without_a_main_guard_can_score(tmp_path: object) -> None:
    code = (
        "from codeloop.reward import score\n"
        "print(score('<answer>\\\\boxed{\\\\sqrt{12}}</answer>', '2\\\\sqrt{3}').reason)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "correct", out.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_die_with_the_process_that_started_them() -> None:
    code = (
        "import os, threading\n"
        "from codeloop.reward.workers import VerifierPool\n"
        "pool = VerifierPool(workers=2, deadline_s=60)\n"
        "print(pool._zygote.pid, *[w.pid for w in pool._workers], flush=True)\n"
        f"threading.Thread(target=pool.check, args=([({TOWER!r}, '25')],), daemon=True).start()\n"
        "import time; time.sleep(0.5); os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 3, out.stderr
    deadline = time.monotonic() + 30  # about a hang, not speed
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def test_a_worker_whose_owner_is_gone_stops_without_a_traceback() -> None:
    """Its owner died with its reply unread: the next read fails with ECONNRESET (not EOF),
    which ends the worker as quietly as a closed pipe does."""
    import socket
    from multiprocessing.connection import Connection

    from codeloop.reward.zygote import serve

    ours, theirs = socket.socketpair()
    owner, worker = Connection(ours.detach()), Connection(theirs.detach())
    outcome: list[str] = []

    def run() -> None:
        try:
            serve(worker, 0)
            outcome.append("returned")
        except Exception as err:
            outcome.append(repr(err))

    thread = threading.Thread(target=run)
    thread.start()
    owner.send(("1/2", "0.5"))
    assert owner.poll(30)  # the worker replied: True, left unread
    owner.close()
    thread.join(30)
    assert outcome == ["returned"]


@pytest.mark.slow
def test_bench_reward_runs_and_agrees_with_its_labels(tmp_path: object) -> None:
    out = f"{tmp_path}/reward.json"
    command = [
        sys.executable,
        "-m",
        "codeloop",
        "bench",
        "reward",
        "--n",
        "300",
        "--n-latex",
        "60",
        "--baseline-n",
        "20",
        "--deadline-s",
        "0.5",
        "--pathological",
        "1",
        "--baseline-limit-s",
        "2",
        "--differential-values",
        "22",
        "--out",
        out,
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(Path(out).read_text())
    assert [row["set"] for row in report["sets"]][0] == "integer, 1 core"
    assert all(row["ours_agree"] == 1.0 for row in report["sets"]), report["sets"]
    assert all(row["math_verify_per_s"] > 0 for row in report["sets"])
    assert report["latex_median"]["ours_s"] > 0 and report["latex_median"]["math_verify_s"] > 0
    assert report["pathological"][0]["ours_reason"] == "timeout"
    assert report["pathological"][0]["ours_s"] < 0.5 + OVERHEAD_S


@pytest.mark.slow
def test_bench_reward_against_math_verify_lists_every_disagreement_by_kind(
    tmp_path: object,
) -> None:
    out = f"{tmp_path}/against.json"
    command = [sys.executable, "-m", "codeloop", "bench", "reward", "--against", "math-verify"]
    command += ["--differential-values", "22", "--workers", "2", "--out", out]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    report = json.loads(Path(out).read_text())
    names = [row["set"] for row in report["sets"]]
    assert names[:3] == ["labelled", "policy samples", "generated"]
    assert names[3].startswith("math-verify suite")
    assert report["suite_in_scope"]["passed"] == report["suite_in_scope"]["cases"] == 240
    labelled = report["sets"][0]
    percent = [d for d in labelled["disagreements"] if (d["answer"], d["gold"]) == ("25\\%", "25")]
    assert percent == [
        {
            "kind": "integer_gold",
            "answer": "25\\%",
            "gold": "25",
            "label": False,
            "ours": False,
            "math_verify": True,
            "ours_right": True,
        }
    ]
    for row in report["sets"]:
        assert sum(row["by_kind"].values()) == len(row["disagreements"])
        assert (
            f"{row['set']}: {len(row['disagreements'])} disagreements" in run.stdout
            or not row["disagreements"]
        )
