"""Trajectory (or response text) + gold answer -> binary reward with its reason.

The fast path runs in the caller: extraction, then the cheap rules of `fastpath.py` (exact
numbers and ratios, normalised strings, tuples, sets and intervals of numbers).
Everything else, and every answer to a reasoning-gym problem (its gold a `TaskGold`, scored by
the task's own scorer), goes to the killable verifier workers (`workers.py`), started on first need,
so a batch with only integer golds and integer predictions never starts a process.
`score_async` scores on the verifier's own thread, so that an event loop driving generation
goes on while a trajectory that has ended is checked.
"""

from __future__ import annotations

import asyncio
import atexit
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from codeloop.config import RewardConfig
from codeloop.reward.extract import Reason, extract_answer
from codeloop.reward.fastpath import fast_check
from codeloop.reward.task import TaskGold
from codeloop.reward.workers import Check, VerifierPool, default_workers
from codeloop.types import RolloutStatus, StrEnum, Trajectory

Gold = str | TaskGold  # a gold answer, or a reasoning-gym task that scores the answer (`task.py`)


class Verdict(StrEnum):
    """Why a response got its reward."""

    CORRECT = "correct"
    WRONG = "wrong"
    NO_ANSWER = "no_answer"  # extraction failed; `RewardResult.extraction` says how
    TRUNCATED = "truncated"  # cut off by a length or turn budget: 0 whatever it says
    ROLLOUT_ERROR = "rollout_error"  # the rollout itself failed
    TIMEOUT = "timeout"  # the verifier overran its deadline
    VERIFIER_ERROR = "verifier_error"  # the verifier process died


@dataclass(frozen=True, slots=True)
class RewardResult:
    reward: float  # 1.0 or 0.0
    reason: Verdict
    extracted: str | None  # the answer as extracted, None when there is none
    extraction: Reason  # how the answer was found, or why not


_CHECK_VERDICT = {
    Check.EQUAL: Verdict.CORRECT,
    Check.NOT_EQUAL: Verdict.WRONG,
    Check.TIMEOUT: Verdict.TIMEOUT,
    Check.VERIFIER_ERROR: Verdict.VERIFIER_ERROR,
}
_NOT_SCORED = {
    RolloutStatus.TRUNCATED_LENGTH: Verdict.TRUNCATED,
    RolloutStatus.TRUNCATED_TURNS: Verdict.TRUNCATED,
    RolloutStatus.ERROR: Verdict.ROLLOUT_ERROR,
}


def _result(verdict: Verdict, extracted: str | None, extraction: Reason) -> RewardResult:
    return RewardResult(1.0 if verdict == Verdict.CORRECT else 0.0, verdict, extracted, extraction)


class Verifier:
    """Scores responses against gold answers; holds the verifier workers once needed."""

    def __init__(self, cfg: RewardConfig | None = None) -> None:
        self.cfg = cfg or RewardConfig()
        self._pool: VerifierPool | None = None
        self._gym = False  # gym golds seen before the pool started: its workers import the gym
        self._thread: ThreadPoolExecutor | None = None  # for score_async: one at a time

    @property
    def pool(self) -> VerifierPool:
        if self._pool is None:
            workers = self.cfg.workers or default_workers()
            self._pool = VerifierPool(
                workers, self.cfg.deadline_s, self.cfg.worker_memory_mb, gym=self._gym
            )
        return self._pool

    def score(self, response: Trajectory | str, gold: Gold) -> RewardResult:
        return self.score_batch([(response, gold)])[0]

    async def score_async(self, response: Trajectory | str, gold: Gold) -> RewardResult:
        """`score` on the verifier's thread; the caller's event loop runs on meanwhile."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="verifier")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.score, response, gold)

    def score_batch(self, items: Sequence[tuple[Trajectory | str, Gold]]) -> list[RewardResult]:
        """One result per (response, gold) item, in order."""
        results: list[RewardResult | None] = [None] * len(items)
        slow: list[tuple[int, str, Gold, Reason]] = []
        for i, (response, gold) in enumerate(items):
            text = response if isinstance(response, str) else response.text
            found = extract_answer(
                text,
                fallback_last_boxed=self.cfg.fallback_last_boxed,
                fallback_answer_phrase=self.cfg.fallback_answer_phrase,
                fallback_last_number=self.cfg.fallback_last_number,
            )
            if not isinstance(response, str) and response.status in _NOT_SCORED:
                results[i] = _result(_NOT_SCORED[response.status], found.answer, found.reason)
            elif found.answer is None:
                results[i] = _result(Verdict.NO_ANSWER, None, found.reason)
            elif (
                not isinstance(gold, TaskGold)
                and (same := fast_check(found.answer, gold)) is not None
            ):
                verdict = Verdict.CORRECT if same else Verdict.WRONG
                results[i] = _result(verdict, found.answer, found.reason)
            else:
                slow.append((i, found.answer, gold, found.reason))
        if slow:  # samples of one prompt often repeat an answer: check each pair once
            distinct = list(dict.fromkeys((pred, gold) for _, pred, gold, _ in slow))
            self._gym = self._gym or any(isinstance(gold, TaskGold) for _, gold in distinct)
            checks = dict(zip(distinct, self.pool.check(distinct), strict=True))
            for i, pred, gold, reason in slow:
                results[i] = _result(_CHECK_VERDICT[checks[pred, gold]], pred, reason)
        return [r for r in results if r is not None]

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> Verifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default: Verifier | None = None


def _default_verifier() -> Verifier:
    global _default
    if _default is None:
        _default = Verifier()
        atexit.register(_default.close)
    return _default


def score(response: Trajectory | str, gold: str) -> RewardResult:
    """Score one response with the default settings (`RewardConfig()`)."""
    return _default_verifier().score(response, gold)


def score_batch(items: Sequence[tuple[Trajectory | str, str]]) -> list[RewardResult]:
    """Score many (response, gold) items with the default settings, in order."""
    return _default_verifier().score_batch(items)
