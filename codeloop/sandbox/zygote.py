"""The zygote: a single-threaded warm interpreter that forks one isolated child per call.

Started by the pool with a clean `exec` and a minimal environment (so nothing secret sits in its
memory or in the environment block its children inherit), it imports the math stack once,
isolates itself (`isolation.enter_sandbox_root`), freezes the GC, then serves requests from a
Unix socket: for each request it forks a child (`executor.child_main`), reads the child's
stdout, stderr and trailer pipes up to the output cap, kills the child's whole PID namespace at
the deadline, removes the working directory, and answers with an `ExecResult` dict.

Wire format on the socket, both ways: 4-byte big-endian length, then a JSON object.
Requests: {"id", "code", "stdin", "timeout_s", "memory_mb", "max_output_bytes"}.
Answers: {"id", "result": ExecResult.to_dict()}; the first message is {"hello": report}.
"""

from __future__ import annotations

import collections
import fcntl
import gc
import importlib
import json
import math
import os
import selectors
import shutil
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from codeloop.sandbox import executor, isolation
from codeloop.types import ExecStatus

HEADER = struct.Struct(">I")
F_SETPIPE_SZ = 1031
HARD_KILL_GRACE_S = 0.25  # after the soft SIGALRM, give the child this long before SIGKILL
EXIT_DRAIN_S = 1.0  # after the child exits, wait at most this long for its pipes to close
STARTS_PER_TURN = 8
ADMISSION_HOLD_S = 0.5  # a call holds its admission slot until it ends, or this long at most
SESSION_ENDED = "\n[the session ended; the next call starts a fresh one]\n"
SESSION_CPU_S = 3600  # a session's CPU limit over its whole life; each call has a wall deadline


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    sock.sendall(HEADER.pack(len(data)) + data)


def split_messages(buffer: bytearray) -> list[dict[str, Any]]:
    """Pop every complete frame off the front of `buffer`."""
    messages = []
    while len(buffer) >= HEADER.size:
        (size,) = HEADER.unpack_from(buffer)
        if len(buffer) < HEADER.size + size:
            break
        messages.append(json.loads(buffer[HEADER.size : HEADER.size + size]))
        del buffer[: HEADER.size + size]
    return messages


@dataclass
class Call:
    """One request being served, and what its child has produced for it so far."""

    request: dict[str, Any]
    started: float
    deadline: float
    cap: int
    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    trailer: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    timed_out: bool = False


@dataclass
class Child:
    """A forked sandbox process: one call's, or a session's that serves calls one by one."""

    pid: int
    pidfd: int
    uid: int
    workdir: str
    pipes: dict[int, str]  # read end -> "out" | "err" | "trailer"
    call: Call | None
    session_id: str | None = None
    command_fd: int | None = None
    idle_timeout_s: float = 0.0
    last_used: float = 0.0
    wait_status: int | None = None
    exited_at: float = 0.0


def _status_from(call: Call, wait_status: int | None) -> tuple[ExecStatus, str | None, int | None]:
    """(status, error_type, exit_code) from the trailer, the deadline and the wait status."""
    exit_code = None if wait_status is None else os.waitstatus_to_exitcode(wait_status)
    if call.timed_out:
        return ExecStatus.TIMEOUT, None, exit_code
    if call.trailer:
        try:
            trailer = json.loads(call.trailer.decode().splitlines()[0])
            code = trailer.get("exit_code") if exit_code is None else exit_code
            return ExecStatus(trailer["status"]), trailer.get("error_type"), code
        except (ValueError, KeyError, IndexError):
            pass  # user code wrote garbage on fd 3: fall back to the exit status
    if exit_code is None:
        return ExecStatus.SANDBOX_ERROR, None, None
    if exit_code < 0:
        signum = -exit_code
        if signum == signal.SIGXCPU:
            return ExecStatus.TIMEOUT, None, exit_code
        return ExecStatus.KILLED, signal.Signals(signum).name, exit_code
    if exit_code == executor.EXIT_SETUP_FAILED:
        return ExecStatus.SANDBOX_ERROR, None, exit_code
    return (ExecStatus.OK if exit_code == 0 else ExecStatus.ERROR), None, exit_code


def _new_call(request: dict[str, Any]) -> Call:
    now = time.monotonic()
    timeout_s = float(request["timeout_s"])
    return Call(request, now, now + timeout_s + HARD_KILL_GRACE_S, int(request["max_output_bytes"]))


class Zygote:
    def __init__(self, sock: socket.socket, root: isolation.SandboxRoot, settings: dict[str, Any]):
        self.sock = sock
        self.root = root
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ, None)
        self.inbox = bytearray()
        self.queue: collections.deque[dict[str, Any]] = collections.deque()
        self.children: dict[int, Child] = {}  # by pidfd
        self.sessions: dict[str, Child] = {}
        slots = int(settings["slots"])
        self.max_running = int(settings.get("max_running") or slots)
        self.free_uids = list(range(int(settings["uid_base"]), int(settings["uid_base"]) + slots))
        self.base_vm_bytes = int(settings["base_vm_bytes"])
        self.seq = 0
        self.running = True

    # -- control socket -------------------------------------------------------------------
    def _on_control(self) -> None:
        try:
            data = self.sock.recv(1 << 20)
        except ConnectionError:  # the pool died with our replies unread
            data = b""
        if not data:  # the pool is gone: stop, children die with us (PDEATHSIG)
            self.running = False
            return
        self.inbox += data
        self.queue.extend(split_messages(self.inbox))

    def _answer(self, request_id: Any, result: dict[str, Any]) -> None:
        """Send a reply; when the pool is gone (it was killed, say), stop quietly instead: the
        kernel's SIGKILL for us (PDEATHSIG) can come after the closed socket is seen."""
        try:
            send_message(self.sock, {"id": request_id, "result": result})
        except ConnectionError:
            self.running = False

    def _reply(self, call: Call, wait_status: int | None, note: str = "") -> None:
        status, error_type, exit_code = _status_from(call, wait_status)
        self._answer(
            call.request["id"],
            {
                "status": str(status),
                "stdout": call.out.decode("utf-8", "replace"),
                "stderr": call.err.decode("utf-8", "replace") + note,
                "exit_code": exit_code,
                "error_type": error_type,
                "duration_s": round(time.monotonic() - call.started, 6),
                "truncated": call.truncated,
            },
        )

    # -- dispatching requests -------------------------------------------------------------
    def _running(self) -> int:
        """Calls that hold an admission slot: those served now that started less than
        ADMISSION_HOLD_S ago. A longer call (a loop until its timeout, a sleep) stops holding
        one, so a few of them never block the queue for longer than that."""
        since = time.monotonic() - ADMISSION_HOLD_S
        return sum(
            child.call is not None and child.call.started > since
            for child in self.children.values()
        )

    def _can_start(self) -> bool:
        return bool(self.queue) and self._running() < self.max_running

    def _dispatch(self) -> None:
        """Serve queued requests in order while uids last and fewer than `max_running` calls
        run (a few per turn, so that deadlines are enforced while a burst is being forked). A
        call's deadline starts here: the time it waited in the queue, unforked, is not its own."""
        for _ in range(STARTS_PER_TURN):
            if not self.queue:
                return
            request = self.queue[0]
            if "close_session" in request:
                self.queue.popleft()
                self._close_session(request)
                continue
            if self._running() >= self.max_running:
                return
            sid = request.get("session_id")
            needs_process = sid is None or sid not in self.sessions
            if needs_process and not self.free_uids:
                return
            self.queue.popleft()
            if sid is None:
                self._spawn(request, _new_call(request))
            else:
                self._session_call(sid, request)

    def _session_call(self, sid: str, request: dict[str, Any]) -> None:
        child = self.sessions.get(sid)
        if child is not None and child.wait_status is not None:  # exited, not yet reaped
            del self.sessions[sid]
            child = None
        if child is not None and child.call is not None:
            busy = f"session {sid!r} is busy with another call"
            self._answer(request["id"], {"status": "rejected", "stderr": busy})
            return
        call = _new_call(request)
        if child is None:
            child = self._spawn(request, call, session_id=sid)
            if child is None:
                return
            self.sessions[sid] = child
        child.call = call
        frame = json.dumps({k: request[k] for k in ("code", "stdin", "timeout_s")}).encode()
        try:  # the session is idle, reading: a blocking write completes
            os.write(child.command_fd or -1, HEADER.pack(len(frame)) + frame)
        except OSError:  # it died meanwhile: its exit is reported through the pidfd
            pass

    def _close_session(self, request: dict[str, Any]) -> None:
        child = self.sessions.pop(request["close_session"], None)
        if child is not None and child.wait_status is None:
            self._kill(child)
        self._answer(request["id"], {"status": "ok", "stdout": "closed" if child else ""})

    # -- starting a child -----------------------------------------------------------------
    def _spawn(
        self, request: dict[str, Any], call: Call, session_id: str | None = None
    ) -> Child | None:
        uid = self.free_uids.pop()
        self.seq += 1
        workdir = f"{self.root.scratch}/c{self.seq}"
        fds: list[int] = []
        try:
            os.mkdir(workdir, 0o700)
            if self.root.can_setuid:
                os.chown(workdir, uid, uid)
            child = self._fork(request, call, uid, workdir, fds=fds, session_id=session_id)
        except OSError as err:
            for fd in fds:
                os.close(fd)
            self.free_uids.append(uid)
            shutil.rmtree(workdir, ignore_errors=True)
            self._answer(
                request["id"],
                {"status": "sandbox_error", "stderr": f"could not start the call: {err}"},
            )
            return None
        self.children[child.pidfd] = child
        return child

    def _fork(
        self,
        request: dict[str, Any],
        call: Call,
        uid: int,
        workdir: str,
        *,
        fds: list[int],
        session_id: str | None,
    ) -> Child:
        stdin_r, stdin_w = os.pipe()
        fds += [stdin_r, stdin_w]
        stdin = b"" if session_id else request.get("stdin", "").encode()
        if len(stdin) > 65536:
            fcntl.fcntl(stdin_w, F_SETPIPE_SZ, len(stdin))
        if stdin:
            os.write(stdin_w, stdin)  # fits in the pipe buffer: never blocks
        pipes = [os.pipe() for _ in range(4 if session_id else 3)]  # out, err, trailer, command
        fds += [fd for pair in pipes for fd in pair]
        timeout_s = float(request["timeout_s"])
        cpu_s = SESSION_CPU_S if session_id else math.ceil(timeout_s) + 1
        memory = int(request["memory_mb"]) * (1 << 20)
        limits = isolation.Limits(cpu_s=cpu_s, address_space_bytes=self.base_vm_bytes + memory)
        spec = executor.ChildSpec(
            workdir=workdir,
            stdin_fd=stdin_r,
            stdout_fd=pipes[0][1],
            stderr_fd=pipes[1][1],
            trailer_fd=pipes[2][1],
            uid=uid if self.root.can_setuid else None,
            proc_fd=self.root.proc_fd,
            limits=limits,
            timeout_s=None if session_id else timeout_s,
            command_fd=pipes[3][0] if session_id else None,
        )
        isolation.new_pid_namespace_for_next_child(self.root)
        pid = os.fork()
        if pid == 0:
            if session_id:
                executor.session_main(spec)
            executor.child_main(spec, request["code"])
        child_ends = [stdin_r, stdin_w, pipes[0][1], pipes[1][1], pipes[2][1]]
        if session_id:
            child_ends.append(pipes[3][0])
        for fd in child_ends:
            os.close(fd)
            fds.remove(fd)
        pidfd = os.pidfd_open(pid)
        child = Child(
            pid,
            pidfd,
            uid,
            workdir,
            {},
            call,
            session_id,
            pipes[3][1] if session_id else None,
            float(request.get("idle_timeout_s", 0)),
            time.monotonic(),
        )
        for fd, name in ((pipes[0][0], "out"), (pipes[1][0], "err"), (pipes[2][0], "trailer")):
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, (child, name))
            child.pipes[fd] = name
        self.selector.register(pidfd, selectors.EVENT_READ, child)
        fds.clear()
        return child

    # -- watching children ----------------------------------------------------------------
    def _read_pipe(self, child: Child, fd: int) -> bool:
        """Move one read's worth to the current call; False when the pipe is empty or closed."""
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        name = child.pipes[fd]
        if not data:
            self.selector.unregister(fd)
            os.close(fd)
            del child.pipes[fd]
            return False
        call = child.call
        if call is None:  # a session's background thread printing between calls: dropped
            return True
        sink = {"out": call.out, "err": call.err, "trailer": call.trailer}[name]
        room = (call.cap if name != "trailer" else 4096) - len(sink)
        if len(data) > room:
            call.truncated = call.truncated or name != "trailer"
            data = data[: max(room, 0)]
        sink += data
        return True

    def _on_pipe(self, child: Child, fd: int) -> None:
        self._read_pipe(child, fd)
        call = child.call
        if child.session_id and call is not None and b"\n" in call.trailer:
            # The session flushed stdout and stderr before its trailer: take what is left.
            for out_fd in [f for f, name in child.pipes.items() if name != "trailer"]:
                while self._read_pipe(child, out_fd):
                    pass
            child.call, child.last_used = None, time.monotonic()
            note = ""
            if b'"status": "timeout"' in call.trailer:  # its soft deadline: the session exits
                self.sessions.pop(child.session_id, None)
                note = SESSION_ENDED
            self._reply(call, None, note)

    def _on_exit(self, child: Child) -> None:
        self.selector.unregister(child.pidfd)
        _, child.wait_status = os.waitpid(child.pid, 0)
        child.exited_at = time.monotonic()

    def _kill(self, child: Child) -> None:
        isolation.restore_priority(self.root.proc_fd, child.pid)
        os.kill(child.pid, signal.SIGKILL)  # PID 1 of its namespace: takes all with it

    def _reap(self, child: Child) -> None:
        for fd in list(child.pipes):
            self.selector.unregister(fd)
            os.close(fd)
        child.pipes.clear()  # an event of the same select batch may still name them
        os.close(child.pidfd)
        if child.command_fd is not None:
            os.close(child.command_fd)
        del self.children[child.pidfd]
        if child.session_id and self.sessions.get(child.session_id) is child:
            del self.sessions[child.session_id]
        shutil.rmtree(child.workdir, ignore_errors=True)
        self.free_uids.append(child.uid)
        if child.call is not None:
            self._reply(child.call, child.wait_status, SESSION_ENDED if child.session_id else "")

    def _sweep(self, now: float) -> None:
        for child in list(self.children.values()):
            call = child.call
            if child.wait_status is None:
                if call is not None and now >= call.deadline and not call.timed_out:
                    call.timed_out = True
                    self._kill(child)
                elif call is None and now - child.last_used > child.idle_timeout_s:
                    self.sessions.pop(child.session_id or "", None)
                    self._kill(child)
            elif not child.pipes or now - child.exited_at > EXIT_DRAIN_S:
                self._reap(child)

    def _next_timeout(self, now: float) -> float | None:
        times = []
        for child in self.children.values():
            if child.wait_status is not None:
                times.append(child.exited_at + EXIT_DRAIN_S)
            elif child.call is not None:
                times.append(child.call.deadline)
                released = child.call.started + ADMISSION_HOLD_S  # it stops holding its slot
                if self.queue and released > now:
                    times.append(released)
            else:
                times.append(child.last_used + child.idle_timeout_s)
        return max(0.0, min(times) - now) if times else None

    def run(self) -> None:
        while self.running:
            self._dispatch()
            busy = self.free_uids and self._can_start()
            for key, _ in self.selector.select(
                0.0 if busy else self._next_timeout(time.monotonic())
            ):
                if key.data is None:
                    self._on_control()
                elif isinstance(key.data, Child):
                    self._on_exit(key.data)
                elif key.fd in key.data[0].pipes:  # not closed by an earlier event of the batch
                    self._on_pipe(key.data[0], key.fd)
            self._sweep(time.monotonic())


def _vm_size_bytes(status_fd: int) -> int:
    text = os.pread(status_fd, 1 << 16, 0).decode()
    kib = next(int(line.split()[1]) for line in text.splitlines() if line.startswith("VmSize:"))
    return kib * 1024


def main() -> None:
    """`python -m codeloop.sandbox.zygote FD SETTINGS_JSON`, started by the pool."""
    fd, settings = int(sys.argv[1]), json.loads(sys.argv[2])
    sock = socket.socket(fileno=fd)
    for name in settings["preload"]:
        importlib.import_module(name)
    try:
        exec(compile(settings["warmup"], "<warmup>", "exec"), {"__name__": "__warmup__"})
    except Exception as err:  # a bad warm-up only costs speed: say so and go on
        print(f"codeloop sandbox: warm-up code failed: {err!r}", file=sys.stderr)
    status_fd = os.open("/proc/self/status", os.O_RDONLY)
    root = isolation.enter_sandbox_root(int(settings["tmpfs_mb"]))
    isolation.die_with_parent()  # after the namespaces: a change of credentials clears it
    if os.getppid() != settings["parent"]:  # the pool's process died before that
        sys.exit(1)
    settings["base_vm_bytes"] = _vm_size_bytes(status_fd)
    os.close(status_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool stops us by closing the socket
    send_message(sock, {"hello": root.report.to_dict(), "pid": os.getpid()})
    gc.collect()
    gc.freeze()  # children's GC leaves the warm objects alone: fewer copy-on-write faults
    Zygote(sock, root, settings).run()


if __name__ == "__main__":
    main()
