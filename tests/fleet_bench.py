"""The sandbox fleet's load test on a simulated cluster (as root; `tests/cluster.py`).

    python tests/fleet_bench.py [--calls 3000] [--concurrency 64]

Three hosts each run `codeloop sandbox serve`; `codeloop bench sandbox --servers ...` drives
them from the test's own namespace three times: all hosts well; host 3 behind a fault proxy
(200 ms delay, 50 ms jitter, 5% of chunks held a retransmission timeout); host 3 cut off 2 s
into the run and restored 8 s later. Prints one line per run (calls/s, p50/p99/max latency,
lost, duplicated or mismatched, infrastructure failures) and writes the reports beside.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from cluster import Cluster, unavailable, wait_healthy
from faultproxy import FaultProxy


async def _bench(urls: list[str], calls: int, concurrency: int, out: Path) -> dict[str, object]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "codeloop",
        "bench",
        "sandbox",
        "--servers",
        *urls,
        "--soak",
        str(calls),
        "--concurrency",
        str(concurrency),
        "--out",
        str(out),
        stdout=asyncio.subprocess.DEVNULL,
    )
    await process.wait()
    soak: dict[str, object] = json.loads(out.read_text())["soak"]
    return soak


async def main(calls: int, concurrency: int, out_dir: Path) -> None:
    with Cluster(3) as cluster:
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
                ],
            )
        urls = [f"http://{cluster.address(h)}:8800" for h in (1, 2, 3)]
        for url in urls:
            wait_healthy(url)
        rows = {"all hosts well": await _bench(urls, calls, concurrency, out_dir / "well.json")}
        proxy = FaultProxy(
            cluster.own_address,
            cluster.address(3),
            8800,
            delay_s=0.2,
            jitter_s=0.05,
            loss=0.05,
            seed=1,
        )
        slow = urls[:2] + [f"http://{await proxy.start()}"]
        rows["host 3 slow (200 ms, 5% held)"] = await _bench(
            slow, calls, concurrency, out_dir / "slow.json"
        )
        await proxy.close()

        async def cut_then_restore() -> None:
            await asyncio.sleep(2)
            cluster.cut(3)
            await asyncio.sleep(8)
            cluster.restore(3)

        faults = asyncio.ensure_future(cut_then_restore())
        rows["host 3 cut at 2 s for 8 s"] = await _bench(
            urls, calls, concurrency, out_dir / "cut.json"
        )
        await faults
    print(
        f"{'run':32} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'lost':>5} {'wrong':>6} {'infra':>6}"
    )
    for name, row in rows.items():
        print(
            f"{name:32} {row['calls_per_s']:>8} {row['p50_ms']:>8} {row['p99_ms']:>8} "
            f"{row['max_ms']:>8} {row['lost']:>5} {row['mismatched_or_duplicated']:>6} "
            f"{row['infrastructure_failures']:>6}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--out", default="", help="where the reports go (default: a temp dir)")
    options = parser.parse_args()
    if reason := unavailable():
        sys.exit(f"fleet_bench: {reason}")
    folder = Path(options.out or tempfile.mkdtemp(prefix="fleet-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    asyncio.run(main(options.calls, options.concurrency, folder))
