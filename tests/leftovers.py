"""Processes that outlive the codeloop process that started them. The sandbox's and the
verifier's zygotes name their parent's pid on their command line, and the processes they fork
(sandbox calls and sessions, reward workers) carry the same command line."""

from __future__ import annotations

import json
import time
from pathlib import Path


def started_by(pid: int) -> list[str]:
    """The command lines of the live processes that `pid`'s sandbox and verifier started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = [
                a.decode(errors="replace")
                for a in (entry / "cmdline").read_bytes().split(b"\0")
                if a
            ]
        except OSError:  # gone meanwhile
            continue
        sandbox = "codeloop.sandbox.zygote" in argv and json.loads(argv[-1]).get("parent") == pid
        reward = "codeloop.reward.zygote" in argv and argv[-1] == str(pid)
        if sandbox or reward:
            found.append(" ".join(argv[:3]))
    return found


def left_behind(pids: list[int], wait_s: float = 10.0) -> list[str]:
    """What the (killed) processes `pids` started and is still alive after `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while (alive := [c for pid in pids for c in started_by(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive
