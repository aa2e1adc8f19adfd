"""The HTTP server, run as users run it: `codeloop sandbox serve` in a subprocess on loopback."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, *extra: str, port: int | None = None):
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "codeloop",
                "sandbox",
                "serve",
                "--port",
                str(self.port),
                "--workers",
                "1",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.stdout.read()  # type: ignore[union-attr]
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError("server did not start")

    def request(self, path: str, body: bytes | None = None) -> tuple[int, Any, dict[str, str]]:
        req = urllib.request.Request(
            self.url + path,
            data=body,
            method="POST" if body else "GET",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                raw = response.read().decode()
                status, headers = response.status, dict(response.headers)
        except urllib.error.HTTPError as err:
            raw, status, headers = err.read().decode(), err.code, dict(err.headers)
        try:
            return status, json.loads(raw), headers
        except ValueError:
            return status, raw, headers

    def get(self, path: str) -> tuple[int, Any, dict[str, str]]:
        return self.request(path)

    def post(self, path: str, payload: Any) -> tuple[int, Any, dict[str, str]]:
        return self.request(path, json.dumps(payload).encode())

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(60)

    def wait_in_flight(self, calls: int = 1) -> None:
        """Returns once the server runs `calls` calls: a test that needs a call in flight waits
        for it, not for a time chosen on one machine."""
        deadline = time.monotonic() + 300
        while f"sandbox_in_flight {calls}\n" not in self.get("/metrics")[1]:
            assert time.monotonic() < deadline, "the call never started"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("--sandbox.max_queue", "1")
    yield srv
    srv.stop()


def test_health_reports_isolation(server: Server) -> None:
    status, body, _ = server.get("/health")
    assert status == 200 and body["ok"] and body["workers_alive"] == 1
    assert "network_namespace" in body["isolation"]["active"] + list(body["isolation"]["missing"])


def test_execute_one(server: Server) -> None:
    status, body, _ = server.post("/v1/execute", {"code": "print(2 ** 10)"})
    assert status == 200
    assert (body["status"], body["stdout"]) == ("ok", "1024\n")


def test_batch_results_come_back_in_order(server: Server) -> None:
    batch = [
        {"code": f"import time; time.sleep({0.3 - i * 0.1:.1f}); print({i})"} for i in range(3)
    ]
    batch += [{"code": "1/0"}, {"code": "print(1)", "timeout_s": -1}]
    status, body, _ = server.post("/v1/execute/batch", batch)
    assert status == 200
    assert [r["stdout"] for r in body[:3]] == ["0\n", "1\n", "2\n"]
    assert [r["status"] for r in body] == ["ok", "ok", "ok", "error", "rejected"]
    assert "timeout_s must be" in body[4]["stderr"]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/execute", b"{not json", "body is not valid JSON"),
        ("/v1/execute", b'{"code": "1", "cmd": "x"}', "unknown field(s) ['cmd']"),
        ("/v1/execute", b'{"stdin": ""}', "missing field(s) ['code']"),
        ("/v1/execute", b'{"code": "1", "memory_mb": 999999}', "memory_mb must be an integer"),
        ("/v1/execute/batch", b'{"code": "1"}', "body must be a JSON list"),
        ("/v1/execute/batch", b'[{"code": "1"}, {"cod": "1"}]', "request [1]: ExecRequest"),
    ],
)
def test_bad_requests_get_400_with_a_message(
    server: Server, path: str, body: bytes, message: str
) -> None:
    status, payload, _ = server.request(path, body)
    assert status == 400
    assert message in payload["error"]


def test_full_queue_answers_429_with_retry_after(server: Server) -> None:
    # max_queue is 1: with a call running, 200 more at once cannot be queued.
    busy = threading.Thread(
        target=server.post, args=("/v1/execute", {"code": "import time; time.sleep(1.5)"})
    )
    busy.start()
    server.wait_in_flight()
    status, payload, headers = server.post("/v1/execute/batch", [{"code": "1"}] * 200)
    busy.join()
    assert status == 429 and "queue full" in payload["error"]
    assert headers["Retry-After"] == "1"
    assert (
        server.post("/v1/execute", {"code": "print('still fine')"})[1]["stdout"] == "still fine\n"
    )


def test_an_idle_server_takes_a_batch_larger_than_its_queue(server: Server) -> None:
    # Refusing it would refuse it for ever: the client would retry it into a sandbox_error.
    status, payload, _ = server.post(
        "/v1/execute/batch", [{"code": f"print({i})"} for i in range(200)]
    )
    assert status == 200 and [r["stdout"] for r in payload] == [f"{i}\n" for i in range(200)]


def test_a_call_waiting_for_its_turn_is_not_charged_for_the_wait() -> None:
    # One call at a time: 8 calls of 0.4 s with a 0.6 s timeout each wait up to 2.8 s unforked,
    # and none times out, since a timeout starts when its call is forked.
    srv = Server("--sandbox.max_running", "1")
    try:
        calls = [
            {"code": f"import time; time.sleep(0.4); print({i})", "timeout_s": 0.6}
            for i in range(8)
        ]
        start = time.monotonic()
        status, payload, _ = srv.post("/v1/execute/batch", calls)
        elapsed = time.monotonic() - start
        assert status == 200 and [r["status"] for r in payload] == ["ok"] * 8
        assert [r["stdout"] for r in payload] == [f"{i}\n" for i in range(8)]
        assert elapsed > 3.2  # one at a time: the cap held
    finally:
        srv.stop()


def test_a_long_call_does_not_hold_up_the_queue() -> None:
    # A call stops holding its admission slot after 0.5 s: the prints behind a loop that runs
    # to its 5 s timeout are answered long before it.
    srv = Server("--sandbox.max_running", "1")
    try:
        spinner = threading.Thread(
            target=srv.post, args=("/v1/execute", {"code": "while True: pass", "timeout_s": 5})
        )
        spinner.start()
        srv.wait_in_flight()
        start = time.monotonic()
        status, payload, _ = srv.post(
            "/v1/execute/batch", [{"code": f"print({i})"} for i in range(5)]
        )
        elapsed = time.monotonic() - start
        spinner.join()
        assert status == 200 and [r["stdout"] for r in payload] == [f"{i}\n" for i in range(5)]
        assert elapsed < 2.5
    finally:
        srv.stop()


def test_metrics_count_calls_by_status(server: Server) -> None:
    server.post("/v1/execute", {"code": "raise KeyError(1)"})
    server.post("/v1/execute/batch", [{"code": "1", "timeout_s": -1}])  # a rejected item
    status, text, _ = server.get("/metrics")
    assert status == 200
    assert 'sandbox_calls_total{status="error"}' in text
    assert 'sandbox_calls_total{status="rejected"}' in text
    assert 'sandbox_latency_seconds_bucket{le="+Inf"}' in text
    assert "sandbox_in_flight 0" in text and "sandbox_queue_depth 0" in text


def test_graceful_shutdown_answers_calls_in_flight() -> None:
    srv = Server()
    answers: list[Any] = []
    call = threading.Thread(
        target=lambda: answers.append(
            srv.post("/v1/execute", {"code": "import time; time.sleep(1.5); print('finished')"})
        )
    )
    call.start()
    srv.wait_in_flight()
    assert srv.stop() == 0
    call.join(10)
    assert answers and answers[0][0] == 200 and answers[0][1]["stdout"] == "finished\n"
    with pytest.raises(OSError):
        srv.get("/health")


def test_require_isolation_starts_on_a_capable_host() -> None:
    srv = Server("--require-isolation")
    assert srv.get("/health")[1]["isolation"]["missing"] == {}
    assert srv.stop() == 0


def test_sessions_over_http(server: Server) -> None:
    assert server.post("/v1/execute", {"code": "k = 7", "session_id": "h1"})[1]["status"] == "ok"
    assert server.post("/v1/execute", {"code": "k * 6", "session_id": "h1"})[1]["stdout"] == "42\n"
    assert server.post("/v1/sessions/close", {"session_id": "h1"})[1] == {"closed": True}
    after = server.post("/v1/execute", {"code": "k", "session_id": "h1"})[1]
    assert after["error_type"] == "NameError"
    assert server.post("/v1/sessions/close", {"id": 1})[0] == 400


def test_a_server_with_a_token_runs_nothing_for_a_caller_without_it(tmp_path: Path) -> None:
    import asyncio

    from codeloop.config import SandboxConfig
    from codeloop.sandbox.client import SandboxClient
    from codeloop.types import ExecRequest

    secret = tmp_path / "token"
    secret.write_text("s3cret-value\n")
    srv = Server("--token-file", str(secret))

    def call(path: str, payload: Any = None, token: str = "") -> tuple[int, str]:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        body = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(srv.url + path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    try:
        assert call("/v1/execute", {"code": "print(1)"})[0] == 401
        assert call("/v1/execute/batch", [{"code": "print(1)"}], "wrong")[0] == 401
        assert call("/metrics")[0] == 401 and call("/health")[0] == 200
        status, metrics = call("/metrics", token="s3cret-value")
        assert status == 200 and "sandbox_calls_total{" not in metrics  # nothing ran
        status, body = call("/v1/execute", {"code": "print(1)"}, "s3cret-value")
        assert status == 200 and json.loads(body)["stdout"] == "1\n"

        async def through_the_client() -> str:
            cfg = SandboxConfig(token_file=str(secret))
            async with SandboxClient([srv.url], cfg) as client:
                return (await client.execute(ExecRequest("print(2)"))).stdout

        assert asyncio.run(through_the_client()) == "2\n"
        assert 'sandbox_calls_total{status="ok"} 2' in call("/metrics", token="s3cret-value")[1]
    finally:
        srv.stop()
    printed = srv.process.stdout.read()  # type: ignore[union-attr]
    assert "a token is required" in printed and "s3cret-value" not in printed
