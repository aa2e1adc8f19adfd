"""`SandboxClient`: the async client of one or more sandbox servers.

Concurrent `execute` calls are gathered into batches, sent when `client_batch_size` calls wait,
`client_flush_ms` after the first, or at once when no batch is in flight; each batch goes to
the server with the fewest requests outstanding (among equals, the one picked least recently, so
that a quiet run still visits every server in turn). Infrastructure faults (connection errors,
429/503, other 5xx, a broken response) are retried with exponential backoff on any server;
user-code failures are results and never retried. Every request gets exactly one result, in
order: after the last retry it gets a `sandbox_error` result, never an exception. A server that
cannot be reached (refused, or silent for `client_connect_timeout_s`: a host down or cut off)
is left out for a cool-down (doubling from 0.5 s to 5 s while it stays down) and rejoins when
it answers again.

The client's sockets give up on a peer silent for `client_connect_timeout_s` (`codeloop.net`:
keep-alive probes and a TCP user timeout), so a host cut off while it runs a call fails that
call over in seconds, not after its whole timeout. A batch whose server died after it was sent
is retried on another server, so it may run twice:
that is safe because a call without a session runs in a fresh process and keeps nothing. A call
with a `session_id` always goes to the same server (a hash of the id), unbatched, and is retried
only when it never reached the server (connection refused, 429, 503): once sent, a failure is a
`sandbox_error`, since running it again would run it in a new session without the state the
earlier calls built (or twice in the old one).
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from collections.abc import Sequence
from typing import Any

import aiohttp

from codeloop.auth import bearer, read_token
from codeloop.config import SandboxConfig
from codeloop.net import watched_connector
from codeloop.types import ExecRequest, ExecResult, ExecStatus

BACKOFF_BASE_S = 0.05
BACKOFF_MAX_S = 2.0
COOL_DOWN_S = (0.5, 5.0)  # a server that cannot be reached is left out this long, doubling
HTTP_SLACK_S = 30.0  # added to the largest per-call timeout of a batch


class _Infra(Exception):
    """A fault of the transport or the server, worth a retry."""

    def __init__(
        self,
        message: str,
        retry_after_s: float | None = None,
        *,
        sent: bool = False,
        unreachable: bool = False,
    ):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.sent = sent  # the server may have run the calls
        self.unreachable = unreachable  # the server is down: leave it out for a while


class SandboxClient:
    """`async with SandboxClient(urls, cfg) as sandbox: await sandbox.execute(request)`."""

    def __init__(
        self,
        urls: Sequence[str],
        cfg: SandboxConfig | None = None,
        transport: aiohttp.BaseConnector | None = None,
    ):
        if not urls:
            raise ValueError("SandboxClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.cfg = cfg or SandboxConfig()
        self.outstanding = dict.fromkeys(self.urls, 0)
        self.down_until = dict.fromkeys(self.urls, 0.0)
        self._cool_down = dict.fromkeys(self.urls, COOL_DOWN_S[0])
        self._last_picked = dict.fromkeys(self.urls, -1)  # the pick count when each was last chosen
        self._picks = 0
        self._connector = transport
        self._session: aiohttp.ClientSession | None = None
        self._buffer: list[tuple[ExecRequest, asyncio.Future[ExecResult]]] = []
        self._flush_handle: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> SandboxClient:
        connector = self._connector or watched_connector(
            self.cfg.client_connect_timeout_s, ca_file=self.cfg.ca_file
        )
        token = read_token(self.cfg.token_file, "sandbox.token_file")
        self._session = aiohttp.ClientSession(connector=connector, headers=bearer(token))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._flush()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def _session_url(self, session_id: str) -> str:
        """A session's calls must all reach the server that holds its state."""
        return self.urls[zlib.crc32(session_id.encode()) % len(self.urls)]

    async def close_session(self, session_id: str) -> bool:
        assert self._session is not None, "use `async with SandboxClient(...)`"
        url = self._session_url(session_id)
        try:
            async with self._session.post(
                f"{url}/v1/sessions/close", json={"session_id": session_id}
            ) as response:
                return bool((await response.json()).get("closed"))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return False

    async def execute(self, request: ExecRequest) -> ExecResult:
        if request.session_id is not None:  # pinned to one server: not batched with others
            return (
                await self._post_with_retries([request], self._session_url(request.session_id))
            )[0]
        future: asyncio.Future[ExecResult] = asyncio.get_running_loop().create_future()
        self._buffer.append((request, future))
        # Nothing in flight means nobody to batch with: send now rather than wait the delay.
        if len(self._buffer) >= self.cfg.client_batch_size or not self._tasks:
            self._flush()
        elif self._flush_handle is None:
            delay_s = self.cfg.client_flush_ms / 1000
            self._flush_handle = asyncio.get_running_loop().call_later(delay_s, self._flush)
        return await future

    async def execute_batch(self, requests: Sequence[ExecRequest]) -> list[ExecResult]:
        return list(await asyncio.gather(*(self.execute(r) for r in requests)))

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        batch, self._buffer = self._buffer, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[ExecRequest, asyncio.Future[ExecResult]]]) -> None:
        requests = [request for request, _ in batch]
        try:
            results = await self._post_with_retries(requests)
        except Exception as err:  # noqa: BLE001 - every caller must get a result, whatever broke
            results = [
                ExecResult(ExecStatus.SANDBOX_ERROR, stderr=f"sandbox client: {err}")
                for _ in requests
            ]
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)

    async def _post_with_retries(
        self, requests: list[ExecRequest], pinned: str | None = None
    ) -> list[ExecResult]:
        attempts = self.cfg.client_retries + 1
        tried: set[str] = set()
        for attempt in range(attempts):
            url = pinned or self._pick(tried)
            tried.add(url)
            self.outstanding[url] += len(requests)
            try:
                results = await self._post(url, requests)
                self.down_until[url], self._cool_down[url] = 0.0, COOL_DOWN_S[0]
                return results
            except _Infra as err:
                now = time.monotonic()
                if err.unreachable and self.down_until[url] <= now:  # not already left out
                    self.down_until[url] = now + self._cool_down[url]
                    self._cool_down[url] = min(COOL_DOWN_S[1], 2 * self._cool_down[url])
                if pinned and err.sent:
                    message = (
                        f"sandbox server failed during a session call ({err}); the call may "
                        "have run, and is not retried: the session's state is lost"
                    )
                    return [ExecResult(ExecStatus.SANDBOX_ERROR, stderr=message) for _ in requests]
                if attempt == attempts - 1:
                    message = f"sandbox unavailable after {attempts} attempts: {err}"
                    return [ExecResult(ExecStatus.SANDBOX_ERROR, stderr=message) for _ in requests]
                backoff = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt)
                await asyncio.sleep(err.retry_after_s or backoff * (0.5 + random.random()))
            finally:
                self.outstanding[url] -= len(requests)
        raise AssertionError("unreachable")

    def _pick(self, tried: set[str]) -> str:
        """The reachable server with the fewest requests outstanding, one this batch has not
        tried yet where there is one (a dead server has nothing outstanding, and would draw every
        retry from the busy live one); among equals, the one picked least recently; the one back
        soonest when none is reachable."""
        now = time.monotonic()
        up = [u for u in self.urls if self.down_until[u] <= now]
        if not up:
            return min(self.urls, key=lambda u: (u in tried, self.down_until[u]))
        untried = [u for u in up if u not in tried] or up
        url = min(untried, key=lambda u: (self.outstanding[u], self._last_picked[u]))
        self._picks += 1
        self._last_picked[url] = self._picks
        return url

    async def _post(self, url: str, requests: list[ExecRequest]) -> list[ExecResult]:
        assert self._session is not None, "use `async with SandboxClient(...)`"
        longest = max((r.timeout_s or self.cfg.timeout_s) for r in requests)
        timeout = aiohttp.ClientTimeout(
            total=longest + HTTP_SLACK_S, sock_connect=self.cfg.client_connect_timeout_s
        )
        body = [r.to_dict() for r in requests]
        try:
            async with self._session.post(
                f"{url}/v1/execute/batch", json=body, timeout=timeout
            ) as response:
                if response.status in (429, 503) or response.status >= 500:
                    retry_after = response.headers.get("Retry-After")
                    raise _Infra(
                        f"{url} answered {response.status}",
                        float(retry_after) if retry_after else None,
                        sent=response.status not in (429, 503),  # refused: nothing ran
                    )
                payload: Any = await response.json()
                if response.status != 200:  # 4xx: our request is wrong; retrying cannot help
                    message = (
                        payload.get("error", str(payload)) if isinstance(payload, dict) else ""
                    )
                    return [ExecResult(ExecStatus.REJECTED, stderr=message) for _ in requests]
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as err:
            # never connected (refused, or no answer within client_connect_timeout_s): nothing
            # was sent
            raise _Infra(f"{url}: {type(err).__name__}: {err}", unreachable=True) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
            lost = isinstance(err, aiohttp.ServerDisconnectedError)
            raise _Infra(
                f"{url}: {type(err).__name__}: {err}", sent=True, unreachable=lost
            ) from None
        if not isinstance(payload, list) or len(payload) != len(requests):
            raise _Infra(
                f"{url} returned {len(payload)} results for {len(requests)} requests", sent=True
            )
        return [ExecResult.from_dict(item) for item in payload]
