"""Test-suite wiring: `gpu` tests are skipped unless CUDA is available; a `codeloop serve`
subprocess for the tests that talk to a server."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected: importing torch costs seconds

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in gpu_items:
        item.add_marker(skip)


class ServedURL(str):
    """A served model's URL; `process` is its `codeloop serve` (a test may kill it)."""

    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def _codeloop_serve(model: Path, *options: str, port: int = 0) -> Iterator[ServedURL]:
    """`codeloop serve --model MODEL OPTIONS` on `port` (0: a free one); yields its URL once
    healthy."""
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "codeloop",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        *options,
    ]
    server = subprocess.Popen(command)
    url = ServedURL(f"http://127.0.0.1:{port}")
    url.process = server
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (
                    "codeloop serve did not start"
                )
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture(scope="session")
def codeloop_serve() -> Callable[..., Any]:
    """A context manager factory: `with codeloop_serve(model_dir, *options) as url: ...`."""
    return _codeloop_serve
