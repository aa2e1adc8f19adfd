"""A sandbox fleet on a simulated cluster (`tests/cluster.py`): three sandbox servers on hosts of
their own, each in its network namespace with its own address, and the client in the test's
process. A host killed while its calls run and a host cut off from the network cost no call;
the cut-off host serves again once its link is back. Traffic goes only to the namespaces'
addresses."""

import asyncio
import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from cluster import Cluster, namespaces, unavailable, wait_healthy

from codeloop.bench.sandbox import fleet
from codeloop.config import SandboxConfig
from codeloop.sandbox.client import SandboxClient
from codeloop.types import ExecRequest, ExecResult, ExecStatus

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return str(response.read().decode())


def _served(url: str) -> int:
    """Calls a server has answered (its /metrics)."""
    found = re.findall(r'^sandbox_calls_total\{status="\w+"\} (\d+)', _get(url + "/metrics"), re.M)
    return sum(map(int, found))


def _in_flight(url: str) -> int:
    found = re.search(r"^sandbox_in_flight (\d+)", _get(url + "/metrics"), re.M)
    return int(found.group(1)) if found else 0


def _printed(results: list[ExecResult]) -> list[str]:
    assert [r.status for r in results] == [ExecStatus.OK] * len(results), [
        r.stderr for r in results if r.status != ExecStatus.OK
    ]
    return [r.stdout for r in results]


def test_a_fleet_loses_no_call_to_a_host_killed_or_cut_off(tmp_path: Path) -> None:
    with Cluster(3) as cluster:
        urls = [f"http://{cluster.address(h)}:8800" for h in (1, 2, 3)]
        for host in (1, 2, 3):
            cluster.start(
                host,
                [
                    sys.executable,
                    "-m",
                    "codeloop",
                    "sandbox",
                    "serve",
                    "--host",
                    cluster.address(host),
                    "--insecure-no-token",
                    "--port",
                    "8800",
                    "--workers",
                    "2",
                ],
                log=tmp_path / f"host{host}.log",
            )
        for url in urls:
            wait_healthy(url)
        cfg = SandboxConfig(urls=urls, client_batch_size=2, client_connect_timeout_s=1.0)

        async def calls(client: SandboxClient, count: int, sleep_s: float) -> list[ExecResult]:
            code = "import time; time.sleep({s}); print({i})"
            return await asyncio.gather(
                *(
                    client.execute(ExecRequest(code=code.format(s=sleep_s, i=i)))
                    for i in range(count)
                )
            )

        async def main() -> float:
            async with SandboxClient(urls, cfg) as client:
                expected = [f"{i}\n" for i in range(12)]
                assert _printed(await calls(client, 12, 0.0)) == expected
                assert all(_served(url) > 0 for url in urls)  # all three served
                # `codeloop bench sandbox --servers`'s load over the same fleet
                soak = (await fleet(urls, 60, 8))["soak"]
                assert (
                    soak["calls"],
                    soak["lost"],
                    soak["mismatched_or_duplicated"],
                    soak["infrastructure_failures"],
                ) == (60, 0, 0, 0)
                assert soak["p50_ms"] <= soak["p99_ms"] <= soak["max_ms"]
                # host 2 dies with calls running on it: they go to the others
                wave = asyncio.ensure_future(calls(client, 12, 0.5))
                while _in_flight(urls[1]) == 0:
                    await asyncio.sleep(0.02)
                cluster.kill(2)
                assert _printed(await wave) == expected
                # host 3 is cut off: nothing answers it, and the calls go to host 1
                cluster.cut(3)
                began = time.monotonic()
                assert _printed(await calls(client, 12, 0.0)) == expected
                cut_off_s = time.monotonic() - began
                cluster.restore(3)
                served = _served(urls[2])
                end = time.monotonic() + 30
                while _served(urls[2]) == served:  # it rejoins after its cool-down
                    assert time.monotonic() < end, "host 3 did not serve again"
                    assert _printed(await calls(client, 4, 0.0)) == expected[:4]
                    await asyncio.sleep(0.2)
            return cut_off_s

        cut_off_s = asyncio.run(main())
        print(f"calls with host 3 cut off: {cut_off_s:.2f} s")
        # a cut-off host costs a connect timeout (1 s) per try, not a call's whole timeout (40 s)
        assert cut_off_s < 10
    assert namespaces(cluster.tag) == set()  # nothing left behind


def test_a_slow_lossy_or_stalled_link_slows_the_fleet_and_loses_no_call(tmp_path: Path) -> None:
    from faultproxy import FaultProxy

    with Cluster(2) as cluster:
        for host in (1, 2):
            cluster.start(
                host,
                [
                    sys.executable,
                    "-m",
                    "codeloop",
                    "sandbox",
                    "serve",
                    "--host",
                    cluster.address(host),
                    "--insecure-no-token",
                    "--port",
                    "8800",
                    "--workers",
                    "2",
                ],
                log=tmp_path / f"host{host}.log",
            )
        direct = [f"http://{cluster.address(h)}:8800" for h in (1, 2)]
        for url in direct:
            wait_healthy(url)

        async def main() -> tuple[int, int, int]:
            # host 2 behind 200 ms of delay, 50 ms of jitter and 5% of its chunks lost
            proxy = FaultProxy(
                cluster.own_address,
                cluster.address(2),
                8800,
                delay_s=0.2,
                jitter_s=0.05,
                loss=0.05,
                seed=1,
            )
            slow = f"http://{await proxy.start()}"
            cfg = SandboxConfig(client_batch_size=2, client_connect_timeout_s=1.0)
            async with SandboxClient([direct[0], slow], cfg) as client:
                code = "print({i})"
                requests = [ExecRequest(code=code.format(i=i)) for i in range(40)]
                assert _printed(await client.execute_batch(requests)) == [
                    f"{i}\n" for i in range(40)
                ]
                through = _served(direct[1])
                proxy.stall()  # the link carries nothing for a second
                stalled = asyncio.ensure_future(client.execute_batch(requests[:8]))
                await asyncio.sleep(1.0)
                proxy.resume()
                assert _printed(await stalled) == [f"{i}\n" for i in range(8)]
            await proxy.close()
            # no call ran twice: the slow link was waited for, not given up on and retried
            assert sum(_served(url) for url in direct) == 40 + 8
            return through, proxy.connections, proxy.lost_chunks

        through, connections, lost = asyncio.run(main())
        assert through > 0 and connections > 0  # host 2 served calls over the bad link
        assert lost > 0  # and the link did lose chunks
