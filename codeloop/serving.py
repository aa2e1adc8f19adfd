"""How codeloop's two HTTP servers (`codeloop serve`, `codeloop sandbox serve`) run and stop.

A server runs until SIGTERM or SIGINT. Then it stops listening, gives the requests in flight
(those whose handler has started, a body being read included) `grace_s` seconds to be
answered, cancels those still running (their clients see the connection close) and closes
every other connection: idle ones, ones in the middle of their headers. Whatever its clients
do, it stops serving within about `grace_s` + `UNWIND_S` of the signal (the sandbox server then
stops its workers, up to 2 s more). An orchestrator's grace
period (Kubernetes: 30 s) longer than that never has to kill it.
"""

from __future__ import annotations

import asyncio
import signal
import ssl
from collections.abc import Callable

from aiohttp import web

from codeloop.auth import Handler, cap_connections

UNWIND_S = 0.5  # a cancelled handler's time to unwind before its connection is closed anyway


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
    in_flight = 0

    @web.middleware
    async def counted(request: web.Request, handler: Handler) -> web.StreamResponse:
        nonlocal in_flight
        in_flight += 1
        try:
            return await handler(request)
        finally:
            in_flight -= 1

    app.middlewares.insert(0, counted)  # outermost: a body still being read counts
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        keepalive_timeout=client_timeout_s,
        shutdown_timeout=UNWIND_S,
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
        await site.stop()  # no new connections
        until = loop.time() + grace_s
        while in_flight and loop.time() < until:
            await asyncio.sleep(0.02)
        await runner.cleanup()  # cancel what still runs, close every connection
