"""The test servers' port: one taken between `_free_port` and the server's bind (another
process of the suite bound it first) is chosen again, not a failed test."""

import socket
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.mark.slow
def test_a_server_whose_port_was_taken_starts_on_another(
    monkeypatch: pytest.MonkeyPatch, sandbox_serve: Callable[..., Any]
) -> None:
    fixtures = sandbox_serve.__wrapped__.__globals__  # the top conftest's: others share its name
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports: Iterator[int] = iter([port, fixtures["_free_port"]()])
        monkeypatch.setitem(fixtures, "_free_port", lambda: next(ports))
        with sandbox_serve() as url:
            assert not url.endswith(f":{port}")
            assert urllib.request.urlopen(url + "/health", timeout=10).status == 200
