"""How a call's end becomes its status: the pure mapping from (deadline passed, the child's
trailer, its wait status), a row per cause; then the memory and time limits at their edges."""

import json
import os
import signal
from pathlib import Path

import pytest
from sandbox_helpers import SyncSandbox

from codeloop.sandbox.executor import EXIT_SETUP_FAILED, ChildSpec, _setup_or_exit
from codeloop.sandbox.isolation import Limits
from codeloop.sandbox.zygote import Call, _status_from
from codeloop.types import ExecStatus


def _exited(code: int) -> int:
    return code << 8  # a wait status: exited with `code`


def _trailer(status: str, error_type: str | None, exit_code: int) -> bytes:
    return json.dumps({"status": status, "error_type": error_type, "exit_code": exit_code}).encode()


ROWS = [  # (timed out, trailer, wait status) -> (status, error type, exit code)
    (False, _trailer("ok", None, 0), _exited(0), (ExecStatus.OK, None, 0)),
    (
        False,
        _trailer("error", "ZeroDivisionError", 1),
        _exited(1),
        (ExecStatus.ERROR, "ZeroDivisionError", 1),
    ),
    (False, _trailer("error", "SystemExit", 3), _exited(3), (ExecStatus.ERROR, "SystemExit", 3)),
    (
        False,
        _trailer("memory", "MemoryError", 1),
        _exited(1),
        (ExecStatus.MEMORY, "MemoryError", 1),
    ),
    (False, _trailer("timeout", None, 124), _exited(124), (ExecStatus.TIMEOUT, None, 124)),
    # the deadline passed: a timeout, whatever the child wrote or how it ended
    (True, _trailer("ok", None, 0), _exited(0), (ExecStatus.TIMEOUT, None, 0)),
    (True, b"", signal.SIGKILL, (ExecStatus.TIMEOUT, None, -9)),
    # no trailer: the wait status decides
    (False, b"", signal.SIGKILL, (ExecStatus.KILLED, "SIGKILL", -9)),
    (False, b"", signal.SIGSEGV, (ExecStatus.KILLED, "SIGSEGV", -11)),
    (False, b"", signal.SIGABRT, (ExecStatus.KILLED, "SIGABRT", -6)),
    (False, b"", signal.SIGXFSZ, (ExecStatus.KILLED, "SIGXFSZ", -25)),  # the file size limit
    (False, b"", signal.SIGXCPU, (ExecStatus.TIMEOUT, None, -24)),  # the CPU time limit
    (False, b"", _exited(0), (ExecStatus.OK, None, 0)),  # os._exit(0)
    (False, b"", _exited(3), (ExecStatus.ERROR, None, 3)),  # os._exit(3)
    # the sandbox could not set the child up: its fault, not the model's
    (False, b"", _exited(EXIT_SETUP_FAILED), (ExecStatus.SANDBOX_ERROR, None, EXIT_SETUP_FAILED)),
    (False, b"", None, (ExecStatus.SANDBOX_ERROR, None, None)),  # no end known at all
    # garbage on the trailer's fd: the wait status decides
    (False, b"not json", _exited(2), (ExecStatus.ERROR, None, 2)),
    (False, b'{"no": "status"}', signal.SIGKILL, (ExecStatus.KILLED, "SIGKILL", -9)),
    # a session's call: the child lives on, the trailer alone tells
    (False, _trailer("error", "NameError", 1), None, (ExecStatus.ERROR, "NameError", 1)),
]


@pytest.mark.parametrize(("timed_out", "trailer", "wait_status", "expected"), ROWS)
def test_each_cause_maps_to_its_status(
    timed_out: bool, trailer: bytes, wait_status: int | None, expected: tuple[object, ...]
) -> None:
    call = Call({}, 0.0, 1.0, 1024, trailer=bytearray(trailer), timed_out=timed_out)
    assert _status_from(call, wait_status) == expected


def test_the_memory_limit_at_its_edge(sandbox: SyncSandbox) -> None:
    """256 MB asked: 200 MB more fits, 320 MB more does not (a limit of twice the one asked
    would let it through)."""
    fits = sandbox.execute("b = bytearray(200 << 20); print(len(b) >> 20)", memory_mb=256)
    assert (fits.status, fits.stdout) == (ExecStatus.OK, "200\n"), fits
    over = sandbox.execute("b = bytearray(320 << 20)", memory_mb=256)
    assert (over.status, over.error_type) == (ExecStatus.MEMORY, "MemoryError"), over


def test_the_time_limit_at_its_edge(sandbox: SyncSandbox) -> None:
    """A CPU-bound loop of 1.2 s finishes under a 2 s limit (the CPU limit is 3 s); one of 2.5 s
    is stopped as a timeout, at about the limit."""
    spin = "import time\nend = time.monotonic() + {}\nwhile time.monotonic() < end: pass\n"
    spin += "print('done')"
    under = sandbox.execute(spin.format(1.2), timeout_s=2.0)
    assert (under.status, under.stdout) == (ExecStatus.OK, "done\n"), under
    over = sandbox.execute(spin.format(2.5), timeout_s=2.0)
    assert over.status == ExecStatus.TIMEOUT and over.stdout == "", over
    assert 1.9 < over.duration_s < 2.5


def test_a_child_the_sandbox_cannot_set_up_is_a_sandbox_error(tmp_path: Path) -> None:
    """A real fork whose set-up fails (its working directory is gone): the exit code says so,
    and the call is the sandbox's fault, not the code's."""
    err_r, err_w = os.pipe()
    null_in, null_out = os.open(os.devnull, os.O_RDONLY), os.open(os.devnull, os.O_WRONLY)
    limits = Limits(cpu_s=5, address_space_bytes=1 << 40)
    spec = ChildSpec(
        workdir=str(tmp_path / "gone"),
        stdin_fd=null_in,
        stdout_fd=null_out,
        stderr_fd=err_w,
        trailer_fd=null_out,
        uid=None,
        proc_fd=None,
        limits=limits,
        timeout_s=5.0,
    )
    pid = os.fork()
    if pid == 0:
        _setup_or_exit(spec)
        os._exit(0)  # not reached: the set-up failed
    for fd in (err_w, null_in, null_out):
        os.close(fd)
    _, wait_status = os.waitpid(pid, 0)
    with os.fdopen(err_r) as stderr:
        assert "sandbox setup failed" in stderr.read()
    call = Call({}, 0.0, 1.0, 1024)
    assert _status_from(call, wait_status) == (ExecStatus.SANDBOX_ERROR, None, EXIT_SETUP_FAILED)


@pytest.mark.parametrize("session", [None, "timed"])
def test_a_call_that_times_out_keeps_its_output_and_its_own_exit_code(
    sandbox: SyncSandbox, session: str | None
) -> None:
    """The soft timer (SIGALRM at the limit) ends the call itself: what it printed before the
    deadline comes back, and the exit code is the timeout's own (124): the hard kill that follows
    the limit by HARD_KILL_GRACE_S would have left SIGKILL's -9. (How long the call took says
    nothing more, and on a loaded machine the parent may note its end late.)"""
    code = "print('a line')\nprint('and a part', end='')\nwhile True: pass"  # one unflushed
    result = sandbox.execute(code, timeout_s=1.0, session_id=session)
    assert result.status == ExecStatus.TIMEOUT, result
    assert result.stdout == "a line\nand a part", result
    assert result.exit_code == 124, result
