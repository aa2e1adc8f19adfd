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
EXIT_DRAIN_S = 1.0
STARTS_PER_TURN = 8  # after the child exits, wait at most this long for its pipes to close


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
    """One running child and what it has produced so far."""

    request: dict[str, Any]
    pid: int
    pidfd: int
    uid: int
    workdir: str
    started: float
    deadline: float
    cap: int
    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    trailer: bytearray = field(default_factory=bytearray)
    open_fds: set[int] = field(default_factory=set)
    truncated: bool = False
    timed_out: bool = False
    wait_status: int | None = None
    exited_at: float = 0.0


def _status_from(call: Call) -> tuple[ExecStatus, str | None, int | None]:
    """(status, error_type, exit_code) from the trailer, the deadline and the wait status."""
    exit_code = None
    if call.wait_status is not None:
        exit_code = os.waitstatus_to_exitcode(call.wait_status)
    if call.timed_out:
        return ExecStatus.TIMEOUT, None, exit_code
    if call.trailer:
        try:
            trailer = json.loads(call.trailer.decode().splitlines()[0])
            return ExecStatus(trailer["status"]), trailer.get("error_type"), exit_code
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
    return (
        (ExecStatus.OK, None, exit_code) if exit_code == 0 else (ExecStatus.ERROR, None, exit_code)
    )


class Zygote:
    def __init__(self, sock: socket.socket, root: isolation.SandboxRoot, settings: dict[str, Any]):
        self.sock = sock
        self.root = root
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ, self._on_control)
        self.inbox = bytearray()
        self.queue: collections.deque[dict[str, Any]] = collections.deque()
        self.calls: dict[int, Call] = {}  # by pidfd
        slots = int(settings["slots"])
        self.free_uids = list(range(int(settings["uid_base"]), int(settings["uid_base"]) + slots))
        self.base_vm_bytes = int(settings["base_vm_bytes"])
        self.seq = 0
        self.running = True

    # -- control socket -------------------------------------------------------------------
    def _on_control(self, _fd: int) -> None:
        data = self.sock.recv(1 << 20)
        if not data:  # the pool is gone: stop, children die with us (PDEATHSIG)
            self.running = False
            return
        self.inbox += data
        self.queue.extend(split_messages(self.inbox))

    def _answer(self, request_id: Any, result: dict[str, Any]) -> None:
        send_message(self.sock, {"id": request_id, "result": result})

    # -- starting a child -----------------------------------------------------------------
    def _start(self, request: dict[str, Any]) -> None:
        uid = self.free_uids.pop()
        self.seq += 1
        workdir = f"{self.root.scratch}/c{self.seq}"
        fds: list[int] = []
        try:
            os.mkdir(workdir, 0o700)
            if self.root.can_setuid:
                os.chown(workdir, uid, uid)
            call = self._fork(request, uid, workdir, fds)
        except OSError as err:
            for fd in fds:
                os.close(fd)
            self.free_uids.append(uid)
            shutil.rmtree(workdir, ignore_errors=True)
            result = {"status": "sandbox_error", "stderr": f"could not start the call: {err}"}
            self._answer(request["id"], result)
            return
        self.calls[call.pidfd] = call

    def _fork(self, request: dict[str, Any], uid: int, workdir: str, fds: list[int]) -> Call:
        stdin_r, stdin_w = os.pipe()
        fds += [stdin_r, stdin_w]
        stdin = request.get("stdin", "").encode()
        if len(stdin) > 65536:
            fcntl.fcntl(stdin_w, F_SETPIPE_SZ, len(stdin))
        if stdin:
            os.write(stdin_w, stdin)  # fits in the pipe buffer: never blocks
        os.close(stdin_w)
        fds.remove(stdin_w)
        pipes = [os.pipe() for _ in range(3)]  # stdout, stderr, trailer
        fds += [fd for pair in pipes for fd in pair]
        timeout_s = float(request["timeout_s"])
        limits = isolation.Limits(
            cpu_s=math.ceil(timeout_s) + 1,
            address_space_bytes=self.base_vm_bytes + int(request["memory_mb"]) * (1 << 20),
        )
        spec = executor.ChildSpec(
            workdir=workdir,
            stdin_fd=stdin_r,
            stdout_fd=pipes[0][1],
            stderr_fd=pipes[1][1],
            trailer_fd=pipes[2][1],
            uid=uid if self.root.can_setuid else None,
            proc_fd=self.root.proc_fd,
            limits=limits,
            timeout_s=timeout_s,
        )
        isolation.new_pid_namespace_for_next_child(self.root)
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            executor.child_main(spec, request["code"])
        for fd in (stdin_r, pipes[0][1], pipes[1][1], pipes[2][1]):
            os.close(fd)
            fds.remove(fd)
        pidfd = os.pidfd_open(pid)
        cap = int(request["max_output_bytes"])
        call = Call(
            request, pid, pidfd, uid, workdir, started, started + timeout_s + HARD_KILL_GRACE_S, cap
        )
        for fd, sink in (
            (pipes[0][0], call.out),
            (pipes[1][0], call.err),
            (pipes[2][0], call.trailer),
        ):
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, (call, sink))
            call.open_fds.add(fd)
        self.selector.register(pidfd, selectors.EVENT_READ, call)
        fds.clear()
        return call

    # -- watching children ----------------------------------------------------------------
    def _on_pipe(self, fd: int, call: Call, sink: bytearray) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.selector.unregister(fd)
            os.close(fd)
            call.open_fds.discard(fd)
            return
        room = call.cap - len(sink) if sink is not call.trailer else 4096 - len(sink)
        if len(data) > room:
            call.truncated = call.truncated or sink is not call.trailer
            data = data[: max(room, 0)]
        sink += data

    def _on_exit(self, call: Call) -> None:
        self.selector.unregister(call.pidfd)
        _, call.wait_status = os.waitpid(call.pid, 0)
        call.exited_at = time.monotonic()

    def _finish(self, call: Call) -> None:
        for fd in list(call.open_fds):
            self.selector.unregister(fd)
            os.close(fd)
        os.close(call.pidfd)
        del self.calls[call.pidfd]
        shutil.rmtree(call.workdir, ignore_errors=True)
        self.free_uids.append(call.uid)
        status, error_type, exit_code = _status_from(call)
        self._answer(
            call.request["id"],
            {
                "status": str(status),
                "stdout": call.out.decode("utf-8", "replace"),
                "stderr": call.err.decode("utf-8", "replace"),
                "exit_code": exit_code,
                "error_type": error_type,
                "duration_s": round(call.exited_at - call.started, 6),
                "truncated": call.truncated,
            },
        )

    def _sweep(self, now: float) -> None:
        for call in list(self.calls.values()):
            if call.wait_status is None and now >= call.deadline and not call.timed_out:
                call.timed_out = True
                isolation.restore_priority(self.root.proc_fd, call.pid)
                os.kill(call.pid, signal.SIGKILL)  # PID 1 of its namespace: takes all with it
            elif call.wait_status is not None and (
                not call.open_fds or now - call.exited_at > EXIT_DRAIN_S
            ):
                self._finish(call)

    def _next_timeout(self, now: float) -> float | None:
        deadlines = [c.deadline for c in self.calls.values() if c.wait_status is None]
        deadlines += [c.exited_at + EXIT_DRAIN_S for c in self.calls.values() if c.wait_status]
        return max(0.0, min(deadlines) - now) if deadlines else None

    def run(self) -> None:
        while self.running:
            # A few starts per turn, so that deadlines are enforced while a burst is forked.
            for _ in range(min(STARTS_PER_TURN, len(self.queue), len(self.free_uids))):
                self._start(self.queue.popleft())
            timeout = 0.0 if self.queue and self.free_uids else self._next_timeout(time.monotonic())
            for key, _ in self.selector.select(timeout):
                if key.data == self._on_control:
                    self._on_control(key.fd)
                elif isinstance(key.data, Call):
                    self._on_exit(key.data)
                else:
                    self._on_pipe(key.fd, *key.data)
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
    settings["base_vm_bytes"] = _vm_size_bytes(status_fd)
    os.close(status_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool stops us by closing the socket
    send_message(sock, {"hello": root.report.to_dict(), "pid": os.getpid()})
    gc.collect()
    gc.freeze()  # children's GC leaves the warm objects alone: fewer copy-on-write faults
    Zygote(sock, root, settings).run()


if __name__ == "__main__":
    main()
