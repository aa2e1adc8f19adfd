"""A shared secret between codeloop's servers and their clients: a bearer token.

A server started with a token (`--token-file FILE`, or the variable `CODELOOP_TOKEN`) answers
401 to every request but `GET /health` that does not carry `Authorization: Bearer <token>`,
before it reads the body: nothing runs, loads or queues. The comparison takes the same time
whatever the guess. Clients read the same file or variable (`sandbox.token_file`,
`rollout.server_token_file`) and send the header on every request. The token itself is never
printed, logged or written anywhere by codeloop. A server asked to bind an address other than
loopback without a token refuses to start (`check_exposure`) unless told `--insecure-no-token`.
The token keeps out those who can reach a server but do not hold the secret; it does not hide
the traffic (put TLS or a proxy in front for that).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from codeloop.config import ConfigError
from codeloop.errors import read_text_input

ENV = "CODELOOP_TOKEN"
# A client has this long for a request's line and headers (from connecting, or from the answer
# before on a kept-alive connection) and as long again for its body; then the connection is cut
# (the body: after a 408). A connection that holds part of a request holds at most
# `client_max_size` bytes, and none is held longer than this.
CLIENT_TIMEOUT_S = 60.0
# Open connections a server holds at most; one more is closed as it arrives, before it is read.
# With the client limit above, connections that send nothing hold a server for at most 60 s.
MAX_CONNECTIONS = 1024
OPEN_ROUTES = frozenset({"/health"})  # a load balancer's or a test's probe needs no secret
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def read_token(token_file: str, what: str) -> str | None:
    """The token in `token_file` (its first line that is not blank), else `CODELOOP_TOKEN`,
    else None (no token: requests are not checked). `what` names the setting in errors (a
    file that is missing, empty or not text)."""
    if token_file:
        return read_text_input(token_file, what).strip().splitlines()[0].strip()
    return os.environ.get(ENV) or None


def check_exposure(command: str, host: str, token: str | None, insecure: bool) -> None:
    """Refuse (a `ConfigError`, one line naming the flags) to serve an address other than
    loopback without a token, unless `insecure` (`--insecure-no-token`): then `command` warns
    at start."""
    if token or _loopback(host):
        return
    if not insecure:
        raise ConfigError(
            f"--host {host} can be reached from other machines and no token is "
            f"set: give --token-file FILE (or {ENV}), or --insecure-no-token to serve anyone"
        )
    print(
        f"{command}: warning: serving {host} without a token (--insecure-no-token): anyone who "
        "can reach it is served",
        file=sys.stderr,
        flush=True,
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: whatever it resolves to, it is not known to be loopback
        return False


def bearer(token: str | None) -> dict[str, str]:
    """The header a client sends (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def read_body_within(seconds: float, streamed: frozenset[str] = frozenset()) -> Middleware:
    """An aiohttp middleware that reads a request's body before its handler runs, within
    `seconds`: a client that sends less than it announced gets 408 and its connection is
    closed. The routes in `streamed` read their own bodies (`chunks_within`)."""

    @web.middleware
    async def read(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.can_read_body and request.path not in streamed:
            try:
                await asyncio.wait_for(request.read(), seconds)  # kept for the handler
            except TimeoutError:
                message, status = f"the request's body did not arrive within {seconds:g} s", 408
            except OSError as err:  # the client went away mid-body: nothing to answer or log
                message, status = f"connection lost while reading the body ({err})", 400
            else:
                return await handler(request)
            response = web.json_response({"error": message}, status=status)
            response.force_close()
            return response
        return await handler(request)

    return read


async def chunks_within(request: web.Request, size: int, seconds: float) -> AsyncIterator[bytes]:
    """The request's body in chunks of at most `size` bytes, each of which must arrive within
    `seconds` (a body of any length that keeps coming is read whole): `TimeoutError` when one
    does not."""
    while chunk := await asyncio.wait_for(request.content.read(size), seconds):
        yield chunk


def require_token(token: str | None) -> Middleware:
    """An aiohttp middleware that refuses requests without the token (all pass without one)."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is not None and request.path not in OPEN_ROUTES:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return web.json_response(
                    {"error": f"unauthorized: send the server's token (--token-file or {ENV})"},
                    status=401,
                )
        return await handler(request)

    return check


def cap_connections(runner: web.AppRunner, most: int) -> None:
    """A server (`runner`, set up) that holds at most `most` open connections: one more is
    closed as it arrives, before any of it is read, and the server goes on serving the others.
    It is closed once its handler has started (a few milliseconds later), as a client that
    hangs up on an idle connection is: aiohttp's handler needs to start before it can end."""
    server = runner.server
    assert server is not None, "cap_connections needs runner.setup() first"
    made = server.connection_made

    def connection_made(handler: Any, transport: asyncio.Transport) -> None:
        over = len(server.connections) >= most
        made(handler, transport)
        if over:
            asyncio.get_running_loop().call_later(0.01, transport.close)

    server.connection_made = connection_made  # type: ignore[method-assign]
