"""Test-suite wiring: `gpu` tests are skipped unless CUDA is available; a `codeloop serve`
subprocess for the tests that talk to a server; a self-signed certificate for TLS tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from certs import self_signed


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, each worker's torch (and every process it starts) computes on its share of
    the cores instead of on all of them: with two threads where one core was free, the demo's
    seed test took 17% more CPU (40.9 s against 35.1 s; OpenMP threads waiting for one
    another). An OMP_NUM_THREADS already set is kept."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _slow_files_first(items)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected: importing torch costs seconds

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in gpu_items:
        item.add_marker(skip)


def _slow_files_first(items: list[pytest.Item]) -> None:
    """The files that hold `slow` tests (minutes each) run before the others, each file's tests
    together and in their order: `make test` hands whole files to two workers in this order
    (`--dist loadfile --no-loadscope-reorder`), so the many quick files fill in around the long
    ones instead of one worker finishing a long file alone at the end."""
    slow = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order within each group


class ServedURL(str):
    """A served model's URL; `process` is its `codeloop serve` (a test may kill it)."""

    process: subprocess.Popen[bytes]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(server: subprocess.Popen[bytes], options: tuple[str, ...], port: int) -> str:
    """The URL of a server started with `options` on `port` (https:// with `--tls-cert`, its
    certificate then trusted), once its /health answers; fails if the process ends first."""
    tls = "--tls-cert" in options
    cert = options[options.index("--tls-cert") + 1] if tls else None
    context = ssl.create_default_context(cafile=cert) if tls else None
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # importing torch on a busy core: about a hang, not speed
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=10, context=context)
            return url
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "did not start"
            time.sleep(0.2)


BIND_TRIES = 5  # free ports chosen for a server before giving up


def _start_serving(
    command: list[str], options: tuple[str, ...], said: Any, port: int = 0
) -> tuple[subprocess.Popen[bytes], str, int]:
    """`command --port PORT OPTIONS` started (its stderr to the file `said`) and healthy: the
    process, its URL and where its part of `said` begins. PORT 0: a free port of loopback,
    chosen again when another process took it between `_free_port` and the server's bind."""
    for attempt in range(1 if port else BIND_TRIES):
        chosen = port or _free_port()
        begins = said.tell()
        server = subprocess.Popen([*command, "--port", str(chosen), *options], stderr=said)
        try:
            return server, _wait_healthy(server, options, chosen), begins
        except AssertionError:
            if server.poll() is None:  # alive past the deadline
                server.kill()
                server.wait(60)
            said.seek(begins)
            taken = b"address already in use" in said.read()
            if not taken or attempt == BIND_TRIES - 1 or port:
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _codeloop_serve(model: Path, *options: str, port: int = 0) -> Iterator[ServedURL]:
    """`codeloop serve --model MODEL OPTIONS` on `port` (0: a free one); yields its URL once
    healthy. Its stderr goes to this test's."""
    command = [sys.executable, "-m", "codeloop", "serve", "--model", str(model)]
    with tempfile.TemporaryFile() as said:  # not a pipe: a server that logs much never blocks
        try:
            server, found, _ = _start_serving(command, options, said, port)
            try:
                url = ServedURL(found)
                url.process = server
                yield url
            finally:
                server.terminate()  # it stops within its grace (5 s) whatever its clients do
                server.wait(60)
        finally:
            said.seek(0)
            sys.stderr.write(said.read().decode(errors="replace"))


@contextlib.contextmanager
def _openenv_serve(command: list[str], *options: str) -> Iterator[ServedURL]:
    """An OpenEnv server (`command --port PORT OPTIONS`) on a free port of loopback; yields its
    URL once /health answers (`process`: the server, which a test may kill)."""
    with tempfile.TemporaryFile() as said:
        try:
            server, found, _ = _start_serving(command, options, said)
            try:
                url = ServedURL(found)
                url.process = server
                yield url
            finally:
                server.kill()
                server.wait(60)
        finally:
            said.seek(0)
            sys.stderr.write(said.read().decode(errors="replace"))


@contextlib.contextmanager
def _sandbox_serve(*options: str) -> Iterator[str]:
    """`codeloop sandbox serve --workers 1 OPTIONS` on a free port of loopback; yields its URL
    (https:// with `--tls-cert`) once healthy; its log has no traceback at the end."""
    command = [sys.executable, "-m", "codeloop", "sandbox", "serve", "--workers", "1"]
    with tempfile.TemporaryFile() as said:  # not a pipe: a server that logs much never blocks
        server, url, begins = _start_serving(command, options, said)
        try:
            yield url
        finally:
            server.terminate()
            server.wait(60)
        said.seek(begins)
        log = said.read().decode()
    assert "Traceback" not in log, log


@pytest.fixture(scope="session")
def sandbox_serve() -> Callable[..., Any]:
    """A context manager factory: `with sandbox_serve(*options) as url: ...`."""
    return _sandbox_serve


@pytest.fixture(scope="session")
def tls_certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(certificate, key): self-signed for 127.0.0.1, made with the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    return self_signed(tmp_path_factory.mktemp("tls"), ["127.0.0.1"])


@pytest.fixture(scope="session")
def openenv_serve() -> Callable[..., Any]:
    """A context manager factory: `with openenv_serve(command, *options) as url: ...`."""
    return _openenv_serve


@pytest.fixture(scope="session")
def codeloop_serve() -> Callable[..., Any]:
    """A context manager factory: `with codeloop_serve(model_dir, *options) as url: ...`."""
    return _codeloop_serve
