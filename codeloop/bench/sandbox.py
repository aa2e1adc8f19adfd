"""`codeloop bench sandbox`: the sandbox through its HTTP server against fresh interpreters.

Workloads: w1 `print(1+1)`; w2 a small sympy solve; w3 an infinite loop (must time out); w4 a
memory bomb (must hit the memory limit); w5 1 MB of output (capped and marked truncated). Each
runs at several concurrencies through a `codeloop sandbox serve` subprocess on 127.0.0.1 and the
`SandboxClient`, and, in the same run, as a fresh `python3 -c` subprocess per call (the
baseline, with the same imports for w2). A soak phase then sends `--soak` calls of w1 at
concurrency 256, each printing its own index, and counts lost, duplicated, mismatched and
infrastructure-failed results. Prints a table with ratios to the baseline and writes JSON.
`--overload` adds the cases of `overload.py`: the four-phase load several times in a row, and a
soak with every core also loaded by a CPU-bound process; non-`ok` results are counted by status.
`--servers URL ...` drives an existing fleet instead (no server started, no baseline): the soak
alone, through the client over those servers, with its calls/s and latency percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from codeloop.bench import overload
from codeloop.config import SandboxConfig
from codeloop.helpformat import HelpFormatter, positive_count
from codeloop.sandbox.client import SandboxClient
from codeloop.types import ExecRequest, ExecResult, ExecStatus

W2 = "import sympy as sp; x=sp.symbols('x'); print(sp.solve(x**2-5*x+6, x))"
WORKLOADS: dict[str, tuple[str, ExecStatus]] = {
    "w1": ("print(1+1)", ExecStatus.OK),
    "w2": (W2, ExecStatus.OK),
    "w3": ("while True: pass", ExecStatus.TIMEOUT),
    "w4": ("a = ' ' * (10**10)", ExecStatus.MEMORY),
    "w5": ("print('x' * 10**6)", ExecStatus.OK),
}
W3_TIMEOUT_S = 1.0
COOL_DOWN_S = 2.0
BASELINE_IMPORTS = "import numpy, sympy, scipy\n"  # what a warm worker has; w2 needs it


@dataclass
class Cell:
    workload: str
    concurrency: int
    calls: int
    seconds: float
    calls_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    failures: dict[str, int] = field(default_factory=dict)


def _summarise(
    name: str,
    conc: int,
    latencies: list[float],
    statuses: list[str],
    *,
    seconds: float,
    expected: ExecStatus,
) -> Cell:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    failures = Counter(s for s in statuses if s != str(expected))
    return Cell(
        name,
        conc,
        len(latencies),
        round(seconds, 3),
        round(len(latencies) / seconds, 1),
        round(statistics.median(ordered) * 1e3, 2),
        round(p99 * 1e3, 2),
        round(ordered[-1] * 1e3, 2),
        dict(failures),
    )


async def _drive(n: int, conc: int, call: Any) -> tuple[list[float], list[Any], float]:
    """Run `call(i)` n times with at most `conc` at once; return latencies, results, seconds."""
    latencies: list[float] = [0.0] * n
    results: list[Any] = [None] * n
    next_index = iter(range(n))

    async def lane() -> None:
        for i in next_index:
            t0 = time.perf_counter()
            results[i] = await call(i)
            latencies[i] = time.perf_counter() - t0

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(conc)))
    return latencies, results, time.perf_counter() - t0


def _request(name: str, code: str) -> ExecRequest:
    return ExecRequest(code, timeout_s=W3_TIMEOUT_S if name == "w3" else 10.0, memory_mb=512)


async def _sandbox_cell(client: SandboxClient, name: str, conc: int, n: int) -> Cell:
    code, expected = WORKLOADS[name]
    request = _request(name, code)

    async def call(i: int) -> ExecResult:
        return await client.execute(request)

    latencies, results, seconds = await _drive(n, conc, call)
    return _summarise(
        name, conc, latencies, [str(r.status) for r in results], seconds=seconds, expected=expected
    )


async def _baseline_cell(name: str, conc: int, n: int) -> Cell:
    code, expected = WORKLOADS[name]
    source = BASELINE_IMPORTS + code if name == "w2" else code
    timeout_s = _request(name, code).timeout_s or 10.0

    async def call(i: int) -> str:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            source,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=lambda: _limit_memory(512),
        )
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout_s)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
            return "timeout"
        if process.returncode == 0:
            return "ok"
        return "memory" if b"MemoryError" in err else "error"

    latencies, statuses, seconds = await _drive(n, conc, call)
    return _summarise(name, conc, latencies, statuses, seconds=seconds, expected=expected)


def _limit_memory(memory_mb: int) -> None:
    import resource

    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit + (1 << 30), limit + (1 << 30)))


async def _soak(client: SandboxClient, n: int, conc: int) -> dict[str, Any]:
    async def call(i: int) -> ExecResult:
        return await client.execute(ExecRequest(f"print({i})", timeout_s=10.0))

    latencies, results, seconds = await _drive(n, conc, call)
    statuses = Counter(str(r.status) for r in results)
    mismatched = sum(1 for i, r in enumerate(results) if r.ok and r.stdout != f"{i}\n")
    ordered = sorted(latencies)
    return {
        "calls": n,
        "concurrency": conc,
        "seconds": round(seconds, 2),
        "calls_per_s": round(n / seconds, 1),
        "p50_ms": round(statistics.median(ordered) * 1e3, 1),
        "p99_ms": round(ordered[min(n - 1, int(0.99 * n))] * 1e3, 1),
        "max_ms": round(ordered[-1] * 1e3, 1),
        "statuses": dict(statuses),
        "lost": sum(r is None for r in results),
        "mismatched_or_duplicated": mismatched,
        "infrastructure_failures": statuses.get("sandbox_error", 0),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_healthy(client_url: str, process: subprocess.Popen[bytes]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            if process.poll() is not None:
                raise RuntimeError("the sandbox server exited during start-up")
            try:
                async with session.get(f"{client_url}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("the sandbox server did not become healthy in 60 s")


PLAN = {  # workload -> [(concurrency, sandbox calls, baseline calls)]
    "w1": [(1, 200, 20), (16, 1000, 48), (64, 2000, 64), (256, 2000, 256)],
    "w2": [(1, 100, 8), (16, 600, 32), (256, 1000, 32)],
    "w3": [(1, 3, 2), (16, 32, 16), (256, 256, 32)],
    "w4": [(1, 20, 4), (16, 64, 16), (256, 256, 32)],
    "w5": [(1, 50, 8), (16, 200, 32), (256, 512, 64)],
}


async def fleet(urls: list[str], calls: int, concurrency: int) -> dict[str, Any]:
    """The soak over servers that already run (`--servers`)."""
    async with SandboxClient(urls, SandboxConfig(urls=urls)) as client:
        return {"servers": urls, "soak": await _soak(client, calls, concurrency)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.servers:
        driven = await fleet(args.servers, args.soak, args.concurrency)
        print("fleet soak:", json.dumps(driven["soak"]), flush=True)
        return driven
    cfg = SandboxConfig(port=_free_port(), workers=args.workers)
    url = f"http://127.0.0.1:{cfg.port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "codeloop",
            "sandbox",
            "serve",
            "--port",
            str(cfg.port),
            "--workers",
            str(args.workers),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count()}, "cells": [], "baseline": []}
    try:
        await _wait_healthy(url, server)
        async with SandboxClient([url], cfg) as client:
            for name, cells in PLAN.items():
                if args.only is not None and name not in args.only:  # `--only` alone: none
                    continue
                for conc, n, n_base in cells:
                    scale = max(1, int(n * args.scale))
                    await asyncio.sleep(COOL_DOWN_S)  # let the previous cell's processes go
                    ours = await _sandbox_cell(client, name, conc, scale)
                    base = await _baseline_cell(name, min(conc, n_base), max(1, n_base))
                    report["cells"].append(asdict(ours))
                    report["baseline"].append(asdict(base))
                    _print_row(ours, base)
            if args.soak:
                report["soak"] = await _soak(client, args.soak, args.concurrency)
                print("soak:", json.dumps(report["soak"]))
            if args.overload:
                print(f"overload ({args.workers} workers):")
                report["overload"] = {
                    "four_phases": await overload.four_phases(client, args.overload_runs),
                    "loaded_soak": await overload.loaded_soak(
                        client, args.overload_soak, args.hogs or os.cpu_count() or 1
                    ),
                }
    finally:
        server.terminate()
        server.wait(30)
    return report


def _print_row(ours: Cell, base: Cell) -> None:
    if ours.workload == "w1" and ours.concurrency == 1:
        head = f"{'work':4} {'conc':>4} {'calls':>6} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        print(head + f"{'failures':>18} | {'base/s':>7} {'base p50':>8} {'speed-up':>8} ratio-p50")
    speedup = ours.calls_per_s / base.calls_per_s if base.calls_per_s else float("inf")
    ratio = base.p50_ms / ours.p50_ms if ours.p50_ms else float("inf")
    failures = ",".join(f"{k}:{v}" for k, v in ours.failures.items()) or "-"
    print(
        f"{ours.workload:4} {ours.concurrency:>4} {ours.calls:>6} {ours.calls_per_s:>8} "
        f"{ours.p50_ms:>8} {ours.p99_ms:>8} {failures:>18} | {base.calls_per_s:>7} "
        f"{base.p50_ms:>8} {speedup:>7.1f}x {ratio:>8.1f}x",
        flush=True,
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="codeloop bench sandbox",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--workers",
        type=positive_count,
        default=os.cpu_count() or 1,
        help="the server's warm workers",
    )
    parser.add_argument(
        "--only",
        nargs="*",
        choices=sorted(WORKLOADS),
        help="workloads to run; none when given alone (e.g. with --overload)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiply sandbox call counts")
    parser.add_argument("--soak", type=positive_count, default=20000, help="soak calls")
    parser.add_argument(
        "--servers",
        nargs="+",
        default=[],
        metavar="URL",
        help="drive these running servers with the soak alone (a fleet)",
    )
    parser.add_argument(
        "--concurrency", type=positive_count, default=256, help="the soak's calls in flight"
    )
    parser.add_argument(
        "--overload",
        action="store_true",
        help="add the four-phase load and the soak beside CPU-bound processes",
    )
    parser.add_argument(
        "--overload-runs", type=positive_count, default=5, help="four-phase runs in a row"
    )
    parser.add_argument(
        "--overload-soak", type=positive_count, default=20000, help="calls of the loaded soak"
    )
    parser.add_argument("--hogs", type=int, default=0, help="CPU-bound processes; 0 = one per core")
    parser.add_argument("--out", default="bench-results/sandbox.json", help="JSON report")
    args = parser.parse_args(argv)
    report = asyncio.run(run(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    soak = report.get("soak", {})
    bad = soak.get("lost", 0) + soak.get("mismatched_or_duplicated", 0)
    overloaded = report.get("overload", {})
    rows = [
        *overloaded.get("four_phases", []),
        *([overloaded["loaded_soak"]] if overloaded else []),
    ]
    bad += sum(r["not_ok"] + r["lost"] + r["wrong_output"] for r in rows)
    return 1 if bad or soak.get("infrastructure_failures", 0) else 0
