"""A local HTTP server for tests that stand in for an inference or sandbox server."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve(
    routes: dict[tuple[str, str], Handler], middlewares: list[Any] | None = None
) -> tuple[web.AppRunner, str]:
    """Serve `routes` ({(method, path): handler}) on a free local port; (runner, base URL).
    The caller ends it with `await runner.cleanup()`."""
    app = web.Application(middlewares=middlewares or [])
    for (method, path), handler in routes.items():
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
