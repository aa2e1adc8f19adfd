"""SandboxClient against scripted fake servers on loopback, and against the real server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web
from fake_http import serve

from codeloop.config import SandboxConfig
from codeloop.sandbox.client import SandboxClient
from codeloop.types import ExecRequest, ExecStatus

FAST = SandboxConfig(client_retries=3, client_flush_ms=5.0, client_batch_size=16)


def _ok(request: dict[str, Any]) -> dict[str, Any]:
    return {"status": "ok", "stdout": f"ran {request['code']}"}


async def _fake(handler: Callable[[web.Request], Any]) -> tuple[web.AppRunner, str]:
    return await serve({("POST", "/v1/execute/batch"): handler})


def test_batches_concurrent_calls_and_keeps_order() -> None:
    posts: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        posts.append(len(body))
        await asyncio.sleep(0.05)
        return web.json_response([_ok(r) for r in body])

    async def main() -> list[str]:
        runner, url = await _fake(handler)
        async with SandboxClient([url], FAST) as client:
            results = await client.execute_batch([ExecRequest(str(i)) for i in range(40)])
        await runner.cleanup()
        return [r.stdout for r in results]

    assert asyncio.run(main()) == [f"ran {i}" for i in range(40)]
    assert sum(posts) == 40 and len(posts) <= 4  # first call alone, then batches of <= 16
    assert max(posts) == 16


def test_retries_infrastructure_faults_then_succeeds() -> None:
    hits = {"n": 0}

    async def flaky(request: web.Request) -> web.Response:
        hits["n"] += 1
        if hits["n"] == 1:
            return web.json_response({"error": "busy"}, status=503, headers={"Retry-After": "0.01"})
        if hits["n"] == 2:
            return web.Response(text="not json", status=200)
        return web.json_response([_ok(r) for r in await request.json()])

    async def main() -> Any:
        runner, url = await _fake(flaky)
        async with SandboxClient([url], FAST) as client:
            result = await client.execute(ExecRequest("x"))
        await runner.cleanup()
        return result

    result = asyncio.run(main())
    assert (result.status, result.stdout, hits["n"]) == (ExecStatus.OK, "ran x", 3)


def test_user_code_failures_and_4xx_are_not_retried() -> None:
    hits = {"n": 0}

    async def handler(request: web.Request) -> web.Response:
        hits["n"] += 1
        body = await request.json()
        if body[0]["code"] == "bad":
            return web.json_response({"error": "request [0]: nope"}, status=400)
        return web.json_response([{"status": "error", "error_type": "ZeroDivisionError"}])

    async def main() -> list[Any]:
        runner, url = await _fake(handler)
        async with SandboxClient([url], FAST) as client:
            a = await client.execute(ExecRequest("1/0"))
            b = await client.execute(ExecRequest("bad"))
        await runner.cleanup()
        return [a, b]

    a, b = asyncio.run(main())
    assert (a.status, a.error_type) == (ExecStatus.ERROR, "ZeroDivisionError")
    assert (b.status, b.stderr) == (ExecStatus.REJECTED, "request [0]: nope")
    assert hits["n"] == 2


def test_every_request_gets_exactly_one_result_when_all_servers_are_down() -> None:
    cfg = SandboxConfig(client_retries=2, client_flush_ms=1.0)

    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500)

    async def main() -> list[Any]:
        runner, url = await _fake(broken)
        dead = "http://127.0.0.1:9"  # discard port: connection refused on loopback
        async with SandboxClient([url, dead], cfg) as client:
            results = await client.execute_batch([ExecRequest(str(i)) for i in range(7)])
        await runner.cleanup()
        return results

    results = asyncio.run(main())
    assert len(results) == 7
    assert {r.status for r in results} == {ExecStatus.SANDBOX_ERROR}
    assert "after 3 attempts" in results[0].stderr


def test_spreads_batches_over_servers_by_outstanding_requests() -> None:
    seen: dict[str, int] = {"a": 0, "b": 0}

    def make(name: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            body = await request.json()
            seen[name] += len(body)
            await asyncio.sleep(0.2)
            return web.json_response([_ok(r) for r in body])

        return handler

    async def main() -> None:
        runner_a, url_a = await _fake(make("a"))
        runner_b, url_b = await _fake(make("b"))
        async with SandboxClient([url_a, url_b], FAST) as client:
            await client.execute_batch([ExecRequest(str(i)) for i in range(64)])
        await runner_a.cleanup()
        await runner_b.cleanup()

    asyncio.run(main())
    assert seen["a"] + seen["b"] == 64
    assert min(seen.values()) >= 16, seen  # both servers carried a real share


def test_one_batch_at_a_time_visits_every_server_in_turn() -> None:
    """With nothing outstanding, servers are equal: the choice rotates rather than falling to
    chance, so a short, quiet run still reaches every server (a fleet's health depends on it)."""
    order: list[str] = []

    def make(name: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            order.append(name)
            return web.json_response([_ok(r) for r in await request.json()])

        return handler

    async def main() -> None:
        fakes = [await _fake(make(name)) for name in "abc"]
        async with SandboxClient([url for _, url in fakes], FAST) as client:
            for i in range(6):
                await client.execute(ExecRequest(str(i)))
        for runner, _ in fakes:
            await runner.cleanup()

    asyncio.run(main())
    assert order == ["a", "b", "c", "a", "b", "c"]


def test_against_the_real_server_every_result_is_its_own() -> None:
    from test_sandbox_server import Server

    srv = Server()
    try:

        async def main() -> list[str]:
            async with SandboxClient([srv.url], SandboxConfig(client_batch_size=32)) as client:
                calls = [client.execute(ExecRequest(f"print({i} ** 2)")) for i in range(300)]
                return [r.stdout for r in await asyncio.gather(*calls)]

        assert asyncio.run(main()) == [f"{i**2}\n" for i in range(300)]
    finally:
        assert srv.stop() == 0


def test_session_calls_stick_to_one_server() -> None:
    from test_sandbox_server import Server

    servers = [Server(), Server()]
    try:

        async def main() -> list[str]:
            urls = [s.url for s in servers]
            async with SandboxClient(urls, SandboxConfig()) as client:
                for i in range(6):
                    await client.execute(ExecRequest(f"v{i} = {i}", session_id=f"t{i}"))
                reads = [
                    client.execute(ExecRequest(f"print(v{i})", session_id=f"t{i}"))
                    for i in range(6)
                ]
                out = [r.stdout for r in await asyncio.gather(*reads)]
                assert all([await client.close_session(f"t{i}") for i in range(6)])
                return out

        assert asyncio.run(main()) == [f"{i}\n" for i in range(6)]
    finally:
        for s in servers:
            assert s.stop() == 0


def test_a_retry_tries_another_server_before_the_same_one_again() -> None:
    """A failing server answers at once, so it has nothing outstanding while the live one is
    busy: picked by load alone it would take every retry of a batch."""
    failing_hits = {"n": 0}

    async def failing(request: web.Request) -> web.Response:
        failing_hits["n"] += 1
        return web.json_response({"error": "broken"}, status=500)

    async def busy(request: web.Request) -> web.Response:
        await asyncio.sleep(0.3)
        return web.json_response([_ok(r) for r in await request.json()])

    async def main() -> list[str]:
        (bad_runner, bad), (good_runner, good) = await _fake(failing), await _fake(busy)
        cfg = SandboxConfig(client_retries=1, client_flush_ms=0.0, client_batch_size=1)
        async with SandboxClient([bad, good], cfg) as client:
            first = asyncio.ensure_future(client.execute(ExecRequest("a")))  # keeps good busy
            await asyncio.sleep(0.05)
            second = await client.execute(ExecRequest("b"))  # bad first (idle), then good
            results = [await first, second]
        await bad_runner.cleanup()
        await good_runner.cleanup()
        return [r.stdout for r in results]

    assert asyncio.run(main()) == ["ran a", "ran b"]
    assert failing_hits["n"] <= 2  # each batch tried it once at most, then the other server
