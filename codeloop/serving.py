"""How codeloop's two HTTP servers (`codeloop serve`, `codeloop sandbox serve`) run and stop.

A server runs until SIGTERM or SIGINT. Then it stops listening, gives the requests in flight
`grace_s` seconds to be answered, cancels those still running (their clients see the connection
close) and closes every other connection: idle ones, ones in the middle of their headers or
body. Whatever its clients do, it exits 0 within about `grace_s` of the signal (at most twice
that: a cancelled handler is given as long again to unwind, and codeloop's unwind at once). An
orchestrator's grace period (Kubernetes: 30 s) longer than `grace_s` never has to kill it.
"""

from __future__ import annotations

import asyncio
import signal
import ssl
from collections.abc import Callable

from aiohttp import web

from codeloop.auth import cap_connections


async def serve_until_signal(
    app: web.Application,
    host: str,
    port: int,
    *,
    tls: ssl.SSLContext | None,
    client_timeout_s: float,
    max_connections: int,
    grace_s: float,
    started: Callable[[], None],
    stopping: Callable[[], None] = lambda: None,
) -> None:
    """Serve `app` on `host`:`port` until SIGTERM or SIGINT, then stop as the module says.
    A connection without a whole request line and headers within `client_timeout_s` is cut,
    and one past `max_connections` closed. `started` runs once it listens, `stopping` once the
    signal has come (before the drain)."""
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        keepalive_timeout=client_timeout_s,
        shutdown_timeout=grace_s,
    )
    await runner.setup()
    cap_connections(runner, max_connections)
    site = web.TCPSite(runner, host, port, backlog=1024, ssl_context=tls)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    started()
    try:
        await stop.wait()
    finally:
        stopping()
        await runner.cleanup()  # stop listening, drain within grace_s, close every connection
