"""The sandbox HTTP server: a JSON API in front of a `WorkerPool`.

Endpoints: `POST /v1/execute` (one request object), `POST /v1/execute/batch` (a JSON list of
request objects; results come back as a list in the same order), `POST /v1/sessions/close`
(`{"session_id": ...}`: end a stateful session now), `GET /health`,
`GET /metrics` (Prometheus text). A malformed body or a request outside the server's limits is
a 400 with a message; a body over 64 MiB or a batch of over `MAX_BATCH_CALLS` calls, 413; when
more than `max_queue` calls wait, new calls get 429 with
Retry-After; while shutting down, 503. On SIGTERM/SIGINT the server stops listening, answers
the calls in flight within `sandbox.grace_s`, cancels those still running, closes every
connection and stops its workers (`serving.py`). Built by `build_app`/`serve`: nothing
listens at import.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web

from codeloop.auth import read_body_within, read_token, require_token
from codeloop.config import SandboxConfig
from codeloop.net import server_tls
from codeloop.sandbox.pool import LATENCY_BUCKETS_S, WorkerPool, validate
from codeloop.serving import serve_until_signal
from codeloop.types import ExecRequest, ExecResult

log = logging.getLogger("codeloop.sandbox")
RETRY_AFTER_S = "1"
MAX_BODY_BYTES = 64 << 20
MAX_BATCH_CALLS = 4096  # calls in one batch request (the client sends sandbox.client_batch_size)


class _BadRequest(Exception):
    pass


def _parse(item: Any, where: str) -> ExecRequest:
    try:
        return ExecRequest.from_dict(item)
    except (TypeError, ValueError) as err:
        raise _BadRequest(f"{where}: {err}") from None


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json(loads=json.loads)
    except ValueError as err:
        raise _BadRequest(f"body is not valid JSON: {err}") from None
    except OSError as err:  # the client went away mid-body: nothing to answer, nothing to log
        raise _BadRequest(f"connection lost while reading the body ({err})") from None


def _error(status: int, message: str) -> web.Response:
    headers = {"Retry-After": RETRY_AFTER_S} if status in (429, 503) else None
    return web.json_response({"error": message}, status=status, headers=headers)


class SandboxServer:
    def __init__(self, pool: WorkerPool, cfg: SandboxConfig):
        self.pool = pool
        self.cfg = cfg
        self.isolation: dict[str, Any] = {}
        self.shutting_down = False

    def _refuse(self, count: int) -> web.Response | None:
        if self.shutting_down:
            return _error(503, "the sandbox server is shutting down")
        would_wait = self.pool.in_flight + count - self.pool.capacity
        if would_wait > self.cfg.max_queue and self.pool.in_flight:  # alone, a batch is taken
            return _error(429, f"queue full ({self.pool.queue_depth} calls waiting)")
        return None

    async def execute(self, request: web.Request) -> web.Response:
        try:
            call = _parse(await _json_body(request), "request")
        except _BadRequest as err:
            return _error(400, str(err))
        problem = validate(call, self.cfg)
        if problem is not None:
            return _error(400, f"request: {problem}")
        refusal = self._refuse(1)
        if refusal is not None:
            return refusal
        result = await self.pool.execute(call)
        return web.json_response(result.to_dict())

    async def execute_batch(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            if not isinstance(body, list):
                raise _BadRequest("body must be a JSON list of request objects")
            if len(body) > MAX_BATCH_CALLS:
                return _error(413, f"a batch of {len(body)} calls; at most {MAX_BATCH_CALLS}")
            calls = [_parse(item, f"request [{i}]") for i, item in enumerate(body)]
        except _BadRequest as err:
            return _error(400, str(err))
        refusal = self._refuse(len(calls))
        if refusal is not None:
            return refusal
        # Limits are checked per item: a bad item gets a `rejected` result, the rest still run.
        results: list[ExecResult] = await self.pool.execute_batch(calls)
        return web.json_response([r.to_dict() for r in results])

    async def close_session(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
        except _BadRequest as err:
            return _error(400, str(err))
        if not isinstance(body, dict) or not isinstance(body.get("session_id"), str):
            return _error(400, 'body must be {"session_id": "..."}')
        return web.json_response({"closed": await self.pool.close_session(body["session_id"])})

    async def health(self, request: web.Request) -> web.Response:
        alive = sum(w.alive for w in self.pool.workers)
        body = {
            "ok": alive > 0 and not self.shutting_down,
            "workers": len(self.pool.workers),
            "workers_alive": alive,
            "isolation": self.isolation,
        }
        return web.json_response(body, status=200 if body["ok"] else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=render_metrics(self.pool), content_type="text/plain")


def render_metrics(pool: WorkerPool) -> str:
    m = pool.metrics
    lines = [
        "# TYPE sandbox_in_flight gauge",
        f"sandbox_in_flight {pool.in_flight}",
        "# TYPE sandbox_queue_depth gauge",
        f"sandbox_queue_depth {pool.queue_depth}",
        "# TYPE sandbox_workers_alive gauge",
        f"sandbox_workers_alive {sum(w.alive for w in pool.workers)}",
        "# TYPE sandbox_calls_total counter",
    ]
    lines += [f'sandbox_calls_total{{status="{s}"}} {n}' for s, n in sorted(m.by_status.items())]
    lines.append("# TYPE sandbox_latency_seconds histogram")
    cumulative = 0
    for bound, count in zip([*map(str, LATENCY_BUCKETS_S), "+Inf"], m.buckets, strict=True):
        cumulative += count
        lines.append(f'sandbox_latency_seconds_bucket{{le="{bound}"}} {cumulative}')
    lines += [
        f"sandbox_latency_seconds_sum {m.latency_sum_s:.6f}",
        f"sandbox_latency_seconds_count {cumulative}",
    ]
    return "\n".join(lines) + "\n"


def build_app(server: SandboxServer, token: str | None = None) -> web.Application:
    """The server's routes; with a `token`, all but `/health` ask for it (`codeloop.auth`)."""
    app = web.Application(
        client_max_size=MAX_BODY_BYTES,
        middlewares=[require_token(token), read_body_within(server.cfg.client_timeout_s)],
    )
    app.add_routes(
        [
            web.post("/v1/execute", server.execute),
            web.post("/v1/execute/batch", server.execute_batch),
            web.post("/v1/sessions/close", server.close_session),
            web.get("/health", server.health),
            web.get("/metrics", server.metrics),
        ]
    )
    return app


async def serve(cfg: SandboxConfig, ready: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT, then stop within about `cfg.grace_s` (`serving.py`): calls in
    flight are answered within the grace, those still running then are cancelled."""
    token = read_token(cfg.token_file, "sandbox.token_file")
    tls = server_tls(cfg.tls_cert, cfg.tls_key, "sandbox.tls_cert and sandbox.tls_key")
    pool = WorkerPool(cfg)
    server = SandboxServer(pool, cfg)
    server.isolation = await pool.start()
    app = build_app(server, token)

    def started() -> None:
        log.info(
            "sandbox serving on %s://%s:%d with %d workers%s",
            "https" if tls else "http",
            cfg.host,
            cfg.port,
            len(pool.workers),
            " (a token is required)" if token else "",
        )
        if ready is not None:
            ready.set()

    def stopping() -> None:
        server.shutting_down = True  # a request on a kept-alive connection now gets 503

    try:
        await serve_until_signal(
            app,
            cfg.host,
            cfg.port,
            tls=tls,
            client_timeout_s=cfg.client_timeout_s,
            max_connections=cfg.max_connections,
            grace_s=cfg.grace_s,
            started=started,
            stopping=stopping,
        )
    finally:
        await pool.close()  # the calls cancelled after the grace end with their workers
