"""A process that runs a sandbox and a verifier and is killed with SIGKILL (no cleanup of
its own) leaves nothing behind: not the zygotes, not a sandbox call still running, not the
reward workers."""

import subprocess
import sys

from leftovers import left_behind, started_by

SCRIPT = """
import asyncio
from codeloop.config import RewardConfig, SandboxConfig
from codeloop.reward.verifier import Verifier
from codeloop.sandbox.pool import LocalSandbox
from codeloop.types import ExecRequest

async def main():
    verifier = Verifier(RewardConfig(workers=1))
    verifier.pool  # started on first need: now
    async with LocalSandbox(SandboxConfig(workers=1)) as sandbox:
        print("ready", flush=True)
        await sandbox.execute(ExecRequest(code="import time; time.sleep(50)", timeout_s=55))

asyncio.run(main())
"""


def test_a_killed_process_leaves_no_sandbox_or_reward_process_behind() -> None:
    run = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout is not None and run.stdout.readline() == "ready\n"
        # sandbox zygote + the call's process (a fork of it), reward zygote + its worker
        for _ in range(100):
            if len(started := started_by(run.pid)) >= 4:
                break
            subprocess.run(["sleep", "0.1"])
        assert len(started) == 4, started
        run.kill()
        run.wait()
        assert left_behind([run.pid]) == []
    finally:
        run.kill()


def test_a_zygote_whose_pool_is_gone_stops_without_a_traceback() -> None:
    """A pool killed with replies unread: the zygote's next read fails (ECONNRESET) and its next
    reply too (EPIPE), before the kernel's SIGKILL for it arrives; it stops quietly."""
    import socket

    from codeloop.sandbox.zygote import Zygote

    ours, theirs = socket.socketpair()
    zygote = Zygote(ours, None, {"slots": 1, "uid_base": 0, "base_vm_bytes": 0})  # type: ignore[arg-type]
    zygote._answer(1, {"status": "ok"})  # never read
    theirs.close()
    zygote._on_control()  # ECONNRESET
    assert not zygote.running
    zygote.running = True
    zygote._answer(2, {"status": "ok"})  # EPIPE
    assert not zygote.running
    ours.close()
