"""TCP connections that notice a silent peer (`watched_socket`, `watched_connector`), and the
TLS contexts of servers and clients (`server_tls`, `client_tls`).

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
import ssl
from typing import Any

import aiohttp

from codeloop.errors import InputFileError


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


def watched_connector(silent_s: float, *, ca_file: str = "") -> aiohttp.TCPConnector:
    """An aiohttp connector (no connection limit) whose sockets are `watched_socket`s, checking
    `https://` servers' certificates against the system's CAs and `ca_file` (`client_tls`)."""
    factory = functools.partial(watched_socket, silent_s)
    return aiohttp.TCPConnector(limit=0, socket_factory=factory, ssl=client_tls(ca_file))


def client_tls(ca_file: str = "") -> ssl.SSLContext:
    """What a client checks an `https://` server's certificate against: the system's CAs, and
    the certificates in `ca_file` when given (a private CA, or a server's self-signed
    certificate). Hostnames are checked."""
    context = ssl.create_default_context()
    if ca_file:
        try:
            context.load_verify_locations(cafile=ca_file)
        except (OSError, ssl.SSLError) as err:
            raise InputFileError(f"{ca_file}: not a readable CA file ({err})") from None
    return context


def server_tls(cert_file: str, key_file: str, what: str) -> ssl.SSLContext | None:
    """The TLS context of a server started with a certificate and its key (none: plain HTTP);
    `what` names the flags in errors."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise InputFileError(f"{what}: give both a certificate and its key, or neither")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as err:
        raise InputFileError(f"{what}: cannot use {cert_file} with {key_file} ({err})") from None
    return context
