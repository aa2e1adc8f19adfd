"""TCP connections that notice a silent peer: `watched_socket` and `watched_connector`.

A host that dies or is cut off sends nothing, not even a reset, so a connection to it would
wait out the whole request timeout (minutes for a long generation or tool call). These sockets
give up on a peer silent for `silent_s` seconds (on Linux): bytes sent and not acknowledged that
long, or keep-alive probes of an idle connection (a request the server is still working on)
unanswered that long, end the connection with an error. A peer that computes for minutes still
answers its probes from the kernel.
"""

from __future__ import annotations

import contextlib
import functools
import socket
from typing import Any

import aiohttp


def watched_socket(silent_s: float, addr_info: Any) -> socket.socket:
    """A TCP socket that gives up on a peer silent for `silent_s` seconds (see above)."""
    family, kind, proto = addr_info[:3]
    sock = socket.socket(family, kind, proto)
    options = [
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", 1),
        (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", int(1000 * silent_s)),
    ]
    for level, name, value in options:
        if hasattr(socket, name):  # Linux has them all; elsewhere the request's timeout remains
            with contextlib.suppress(OSError):
                sock.setsockopt(level, getattr(socket, name), value)
    return sock


def watched_connector(silent_s: float) -> aiohttp.TCPConnector:
    """An aiohttp connector (no connection limit) whose sockets are `watched_socket`s."""
    factory = functools.partial(watched_socket, silent_s)
    return aiohttp.TCPConnector(limit=0, socket_factory=factory)
