"""Both servers stop when told, whatever their clients do: on SIGTERM a `codeloop sandbox serve`
and a `codeloop serve`, each holding connections in every state (idle, in its headers, in its
body, waiting on a long tool call or completion), answer what finishes within the grace,
cancel the rest, and exit 0 long before any held connection would have let them.

The bounds are about hangs, not speed: the held connections and the long work would keep a
server up for minutes (client limit 300 s, a 200 s tool call, a 60,000-token completion), and
the test allows the grace + 30 s."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from codeloop.engine.model import end_of_turn_ids, tiny_model

HOLD_S = 300  # --client-timeout: a connection that says nothing may stay this long


def _held(port: int, path: str, body: bytes) -> dict[str, socket.socket]:
    """Connections to `port` in each state a request can be in before its answer."""

    def connect(sent: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        if sent:
            sock.sendall(sent)
        return sock

    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return {
        "idle": connect(b""),
        "in headers": connect(head.encode()),
        "in body": connect(f"{head}Content-Length: 1000\r\n\r\n".encode() + b'{"code": '),
        "long work": connect(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body),
    }


def _wait_for(url: str, line: str, server: subprocess.Popen[bytes]) -> None:
    """Until `url` (a /metrics page) holds `line`; fails if the server ends first."""
    deadline = time.monotonic() + 120
    while line not in urllib.request.urlopen(url, timeout=30).read().decode():
        assert server.poll() is None and time.monotonic() < deadline, f"never saw {line!r}"
        time.sleep(0.1)


def _stop(server: subprocess.Popen[bytes], grace_s: float) -> float:
    """SIGTERM `server`; the seconds until it exited, which must be with status 0."""
    sent = time.monotonic()
    server.send_signal(signal.SIGTERM)
    try:
        code = server.wait(grace_s + 30)
    except subprocess.TimeoutExpired:
        server.kill()
        pytest.fail(f"still running {grace_s + 30:g} s after SIGTERM")
    assert code == 0
    return time.monotonic() - sent


def _closed(sock: socket.socket) -> bytes:
    """What the server sent on `sock` before closing it (it must close it)."""
    sock.settimeout(30)
    said = b""
    while chunk := sock.recv(65536):
        said += chunk
    return said


def _start(command: list[str], port: int) -> subprocess.Popen[bytes]:
    server = subprocess.Popen(command)
    deadline = time.monotonic() + 300  # importing torch on a busy core takes a while
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return server
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "did not start"
            time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_the_sandbox_server_answers_within_the_grace_and_cuts_the_rest() -> None:
    port, grace_s = _free_port(), 10.0
    command = [sys.executable, "-m", "codeloop", "sandbox", "serve", "--port", str(port)]
    options = ["--workers", "1", "--client-timeout", str(HOLD_S), "--grace", str(grace_s)]
    server = _start([*command, *options, "--sandbox.max_timeout_s", "300"], port)
    try:
        long_call = json.dumps({"code": "import time; time.sleep(200)", "timeout_s": 250})
        held = _held(port, "/v1/execute", long_call.encode())
        short = _held(port, "/v1/execute", b'{"code": "import time; time.sleep(3); print(7)"}')
        _wait_for(f"http://127.0.0.1:{port}/metrics", "sandbox_in_flight 2", server)
        _stop(server, grace_s)
    finally:
        if server.poll() is None:
            server.kill()
    answered = _closed(short["long work"]).decode()
    assert answered.startswith("HTTP/1.1 200") and '"stdout": "7\\n"' in answered
    assert _closed(held["long work"]) == b""  # cancelled: no answer, the connection closed
    for state in ("idle", "in headers", "in body"):
        assert _closed(held[state]) == b"", state


@pytest.mark.slow
def test_the_inference_server_cancels_a_long_completion_and_exits(tmp_path: Path) -> None:
    from codeloop.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(["1 + 1 = 2, print(x)"] * 20, vocab_size=300)
    model = tiny_model(len(tokenizer), hidden_size=16, layers=1, heads=2, max_positions=70000)
    with torch.no_grad():  # logits far apart, the turn's ends far below: it never stops early
        model.lm_head.weight.mul_(1000)
        model.lm_head.weight[sorted(end_of_turn_ids(tokenizer))] = 0
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    port, grace_s = _free_port(), 3.0
    command = [sys.executable, "-m", "codeloop", "serve", "--model", str(tmp_path)]
    options = ["--port", str(port), "--client-timeout", str(HOLD_S), "--grace", str(grace_s)]
    server = _start([*command, *options], port)
    try:
        long_completion = json.dumps({"prompt": [1, 2, 3], "max_tokens": 60000})
        held = _held(port, "/v1/completions", long_completion.encode())
        _wait_for(f"http://127.0.0.1:{port}/metrics", "requests_running 1\n", server)
        _stop(server, grace_s)
    finally:
        if server.poll() is None:
            server.kill()
    for state, sock in held.items():
        assert not _closed(sock).startswith(b"HTTP/1.1 200"), state
