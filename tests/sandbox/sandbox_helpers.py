"""A real LocalSandbox for the sandbox tests, driven from synchronous test functions."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from codeloop.config import SandboxConfig
from codeloop.sandbox.pool import LocalSandbox
from codeloop.types import ExecRequest, ExecResult

T = TypeVar("T")
SECRET = "codeloop-test-secret-5f2a"


class SyncSandbox:
    """Runs a LocalSandbox on an event loop in a background thread."""

    def __init__(self, cfg: SandboxConfig):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.local = LocalSandbox(cfg)
        self.run(self.local.__aenter__())

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def execute(self, code: str, **kwargs: Any) -> ExecResult:
        return self.run(self.local.execute(ExecRequest(code, **kwargs)))

    def batch(self, requests: list[ExecRequest]) -> list[ExecResult]:
        return self.run(self.local.execute_batch(requests))

    def close(self) -> None:
        self.run(self.local.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def sandbox() -> Iterator[SyncSandbox]:
    # A secret in the environment of the process that starts the sandbox: it must not leak.
    import os

    os.environ["CODELOOP_TEST_SECRET"] = SECRET
    box = SyncSandbox(SandboxConfig(workers=2, timeout_s=5.0, memory_mb=512))
    missing = box.local.isolation["missing"]
    if missing:
        box.close()
        pytest.skip(f"this host cannot isolate the sandbox: {missing}")
    yield box
    box.close()


def assert_healthy(box: SyncSandbox) -> None:
    """After an attack, the sandbox still answers a plain call correctly."""
    result = box.execute("print(6 * 7)")
    assert (result.status, result.stdout) == ("ok", "42\n"), result
