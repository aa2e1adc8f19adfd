"""Killable verifier processes: run `symbolic.equivalent` with a hard deadline per item.

math-verify's own timeout is a SIGALRM: it cannot interrupt C-level big-integer work and it
refuses to run outside the main thread. Here each check runs in a worker process instead. A
zygote process, started with a clean exec (`python -m codeloop.reward.zygote`, so the caller's
`__main__` is never re-run and the caller may be threaded), imports sympy and math-verify once,
warms the parser and forks the workers; a new worker costs a fork, not the imports. A worker
that overruns its item's deadline is killed and replaced, and the item is a `TIMEOUT`. A worker
that dies (a segfault, its memory limit) costs its item a `VERIFIER_ERROR` and is replaced too;
a reasoning-gym scorer that raises costs its item a `VERIFIER_ERROR` (`task.py`).
One item per worker at a time, so throughput grows with the number of workers. Workers and the
zygote die with the process that started them (PDEATHSIG, and EOF on their sockets).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from codeloop.reward.task import TaskGold
from codeloop.types import StrEnum


class Check(StrEnum):
    EQUAL = "equal"
    NOT_EQUAL = "not_equal"
    TIMEOUT = "timeout"
    VERIFIER_ERROR = "verifier_error"


_CHECKS = {True: Check.EQUAL, False: Check.NOT_EQUAL}  # None: a task's scorer raised


@dataclass
class _Worker:
    pid: int
    conn: Connection
    item: int | None = None  # index of the item in progress
    deadline: float = 0.0


class VerifierPool:
    """A fixed number of verifier processes; `check` spreads a batch over them, in order."""

    def __init__(
        self, workers: int, deadline_s: float, memory_mb: int = 4096, *, gym: bool = False
    ) -> None:
        """`gym`: the zygote imports reasoning-gym before it forks (seconds that would
        otherwise count against each worker's first deadline)."""
        if workers < 1:
            raise ValueError(f"VerifierPool needs at least one worker, got {workers}")
        self.deadline_s = deadline_s
        self.memory_mb = memory_mb
        self._lock = threading.Lock()
        self._zygote, self._control = self._start_zygote(gym)
        self._workers = [self._start() for _ in range(workers)]
        self.replaced = 0  # workers killed or lost so far

    def _start_zygote(self, gym: bool) -> tuple[subprocess.Popen[bytes], socket.socket]:
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, *sys.path[1:]])}
        command = [sys.executable, "-m", "codeloop.reward.zygote", str(theirs.fileno())]
        zygote = subprocess.Popen(
            [*command, str(self.memory_mb), "gym" if gym else "math", str(os.getpid())],
            pass_fds=[theirs.fileno()],
            env=env,
        )
        theirs.close()
        return zygote, ours

    def _start(self) -> _Worker:
        self._control.sendall(b"F")
        pid_bytes, fds, _, _ = socket.recv_fds(self._control, 8, 1)
        if not fds:
            code = self._zygote.wait()
            raise RuntimeError(f"the verifier zygote exited with status {code} (see its stderr)")
        return _Worker(int.from_bytes(pid_bytes, "little"), Connection(fds[0]))

    def _replace(self, worker: _Worker) -> _Worker:
        try:
            os.kill(worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        worker.conn.close()
        self.replaced += 1
        return self._start()

    def check(self, pairs: Sequence[tuple[str, str | TaskGold]]) -> list[Check]:
        """The verdict of each (pred, gold) pair, in order; each within the deadline."""
        results: list[Check | None] = [None] * len(pairs)
        todo = deque(range(len(pairs)))
        with self._lock:
            while todo or any(w.item is not None for w in self._workers):
                for worker in self._workers:
                    if worker.item is None and todo:
                        worker.item = todo.popleft()
                        worker.deadline = time.monotonic() + self.deadline_s
                        worker.conn.send(pairs[worker.item])
                self._collect(results)
        return [r if r is not None else Check.VERIFIER_ERROR for r in results]

    def _collect(self, results: list[Check | None]) -> None:
        busy = [w for w in self._workers if w.item is not None]
        next_deadline = min(w.deadline for w in busy)
        ready = wait([w.conn for w in busy], timeout=max(0.0, next_deadline - time.monotonic()))
        now = time.monotonic()
        for i, worker in enumerate(self._workers):
            item = worker.item
            if item is None:
                continue
            if worker.conn in ready:
                try:
                    same = worker.conn.recv()
                    worker.item = None
                    results[item] = Check.VERIFIER_ERROR if same is None else _CHECKS[same]
                    continue
                except (EOFError, OSError):
                    results[item] = Check.VERIFIER_ERROR
            elif now >= worker.deadline:
                results[item] = Check.TIMEOUT
            else:
                continue
            self._workers[i] = self._replace(worker)

    def close(self) -> None:
        for worker in self._workers:
            worker.conn.close()
            try:
                os.kill(worker.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._workers = []
        self._control.close()  # EOF: the zygote exits
        self._zygote.wait()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
