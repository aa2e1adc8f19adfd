"""Adversarial tests: each attacks the real sandbox, asserts the attack failed, and that the
sandbox still answers the next call correctly. Traffic goes to loopback addresses only."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from sandbox_helpers import SECRET, SyncSandbox, assert_healthy

from codeloop.sandbox.isolation import python_paths
from codeloop.sandbox.pool import UID_BASE
from codeloop.types import ExecRequest, ExecStatus

REPO = Path(__file__).resolve().parents[2]


def _sandbox_processes() -> list[str]:
    """Host processes running under a sandbox uid (there must be none between calls) that
    this test process started or that nobody owns any more (their parent is init); those of
    other test processes running meanwhile are theirs to check."""
    out = subprocess.run(["ps", "-eo", "uid=,pid=,args="], capture_output=True, text=True).stdout
    rows = [line for line in out.splitlines() if int(line.split()[0]) >= UID_BASE]
    return [line for line in rows if _ours_or_orphaned(int(line.split()[1]))]


def _ours_or_orphaned(pid: int) -> bool:
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False  # gone meanwhile
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == os.getpid() or parent == 1:
            return True
        pid = parent
    return True


def _no_leftovers() -> None:
    deadline = time.monotonic() + 30  # about a hang, not speed
    while _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes() == []


def test_cannot_reach_a_server_on_the_hosts_loopback(sandbox: SyncSandbox) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted: list[object] = []
    listener.settimeout(3)
    thread = threading.Thread(target=lambda: accepted.append(_accept(listener)))
    thread.start()
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "    print('connected')\n"
        "except OSError as err:\n"
        "    print('failed', type(err).__name__)\n"
    )
    result = sandbox.execute(code)
    thread.join()
    listener.close()
    assert result.status == ExecStatus.OK
    assert result.stdout.startswith("failed"), result.stdout
    assert accepted == [None]  # nothing ever connected
    assert_healthy(sandbox)


def _accept(listener: socket.socket) -> object:
    try:
        return listener.accept()
    except OSError:
        return None


def test_only_an_isolated_loopback_is_visible(sandbox: SyncSandbox) -> None:
    code = (
        "import socket, fcntl, struct\n"
        "print(socket.if_nameindex())\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "flags = fcntl.ioctl(s, 0x8913, struct.pack('256s', b'lo'))\n"  # SIOCGIFFLAGS
        "print('up' if struct.unpack('H', flags[16:18])[0] & 1 else 'down')\n"
    )
    result = sandbox.execute(code)
    assert result.stdout == "[(1, 'lo')]\ndown\n", result
    assert_healthy(sandbox)


@pytest.mark.parametrize(
    "target",
    [
        "/root/codeloop-attack",
        "/tmp/codeloop-attack",
        str(REPO / "codeloop-attack"),
        "/usr/codeloop-attack",
        "/codeloop-attack",
    ],
)
def test_cannot_write_outside_the_working_directory(sandbox: SyncSandbox, target: str) -> None:
    result = sandbox.execute(f"open({target!r}, 'w').write('pwned')")
    assert result.status == ExecStatus.ERROR
    assert result.error_type in {"PermissionError", "FileNotFoundError", "OSError"}, result
    assert not os.path.exists(target)
    assert_healthy(sandbox)


def test_host_files_are_invisible(sandbox: SyncSandbox) -> None:
    # The repo path may exist when the venv lives inside it (only the venv is mounted).
    code = (
        "import os\n"
        f"print(os.path.exists({str(REPO / 'README.md')!r}), os.path.exists('/root/.bashrc'))\n"
        "print(os.path.exists('/etc/passwd'), os.path.exists('/proc/1/environ'))\n"
        "print(sorted(os.listdir('/')))\n"
    )
    result = sandbox.execute(code)
    lines = result.stdout.splitlines()
    assert lines[:2] == ["False False", "False False"], result
    # Besides the system directories, only the top of the mounted Python installation shows.
    python_tops = {Path(p).parts[1] for p in python_paths()}
    system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "root", "sbin", "tmp", "usr"}
    assert set(eval(lines[2])) <= system | python_tops, (lines[2], python_tops)
    listing = sandbox.execute(f"import os; print(os.listdir({str(REPO)!r}))")
    assert listing.error_type == "FileNotFoundError" or eval(listing.stdout) == [".venv"], listing


def test_working_directory_is_fresh_and_private(sandbox: SyncSandbox) -> None:
    writer = "open('secret.txt', 'w').write('s3cret'); import os, time; print(os.getcwd())"
    reader = (
        "import os\n"
        "try:\n    print(os.listdir('/tmp'))\nexcept OSError as e:\n    print(type(e).__name__)\n"
        "hits = []\n"
        "for i in range(1, 5000):\n"
        "    try:\n        hits.append(open(f'/tmp/c{i}/secret.txt').read())\n"
        "    except OSError:\n        pass\n"
        "print(hits, os.listdir('.'))\n"
    )
    slow_writer = writer + "; time.sleep(1.5)"
    results = sandbox.batch([ExecRequest(slow_writer), ExecRequest(reader)])
    assert results[0].status == ExecStatus.OK
    assert results[1].stdout == "PermissionError\n[] []\n", results[1]
    again = sandbox.execute("import os; print(os.listdir('.'))")
    assert again.stdout == "[]\n"  # the next call starts in an empty directory
    assert_healthy(sandbox)


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()",
        "import os\nfor _ in range(100000):\n    try:\n        os.fork()\n    except OSError:\n"
        "        pass\nimport time; time.sleep(60)",
    ],
)
def test_fork_bombs_are_contained(sandbox: SyncSandbox, code: str) -> None:
    started = time.monotonic()
    result = sandbox.execute(code, timeout_s=2.0)
    assert time.monotonic() - started < 2.0 + 1.5
    assert result.status in {ExecStatus.ERROR, ExecStatus.TIMEOUT}, result
    _no_leftovers()
    assert_healthy(sandbox)


def test_memory_bomb_hits_the_memory_limit(sandbox: SyncSandbox) -> None:
    result = sandbox.execute("a = ' ' * (10**10)", memory_mb=256)
    assert (result.status, result.error_type) == (ExecStatus.MEMORY, "MemoryError")
    result = sandbox.execute("import numpy as np\nx = np.ones((1 << 30,))", memory_mb=256)
    assert result.status == ExecStatus.MEMORY, result
    assert_healthy(sandbox)


def test_infinite_loop_times_out_on_time(sandbox: SyncSandbox) -> None:
    started = time.monotonic()
    result = sandbox.execute("while True:\n    pass", timeout_s=1.0)
    assert result.status == ExecStatus.TIMEOUT
    assert time.monotonic() - started < 1.0 + 0.5
    assert_healthy(sandbox)


def test_ignoring_sigterm_and_sigalrm_does_not_escape_the_deadline(sandbox: SyncSandbox) -> None:
    code = (
        "import signal\n"
        "for s in (signal.SIGTERM, signal.SIGALRM, signal.SIGXCPU):\n"
        "    signal.signal(s, signal.SIG_IGN)\n"
        "while True:\n    pass\n"
    )
    started = time.monotonic()
    result = sandbox.execute(code, timeout_s=1.0)
    assert result.status == ExecStatus.TIMEOUT
    assert time.monotonic() - started < 1.0 + 0.75
    _no_leftovers()
    assert_healthy(sandbox)


def test_huge_output_is_capped_and_marked(sandbox: SyncSandbox) -> None:
    started = time.monotonic()
    code = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\nprint('end')"
    result = sandbox.execute(code, timeout_s=20)
    assert result.status == ExecStatus.OK
    assert result.truncated
    assert len(result.stdout) == sandbox.local.pool.cfg.max_output_bytes
    assert time.monotonic() - started < 10
    assert_healthy(sandbox)


@pytest.mark.parametrize(
    "code",
    [
        "import os; os.close(0); os.close(1); os.close(2); print('lost')",
        "import os; fd = os.open('f', os.O_WRONLY | os.O_CREAT); os.dup2(fd, 1); os.dup2(fd, 2)\n"
        "print('to a file')",
        "import os; os.close(3)\nprint('trailer fd closed')",
        "import os; os.write(3, b'{\"status\": \"ok\"}\\n'); raise ValueError('x')",
    ],
)
def test_tampering_with_standard_fds(sandbox: SyncSandbox, code: str) -> None:
    result = sandbox.execute(code)
    assert result.status in {ExecStatus.OK, ExecStatus.ERROR}, result
    assert_healthy(sandbox)


@pytest.mark.parametrize(
    "code",
    [
        "import os, signal; os.kill(os.getppid(), signal.SIGKILL)",
        "import os, signal; os.killpg(0, signal.SIGKILL)",
        "import os, signal; os.kill(-1, signal.SIGKILL)",
        "import os, signal; os.kill(1, signal.SIGKILL)",
    ],
)
def test_killing_parents_or_groups_hurts_nobody_else(sandbox: SyncSandbox, code: str) -> None:
    zygotes = [w.process.pid for w in sandbox.local.pool.workers if w.process]
    sandbox.execute(code)
    for pid in zygotes:
        os.kill(pid, 0)  # still alive
    assert_healthy(sandbox)


def test_rlimits_cannot_be_raised(sandbox: SyncSandbox) -> None:
    code = (
        "import resource\n"
        "for name in ('RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_NPROC', 'RLIMIT_NOFILE'):\n"
        "    which = getattr(resource, name)\n"
        "    soft, hard = resource.getrlimit(which)\n"
        "    try:\n"
        "        resource.setrlimit(which, (hard * 2 + 1, hard * 2 + 1))\n"
        "        print(name, 'raised')\n"
        "    except (ValueError, OSError):\n"
        "        print(name, 'refused')\n"
    )
    result = sandbox.execute(code)
    assert result.stdout.split().count("refused") == 4, result.stdout
    assert_healthy(sandbox)


def test_privileges_are_dropped(sandbox: SyncSandbox) -> None:
    code = "import os; print(os.getuid(), os.geteuid(), os.getgroups(), os.getpid())"
    uid, euid, groups, pid = sandbox.execute(code).stdout.split(" ", 3)
    assert int(uid) == int(euid) >= UID_BASE
    assert groups == "[]" and pid.strip() == "1"
    assert sandbox.execute("import os; os.setuid(0)").error_type == "PermissionError"


def test_threads_left_running_do_not_hold_the_call(sandbox: SyncSandbox) -> None:
    code = (
        "import threading, time\n"
        "threading.Thread(target=lambda: time.sleep(60)).start()\n"
        "threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()\n"
        "print('main done')\n"
    )
    started = time.monotonic()
    result = sandbox.execute(code, timeout_s=5)
    assert (result.status, result.stdout) == (ExecStatus.OK, "main done\n")
    assert time.monotonic() - started < 2
    _no_leftovers()
    assert_healthy(sandbox)


def test_os_exit_reports_its_code(sandbox: SyncSandbox) -> None:
    assert sandbox.execute("print('a', flush=True); import os; os._exit(0)").status == "ok"
    result = sandbox.execute("import os; os._exit(3)")
    assert (result.status, result.exit_code) == (ExecStatus.ERROR, 3)
    assert_healthy(sandbox)


def test_segfault_is_reported_as_killed(sandbox: SyncSandbox) -> None:
    result = sandbox.execute("import ctypes; ctypes.string_at(0)")
    assert (result.status, result.error_type) == (ExecStatus.KILLED, "SIGSEGV")
    assert_healthy(sandbox)


def test_the_servers_environment_is_not_inherited(sandbox: SyncSandbox) -> None:
    assert os.environ["CODELOOP_TEST_SECRET"] == SECRET  # set before the sandbox started
    code = (
        "import os\n"
        "print(sorted(os.environ))\n"
        "for path in ('/proc/self/environ', '/proc/1/environ'):\n"
        "    try:\n        print(open(path, 'rb').read())\n"
        "    except OSError as e:\n        print(type(e).__name__)\n"
    )
    result = sandbox.execute(code)
    assert SECRET not in result.stdout and SECRET not in result.stderr
    assert result.stdout.splitlines()[0] == "['HOME', 'LANG', 'PATH', 'PYTHONIOENCODING', 'TMPDIR']"
    # The zygote's own environment block, which children inherit, was clean from its exec.
    zygote = sandbox.local.pool.workers[0].process
    assert zygote is not None
    assert SECRET.encode() not in Path(f"/proc/{zygote.pid}/environ").read_bytes()


def test_stdin_and_the_math_stack(sandbox: SyncSandbox) -> None:
    code = "import sympy as sp, numpy as np\nn = int(input())\n"
    code += "print(sp.factorint(n), np.arange(3).sum())"
    result = sandbox.execute(code, stdin="360\n")
    assert result.stdout == "{2: 3, 3: 2, 5: 1} 3\n", result
    big = "x" * 300_000
    result = sandbox.execute("import sys; print(len(sys.stdin.read()))", stdin=big)
    assert result.stdout == "300000\n"


def test_requests_outside_the_limits_are_rejected(sandbox: SyncSandbox) -> None:
    for kwargs in ({"timeout_s": 0}, {"timeout_s": 10_000.0}, {"memory_mb": 1}, {"memory_mb": 1.5}):
        result = sandbox.execute("print(1)", **kwargs)
        assert result.status == ExecStatus.REJECTED, kwargs
        assert "must be" in result.stderr
    assert sandbox.execute("x" * (2 << 20)).status == ExecStatus.REJECTED


@pytest.mark.slow
def test_many_concurrent_calls_each_get_their_own_result(sandbox: SyncSandbox) -> None:
    requests = [ExecRequest(f"print({i} * 2)") for i in range(600)]
    results = sandbox.batch(requests)
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(600)]
    assert sandbox.local.pool.in_flight == 0


@pytest.mark.slow
def test_a_worker_killed_mid_call_gives_sandbox_error_and_recovers(sandbox: SyncSandbox) -> None:
    pool = sandbox.local.pool
    future = sandbox.run(_start_slow_calls(sandbox))
    time.sleep(0.5)
    victim = pool.workers[0].process
    assert victim is not None
    victim.kill()
    results = sandbox.run(_gather(future))
    statuses = {str(r.status) for r in results}
    assert "sandbox_error" in statuses and statuses <= {"sandbox_error", "ok"}, statuses
    deadline = time.monotonic() + 60
    while not all(w.alive for w in pool.workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(w.alive for w in pool.workers)
    assert [sandbox.execute(f"print({i})").stdout for i in range(6)] == [f"{i}\n" for i in range(6)]


async def _start_slow_calls(sandbox: SyncSandbox):  # type: ignore[no-untyped-def]
    import asyncio

    calls = [
        sandbox.local.execute(ExecRequest("import time; time.sleep(2); print(1)")) for _ in range(4)
    ]
    return asyncio.ensure_future(asyncio.gather(*calls))


async def _gather(future):  # type: ignore[no-untyped-def]
    return await future


@pytest.mark.slow
def test_a_worker_that_dies_while_idle_is_replaced(sandbox: SyncSandbox) -> None:
    pool = sandbox.local.pool
    victim = pool.workers[1].process
    assert victim is not None
    victim.kill()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        worker = pool.workers[1]
        if worker.alive and worker.process is not None and worker.process.pid != victim.pid:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the dead worker was not replaced")
    assert_healthy(sandbox)
