"""Faults with real server processes: a `codeloop sandbox serve` killed in the middle of the
work and started again on its port, behind one `SandboxClient` over two servers."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time

from test_sandbox_server import Server

from codeloop.config import SandboxConfig
from codeloop.sandbox.client import SandboxClient
from codeloop.types import ExecRequest, ExecStatus

CFG = SandboxConfig(client_flush_ms=1.0, client_batch_size=4, client_retries=6)


def _served(server: Server) -> int:
    """Calls the server has answered since it started (its /metrics)."""
    text = server.get("/metrics")[1]
    return sum(int(n) for n in re.findall(r'sandbox_calls_total\{status="\w+"\} (\d+)', text))


def _kill_then_restart(server: Server, down_s: float, box: list[Server]) -> None:
    """Kills `server` once it has answered a call (in the middle of the work, however fast the
    machine), and starts it again on its port `down_s` later."""
    deadline = time.monotonic() + 300
    while _served(server) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    time.sleep(down_s)
    box.append(Server(port=server.port))


def test_a_server_killed_mid_work_loses_and_duplicates_nothing_and_rejoins() -> None:
    a, b = Server(), Server()
    restarted: list[Server] = []
    try:
        killer = threading.Thread(target=_kill_then_restart, args=(a, 1.0, restarted))

        async def main() -> tuple[list[object], list[object], float]:
            async with SandboxClient([a.url, b.url], CFG) as client:
                calls = [
                    ExecRequest(f"import time; time.sleep(0.2); print({i})", timeout_s=10)
                    for i in range(120)
                ]
                killer.start()
                during = await client.execute_batch(calls)
                killer.join()
                back, after = time.monotonic(), []
                while _served(restarted[0]) == 0 and time.monotonic() - back < 15:
                    after += await client.execute_batch(
                        [ExecRequest(f"print({i})") for i in range(len(after), len(after) + 8)]
                    )
            return during, after, time.monotonic() - back

        during, after, rejoined_s = asyncio.run(main())
        assert [r.status for r in during] == [ExecStatus.OK] * 120  # type: ignore[attr-defined]
        assert [r.stdout for r in during] == [f"{i}\n" for i in range(120)]  # type: ignore[attr-defined]
        assert [r.stdout for r in after] == [f"{i}\n" for i in range(len(after))]  # type: ignore[attr-defined]
        assert _served(restarted[0]) > 0 and rejoined_s < 6  # back within the longest cool-down
    finally:
        for server in [a, b, *restarted]:
            server.stop()


def test_a_session_call_on_a_dying_server_is_an_error_not_a_silent_rerun() -> None:
    a = Server()
    try:

        async def main() -> tuple[object, object]:
            async with SandboxClient([a.url], CFG) as client:
                first = await client.execute(ExecRequest("x = 41", session_id="s"))
                call = asyncio.ensure_future(
                    client.execute(
                        ExecRequest(
                            "import time; time.sleep(3); print(x + 1)", session_id="s", timeout_s=10
                        )
                    )
                )
                await asyncio.to_thread(a.wait_in_flight)
                a.process.send_signal(signal.SIGKILL)
                return first, await call

        first, lost = asyncio.run(main())
        assert first.status == ExecStatus.OK  # type: ignore[attr-defined]
        assert lost.status == ExecStatus.SANDBOX_ERROR  # type: ignore[attr-defined]
        assert "not retried" in lost.stderr  # type: ignore[attr-defined]
    finally:
        a.stop()
