"""What runs inside a sandbox child: set up the process, run the snippet, report, exit.

`run_cell` gives the tool its notebook semantics: the module runs as `__main__`; if its last
statement is a bare expression, the value's repr is printed (unless it is None); an exception
prints a short traceback whose frames point at the user's lines (file `<code>`). The outcome is
written as one JSON line (the trailer) on fd 3, which the zygote reads; the child then exits
without running any cleanup of the zygote's state. A session child (`session_main`) instead
loops over calls read from fd 4, keeping its namespace between them.
"""

from __future__ import annotations

import ast
import builtins
import fcntl
import io
import json
import linecache
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, NoReturn

from codeloop.sandbox import isolation

FILENAME = "<code>"
TRAILER_FD = 3
EXIT_SETUP_FAILED = 71  # the child could not be set up: an infrastructure fault
TRACEBACK_FRAMES = 5
CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}


def compile_cell(code: str) -> tuple[CodeType, CodeType | None]:
    """Compile `code` as a module; split off a final bare expression to print its value."""
    tree = ast.parse(code, FILENAME, "exec")
    last: CodeType | None = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = compile(ast.Expression(tree.body[-1].value), FILENAME, "eval")
        tree.body.pop()
    return compile(tree, FILENAME, "exec"), last


def _user_traceback(exc: BaseException) -> str:
    """Type, message and the last few frames, starting at the first frame of user code."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != FILENAME:
        tb = tb.tb_next
    lines = traceback.format_exception(type(exc), exc, tb, limit=-TRACEBACK_FRAMES)
    if tb is None:  # a SyntaxError raised while compiling: message and caret only
        lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines)


def run_cell(code: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Run one snippet in `namespace`; return the trailer (status, error_type, exit_code)."""
    linecache.cache[FILENAME] = (len(code), None, code.splitlines(True), FILENAME)
    try:
        body, last = compile_cell(code)
        exec(body, namespace)
        if last is not None:
            value = eval(last, namespace)
            if value is not None:
                print(repr(value))
    except SystemExit as exc:
        code_ = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        return {
            "status": "ok" if code_ == 0 else "error",
            "error_type": "SystemExit" if code_ else None,
            "exit_code": code_,
        }
    except MemoryError as exc:
        _print_error(exc)
        return {"status": "memory", "error_type": "MemoryError", "exit_code": 1}
    except BaseException as exc:  # user code may raise anything, KeyboardInterrupt included
        _print_error(exc)
        return {"status": "error", "error_type": type(exc).__name__, "exit_code": 1}
    return {"status": "ok", "error_type": None, "exit_code": 0}


def _print_error(exc: BaseException) -> None:
    try:
        sys.stderr.write(_user_traceback(exc))
    except MemoryError:  # no memory left to format it
        sys.stderr.write(f"{type(exc).__name__}\n")


def write_trailer(trailer: dict[str, Any]) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # user code may have closed or broken it
            pass
    try:
        os.write(TRAILER_FD, json.dumps(trailer).encode() + b"\n")
    except OSError:  # fd 3 closed by user code: the zygote decides from the exit status
        pass


def _on_soft_timeout(signum: int, frame: FrameType | None) -> None:
    write_trailer({"status": "timeout", "error_type": None, "exit_code": 124})
    os._exit(124)


@dataclass(frozen=True)
class ChildSpec:
    """Everything a child needs, prepared by the zygote before the fork."""

    workdir: str
    stdin_fd: int
    stdout_fd: int
    stderr_fd: int
    trailer_fd: int
    uid: int | None  # None: keep the current uid (host is not root)
    proc_fd: int | None
    limits: isolation.Limits
    timeout_s: float | None  # None for a session: each call sets its own
    command_fd: int | None = None  # a session reads its calls from this pipe


def _fresh_stdio() -> None:
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    out = io.FileIO(1, "w", closefd=False)
    err = io.FileIO(2, "w", closefd=False)
    sys.stdout = io.TextIOWrapper(
        out, encoding="utf-8", errors="backslashreplace", line_buffering=True
    )
    sys.stderr = io.TextIOWrapper(
        err, encoding="utf-8", errors="backslashreplace", line_buffering=True
    )


def setup_child(spec: ChildSpec) -> None:
    """Turn a freshly forked zygote copy into an isolated, unprivileged sandbox process."""
    os.setsid()
    # Lowest CPU priority, first thing: however many children spin, the zygote and the server
    # still get the CPU to fork, enforce deadlines and answer.
    isolation.lower_autogroup(spec.proc_fd)
    os.nice(19)
    wanted = [spec.stdin_fd, spec.stdout_fd, spec.stderr_fd, spec.trailer_fd]
    if spec.command_fd is not None:
        wanted.append(spec.command_fd)
    # Move every source above the targets first, so that no dup2 overwrites a later source.
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 16) for fd in wanted]
    for target, fd in enumerate(moved):
        os.dup2(fd, target)
    os.closerange(len(wanted), 1 << 16)  # the zygote's socket, other calls' pipes, ns fds
    os.chdir(spec.workdir)
    os.environ.clear()
    os.environ.update({**CHILD_ENV, "HOME": spec.workdir, "TMPDIR": spec.workdir})
    # As PID 1 of its namespace the child would ignore these by default; make them fatal.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    isolation.no_new_privs_and_die_with_parent()
    isolation.apply_limits(spec.limits)
    if spec.uid is not None:
        isolation.drop_privileges(spec.uid)
        isolation.die_with_parent()  # a change of credentials cleared the first request
    _fresh_stdio()
    signal.signal(signal.SIGALRM, _on_soft_timeout)
    if spec.timeout_s is not None:
        signal.setitimer(signal.ITIMER_REAL, spec.timeout_s)


def _setup_or_exit(spec: ChildSpec) -> None:
    try:
        setup_child(spec)
    except BaseException as exc:  # noqa: BLE001 - any failure here is the sandbox's, not user's
        try:
            os.write(2, f"sandbox setup failed: {exc!r}\n".encode())
        finally:
            os._exit(EXIT_SETUP_FAILED)


def child_main(spec: ChildSpec, code: str) -> NoReturn:
    """Entry point right after fork for one call; never returns into the zygote's code."""
    _setup_or_exit(spec)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    trailer = run_cell(code, namespace)
    signal.setitimer(signal.ITIMER_REAL, 0)
    write_trailer(trailer)
    os._exit(trailer["exit_code"])


def _read_exactly(stream: io.BufferedReader[io.FileIO], size: int) -> bytes | None:
    data = stream.read(size)
    return data if data is not None and len(data) == size else None


def session_main(spec: ChildSpec) -> NoReturn:
    """A session: run the calls sent on fd 4 one after another in one namespace, until EOF.

    Each call is framed like the zygote's messages ({"code", "stdin", "timeout_s"}); its stdin
    is a string, its end is the trailer on fd 3. A call that overruns its time ends the session.
    """
    _setup_or_exit(spec)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    commands = io.BufferedReader(io.FileIO(4, "r", closefd=False))
    while (header := _read_exactly(commands, 4)) is not None:
        body = _read_exactly(commands, int.from_bytes(header, "big"))
        if body is None:
            break
        call = json.loads(body)
        sys.stdin = io.StringIO(call["stdin"])
        signal.setitimer(signal.ITIMER_REAL, float(call["timeout_s"]))
        trailer = run_cell(call["code"], namespace)
        signal.setitimer(signal.ITIMER_REAL, 0)
        write_trailer(trailer)
    os._exit(0)
