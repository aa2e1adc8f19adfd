"""The sockets that give up on a silent peer (`codeloop/net.py`): the options they carry, on a
socket made alone and on the connections an aiohttp session opens through the connector."""

import asyncio
import socket
import sys

import aiohttp
import pytest
from aiohttp import web
from fake_http import serve

from codeloop.net import watched_connector, watched_socket

LINUX = pytest.mark.skipif(sys.platform != "linux", reason="the options are Linux's")


def _options(sock: socket.socket) -> dict[str, int]:
    return {
        "keepalive": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        "idle_s": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        "interval_s": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        "user_timeout_ms": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
    }


@LINUX
def test_a_watched_socket_gives_up_after_the_silence_it_was_given() -> None:
    info = socket.getaddrinfo("127.0.0.1", 80, type=socket.SOCK_STREAM)[0]
    with watched_socket(2.5, info) as sock:
        assert _options(sock) == {
            "keepalive": 1,
            "idle_s": 1,  # probes an idle connection after 1 s, then every second
            "interval_s": 1,
            "user_timeout_ms": 2500,  # unacknowledged data or probes: given up after 2.5 s
        }


@LINUX
def test_the_connector_opens_watched_sockets() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()  # chunked: the client holds the connection meanwhile
        await response.prepare(request)
        await response.write(b"o")
        await asyncio.sleep(0.2)
        await response.write(b"k")
        await response.write_eof()
        return response

    async def main() -> dict[str, int]:
        runner, url = await serve({("GET", "/x"): handler})
        connector = watched_connector(4.0)
        try:
            async with (
                aiohttp.ClientSession(connector=connector) as session,
                session.get(url + "/x") as response,
            ):
                assert response.connection is not None  # held until the body is read
                options = _options(response.connection.transport.get_extra_info("socket"))
                assert await response.text() == "ok"
            return options
        finally:
            await runner.cleanup()

    assert asyncio.run(main())["user_timeout_ms"] == 4000
