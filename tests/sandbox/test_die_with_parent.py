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
