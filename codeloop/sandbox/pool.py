"""The warm worker pool (asyncio side) and `LocalSandbox`, the in-process sandbox.

`WorkerPool` starts N zygote processes (`sandbox/zygote.py`) with a clean exec and a minimal
environment, sends each call to the zygote with the fewest calls outstanding (each runs at most
its share of `sandbox.max_running` calls at once; the rest wait in its queue, unforked, and a
call's `timeout_s` starts when it is forked, not when it arrives), and turns
anything that goes wrong on the infrastructure side (a zygote that dies mid-call) into a
`sandbox_error` result; a dead zygote is replaced. It never forks from this process, which may
be multi-threaded and hold secrets: only the zygotes fork.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from codeloop.config import SandboxConfig
from codeloop.errors import CodeloopError
from codeloop.types import ExecRequest, ExecResult, ExecStatus

log = logging.getLogger("codeloop.sandbox")

MAX_CODE_BYTES = 1 << 20
MAX_STDIN_BYTES = 1 << 20
SLOTS_PER_WORKER = 128  # concurrent children per zygote; more requests wait in its queue
UID_BASE = 1_500_000_000  # unprivileged uids for children: one per slot, none shared
ZYGOTE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


class IsolationError(CodeloopError, RuntimeError):
    """Raised at start-up with `require_isolation` when a feature is missing."""


def validate(request: ExecRequest, cfg: SandboxConfig) -> str | None:
    """Why `request` cannot run under `cfg`'s maxima, or None when it can."""
    if not isinstance(request.code, str) or not isinstance(request.stdin, str):
        return "code and stdin must be strings"
    if len(request.code.encode()) > MAX_CODE_BYTES:
        return f"code is larger than {MAX_CODE_BYTES} bytes"
    if len(request.stdin.encode()) > MAX_STDIN_BYTES:
        return f"stdin is larger than {MAX_STDIN_BYTES} bytes"
    t = request.timeout_s
    if t is not None and (
        isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= cfg.max_timeout_s
    ):
        return f"timeout_s must be a number in (0, {cfg.max_timeout_s}], got {t!r}"
    m = request.memory_mb
    if m is not None and (
        isinstance(m, bool) or not isinstance(m, int) or not 32 <= m <= cfg.max_memory_mb
    ):
        return f"memory_mb must be an integer in [32, {cfg.max_memory_mb}], got {m!r}"
    sid = request.session_id
    if sid is not None and (not isinstance(sid, str) or not 0 < len(sid) <= 256):
        return f"session_id must be a string of 1 to 256 characters, got {sid!r}"
    return None


class Metrics:
    """Counters for /metrics: calls by status, latency histogram."""

    def __init__(self) -> None:
        self.by_status: collections.Counter[str] = collections.Counter()
        self.buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.latency_sum_s = 0.0

    def observe(self, result: ExecResult, latency_s: float) -> None:
        self.by_status[str(result.status)] += 1
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, latency_s)] += 1
        self.latency_sum_s += latency_s


class _Worker:
    """One zygote process and the calls outstanding on it."""

    def __init__(
        self, index: int, cfg: SandboxConfig, on_death: Callable[[_Worker], None], max_running: int
    ):
        self.index = index
        self.cfg = cfg
        self.max_running = max_running
        self.on_death = on_death
        self.pending: dict[int, asyncio.Future[ExecResult]] = {}
        self.process: asyncio.subprocess.Process | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.reader_task: asyncio.Task[None] | None = None
        self.report: dict[str, Any] = {}
        self.alive = False

    async def start(self) -> None:
        ours, theirs = socket.socketpair()
        settings = {
            "preload": self.cfg.preload,
            "warmup": self.cfg.warmup,
            "slots": SLOTS_PER_WORKER,
            "max_running": self.max_running,
            "uid_base": UID_BASE + self.index * SLOTS_PER_WORKER,
            "tmpfs_mb": 512,
            "parent": os.getpid(),
        }
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "codeloop.sandbox.zygote",
            str(theirs.fileno()),
            json.dumps(settings),
            pass_fds=[theirs.fileno()],
            env=ZYGOTE_ENV,
            cwd=_PACKAGE_PARENT,
            stdin=asyncio.subprocess.DEVNULL,
        )
        theirs.close()
        reader, self.writer = await asyncio.open_unix_connection(sock=ours, limit=1 << 24)
        hello = await _read_message(reader)
        if hello is None:
            self.writer.close()  # the zygote is gone: do not leak our end on every retry
            raise RuntimeError(f"sandbox worker {self.index} died while starting")
        self.report = hello["hello"]
        self.alive = True
        self.reader_task = asyncio.create_task(self._read_loop(reader))

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        while (message := await _read_message(reader)) is not None:
            future = self.pending.pop(message["id"], None)
            if future is not None and not future.done():
                future.set_result(ExecResult.from_dict(message["result"]))
        was_alive, self.alive = self.alive, False
        for future in self.pending.values():
            if not future.done():
                died = ExecResult(ExecStatus.SANDBOX_ERROR, stderr="sandbox worker died mid-call")
                future.set_result(died)
        self.pending.clear()
        if was_alive:  # not stopped on purpose
            self.on_death(self)

    def submit(self, call_id: int, payload: dict[str, Any]) -> asyncio.Future[ExecResult]:
        assert self.writer is not None
        future: asyncio.Future[ExecResult] = asyncio.get_running_loop().create_future()
        self.pending[call_id] = future
        data = json.dumps({"id": call_id, **payload}).encode()
        self.writer.write(len(data).to_bytes(4, "big") + data)
        return future

    async def stop(self) -> None:
        self.alive = False
        if self.writer is not None:
            self.writer.close()
        if self.process is not None and self.process.returncode is None:
            try:
                await asyncio.wait_for(self.process.wait(), 2.0)
            except asyncio.TimeoutError:
                self.process.kill()
                await self.process.wait()
        if self.reader_task is not None:
            await self.reader_task


async def _read_message(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    try:
        header = await reader.readexactly(4)
        message: dict[str, Any] = json.loads(
            await reader.readexactly(int.from_bytes(header, "big"))
        )
        return message
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


class WorkerPool:
    """N warm zygotes; `execute` runs one request, `execute_batch` many, results in order."""

    def __init__(self, cfg: SandboxConfig):
        self.cfg = cfg
        count = cfg.workers or os.cpu_count() or 1
        total = cfg.max_running or 4 * (os.cpu_count() or 1)
        per_worker = min(SLOTS_PER_WORKER, -(-total // count))
        self.workers = [_Worker(i, cfg, self._restart_soon, per_worker) for i in range(count)]
        self.ids = itertools.count()
        self.metrics = Metrics()
        self.in_flight = 0
        self._restarting: set[int] = set()
        self._restart_tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self.sessions: dict[str, tuple[_Worker, float]] = {}  # id -> (worker, last use)

    async def start(self) -> dict[str, Any]:
        """Start every worker; return the isolation report (raise if required and missing)."""
        await asyncio.gather(*(w.start() for w in self.workers))
        report = self.workers[0].report
        for feature, reason in report["missing"].items():
            log.warning("sandbox isolation MISSING: %s (%s)", feature, reason)
        if report["missing"] and self.cfg.require_isolation:
            await self.close()
            raise IsolationError(f"isolation features missing: {report['missing']}")
        log.info("sandbox isolation active: %s", ", ".join(report["active"]))
        return report

    @property
    def capacity(self) -> int:
        """Calls that run at once; more wait in the workers' queues, unforked."""
        return sum(w.max_running for w in self.workers)

    @property
    def queue_depth(self) -> int:
        return max(0, self.in_flight - self.capacity)

    async def execute(self, request: ExecRequest) -> ExecResult:
        started = time.monotonic()
        result = await self._execute(request)
        self.metrics.observe(result, time.monotonic() - started)
        return result

    async def _execute(self, request: ExecRequest) -> ExecResult:
        problem = validate(request, self.cfg)
        if problem is not None:
            return ExecResult(ExecStatus.REJECTED, stderr=problem)
        payload = {
            "code": request.code,
            "stdin": request.stdin,
            "timeout_s": request.timeout_s or self.cfg.timeout_s,
            "memory_mb": request.memory_mb or self.cfg.memory_mb,
            "max_output_bytes": self.cfg.max_output_bytes,
        }
        worker = None
        if request.session_id is not None:
            worker = self._session_worker(request.session_id)
            if worker is None:
                return ExecResult(
                    ExecStatus.REJECTED,
                    stderr=(
                        f"too many live sessions ({self.cfg.max_sessions}): close finished ones "
                        "(close_session) or raise sandbox.max_sessions"
                    ),
                )
            payload["session_id"] = request.session_id
            payload["idle_timeout_s"] = self.cfg.session_idle_timeout_s
        self.in_flight += 1
        try:
            return await self._run(payload, worker)
        finally:
            self.in_flight -= 1

    def _session_worker(self, sid: str) -> _Worker | None:
        """The worker holding session `sid` (new sessions go to the least busy), or None when
        the cap on live sessions is reached."""
        now = time.monotonic()
        idle_s = self.cfg.session_idle_timeout_s
        for old in [k for k, (_, used) in self.sessions.items() if now - used > idle_s]:
            del self.sessions[old]  # the zygote has ended it too
        if sid in self.sessions:
            worker = self.sessions[sid][0]
        elif len(self.sessions) >= self.cfg.max_sessions:
            return None
        else:
            worker = min(self.workers, key=lambda w: (not w.alive, len(w.pending)))
        self.sessions[sid] = (worker, now)
        return worker

    async def close_session(self, sid: str) -> bool:
        """End session `sid` now; True when it was live."""
        entry = self.sessions.pop(sid, None)
        if entry is None or not entry[0].alive:
            return False
        result = await entry[0].submit(next(self.ids), {"close_session": sid})
        return result.stdout == "closed"

    async def _run(self, payload: dict[str, Any], worker: _Worker | None = None) -> ExecResult:
        alive = [w for w in self.workers if w.alive]
        if not alive or (worker is not None and not worker.alive):
            return ExecResult(ExecStatus.SANDBOX_ERROR, stderr="no sandbox worker is alive")
        worker = worker or min(alive, key=lambda w: len(w.pending))
        return await worker.submit(next(self.ids), payload)

    def _restart_soon(self, worker: _Worker) -> None:
        """Replace a dead zygote, retrying with backoff until it starts or the pool closes."""
        if worker.index in self._restarting or self._closing:
            return
        self._restarting.add(worker.index)

        async def restart() -> None:
            delay_s = 0.1
            try:
                while not self._closing:
                    await worker.stop()
                    try:
                        await worker.start()
                        log.warning("sandbox worker %d died and was replaced", worker.index)
                        return
                    except (OSError, RuntimeError) as err:
                        log.error("sandbox worker %d failed to restart: %s", worker.index, err)
                        await asyncio.sleep(delay_s)
                        delay_s = min(5.0, delay_s * 2)
            finally:
                self._restarting.discard(worker.index)

        task = asyncio.get_running_loop().create_task(restart())
        self._restart_tasks.add(task)
        task.add_done_callback(self._restart_tasks.discard)

    async def execute_batch(self, requests: Sequence[ExecRequest]) -> list[ExecResult]:
        return list(await asyncio.gather(*(self.execute(r) for r in requests)))

    async def close(self) -> None:
        self._closing = True
        for task in self._restart_tasks:
            task.cancel()
        await asyncio.gather(*self._restart_tasks, return_exceptions=True)
        await asyncio.gather(*(w.stop() for w in self.workers))


class LocalSandbox:
    """The sandbox in-process: the same interface as the HTTP client, no server needed.

    Use as `async with LocalSandbox(cfg) as sandbox: await sandbox.execute(request)`.
    """

    def __init__(self, cfg: SandboxConfig | None = None):
        self.pool = WorkerPool(cfg or SandboxConfig())
        self.isolation: dict[str, Any] = {}

    async def __aenter__(self) -> LocalSandbox:
        self.isolation = await self.pool.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pool.close()

    async def execute(self, request: ExecRequest) -> ExecResult:
        return await self.pool.execute(request)

    async def execute_batch(self, requests: Sequence[ExecRequest]) -> list[ExecResult]:
        return await self.pool.execute_batch(requests)

    async def close_session(self, session_id: str) -> bool:
        return await self.pool.close_session(session_id)
