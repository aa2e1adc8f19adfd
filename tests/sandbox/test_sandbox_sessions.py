"""Stateful sessions: calls with the same session_id share one interpreter."""

from __future__ import annotations

import time

from sandbox_helpers import SyncSandbox, assert_healthy

from codeloop.config import SandboxConfig
from codeloop.types import ExecRequest, ExecStatus


def test_a_session_keeps_variables_and_imports(sandbox: SyncSandbox) -> None:
    assert sandbox.execute("import sympy as sp\nx = sp.symbols('x')\nn = 41", session_id="a").ok
    result = sandbox.execute("n += 1\nprint(n, sp.expand((x + 1)**2))", session_id="a")
    assert result.stdout == "42 x**2 + 2*x + 1\n", result
    assert sandbox.execute("n", session_id="a").stdout == "42\n"
    # Another session, and a call without a session, see none of it.
    assert sandbox.execute("n", session_id="b").error_type == "NameError"
    assert sandbox.execute("n").error_type == "NameError"
    assert sandbox.run(sandbox.local.close_session("a")) is True
    assert sandbox.run(sandbox.local.close_session("b")) is True


def test_errors_and_stdin_inside_a_session(sandbox: SyncSandbox) -> None:
    assert sandbox.execute("1/0", session_id="c").error_type == "ZeroDivisionError"
    result = sandbox.execute("print(input() * 2)", session_id="c", stdin="ab\n")
    assert result.stdout == "abab\n"  # the session survived the exception
    assert sandbox.execute("import sys; sys.exit(3)", session_id="c").exit_code == 3
    assert sandbox.execute("print('still here')", session_id="c").stdout == "still here\n"
    sandbox.run(sandbox.local.close_session("c"))


def test_a_session_that_dies_reports_it_and_restarts_fresh(sandbox: SyncSandbox) -> None:
    assert sandbox.execute("secret = 1", session_id="d").ok
    result = sandbox.execute("import os; os._exit(5)", session_id="d")
    assert result.status == ExecStatus.ERROR and result.exit_code == 5
    assert "the session ended" in result.stderr
    assert sandbox.execute("secret", session_id="d").error_type == "NameError"  # fresh
    started = time.monotonic()
    result = sandbox.execute("while True: pass", session_id="d", timeout_s=1.0)
    assert result.status == ExecStatus.TIMEOUT and time.monotonic() - started < 1.75
    assert "the session ended" in result.stderr
    assert sandbox.execute("print('fresh')", session_id="d").stdout == "fresh\n"
    sandbox.run(sandbox.local.close_session("d"))
    assert_healthy(sandbox)


def test_session_output_is_per_call(sandbox: SyncSandbox) -> None:
    assert sandbox.execute("print('one')", session_id="e").stdout == "one\n"
    assert sandbox.execute("print('two')", session_id="e").stdout == "two\n"
    big = sandbox.execute("print('x' * 200000)\nprint('after')", session_id="e")
    assert big.truncated and len(big.stdout) == sandbox.local.pool.cfg.max_output_bytes
    assert sandbox.execute("print('three')", session_id="e").stdout == "three\n"
    sandbox.run(sandbox.local.close_session("e"))


def test_session_cap_and_idle_timeout() -> None:
    box = SyncSandbox(SandboxConfig(workers=1, max_sessions=2, session_idle_timeout_s=1.0))
    try:
        assert box.execute("a = 1", session_id="s1").ok
        assert box.execute("a = 2", session_id="s2").ok
        third = box.execute("a = 3", session_id="s3")
        assert third.status == ExecStatus.REJECTED
        assert "too many live sessions (2)" in third.stderr
        time.sleep(1.5)  # both sessions idle out
        assert box.execute("a", session_id="s3").error_type == "NameError"
        assert box.execute("a", session_id="s1").error_type == "NameError"  # ended when idle
        assert box.run(box.local.close_session("nope")) is False
    finally:
        box.close()


def test_concurrent_sessions_are_isolated(sandbox: SyncSandbox) -> None:
    setup = [ExecRequest(f"v = {i}", session_id=f"p{i}") for i in range(8)]
    assert all(r.ok for r in sandbox.batch(setup))
    reads = sandbox.batch([ExecRequest("print(v)", session_id=f"p{i}") for i in range(8)])
    assert [r.stdout for r in reads] == [f"{i}\n" for i in range(8)]
    for i in range(8):
        sandbox.run(sandbox.local.close_session(f"p{i}"))
