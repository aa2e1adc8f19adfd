"""The overload cases of `codeloop bench sandbox` (`--overload`).

- The four-phase load, run several times in a row against one server: 40 sympy calls at 1 in
  flight, 400 at 16, 2,000 `print(1+1)` at 64, then 5,000 `print(1+1)` with a 4 s timeout at 256.
- A soak of `print(i)` calls at 256 in flight while CPU-bound processes (one per core, as a
  training step would) load the machine.

Every result other than `ok` is counted by status, and every call is checked for its own output:
a lost, duplicated or mismatched result is counted apart. A two-line print cannot time out, so
any non-`ok` result here is noise the sandbox made.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from codeloop.sandbox.client import SandboxClient
from codeloop.types import ExecRequest, ExecResult

SYMPY = "import sympy as sp; x=sp.symbols('x'); print(sp.solve(x**2-5*x+6, x))"
PHASES = [  # (name, code, calls, in flight, timeout_s)
    ("sympy x40 @1", SYMPY, 40, 1, 10.0),
    ("sympy x400 @16", SYMPY, 400, 16, 10.0),
    ("print x2000 @64", "print(1+1)", 2000, 64, 10.0),
    ("print x5000 @256 t=4s", "print(1+1)", 5000, 256, 4.0),
]


async def _calls(
    client: SandboxClient, codes: list[str], conc: int, timeout_s: float, *, expected: list[str]
) -> dict[str, Any]:
    """Run every code with at most `conc` in flight; count statuses and wrong outputs."""
    results: list[ExecResult | None] = [None] * len(codes)
    durations = [0.0] * len(codes)  # as the sandbox measured each call
    indices = iter(range(len(codes)))

    async def lane() -> None:
        for i in indices:
            results[i] = result = await client.execute(ExecRequest(codes[i], timeout_s=timeout_s))
            durations[i] = result.duration_s or 0.0

    start = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(conc)))
    seconds = time.perf_counter() - start
    statuses = Counter(str(r.status) for r in results if r is not None)
    wrong = sum(
        1
        for r, out in zip(results, expected, strict=True)
        if r is not None and r.ok and r.stdout != out
    )
    ordered = sorted(durations)
    return {
        "calls": len(codes),
        "seconds": round(seconds, 2),
        "statuses": dict(statuses),
        "call_p50_s": round(ordered[len(ordered) // 2], 3),
        "call_p99_s": round(ordered[int(0.99 * (len(ordered) - 1))], 3),
        "call_max_s": round(ordered[-1], 3),
        "not_ok": len(codes) - statuses.get("ok", 0),
        "lost": sum(r is None for r in results),
        "wrong_output": wrong,
    }


async def four_phases(client: SandboxClient, runs: int) -> list[dict[str, Any]]:
    rows = []
    for run in range(1, runs + 1):
        for name, code, calls, conc, timeout_s in PHASES:
            out = "[2, 3]\n" if code == SYMPY else "2\n"
            row = await _calls(client, [code] * calls, conc, timeout_s, expected=[out] * calls)
            rows.append({"run": run, "phase": name, **row})
            _print(f"run {run} {name}", row)
    return rows


SPIN = "while True: sum(i * i for i in range(10_000))"


@contextmanager
def cpu_load(processes: int) -> Iterator[None]:
    """`processes` CPU-bound processes running for the duration of the block."""
    hogs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(processes)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


async def loaded_soak(client: SandboxClient, calls: int, hogs: int) -> dict[str, Any]:
    codes = [f"print({i})" for i in range(calls)]
    with cpu_load(hogs):
        row = await _calls(client, codes, 256, 4.0, expected=[f"{i}\n" for i in range(calls)])
    row["cpu_bound_processes"] = hogs
    _print(f"soak x{calls} @256 t=4s, {hogs} CPU-bound processes beside", row)
    return row


def _print(name: str, row: dict[str, Any]) -> None:
    bad = {k: v for k, v in row["statuses"].items() if k != "ok"}
    print(
        f"  {name:48} {row['calls'] / row['seconds']:>7.1f} calls/s  not ok {row['not_ok']}"
        f" {bad or ''}  lost {row['lost']}  wrong {row['wrong_output']}  call p50/p99/max "
        f"{row['call_p50_s']}/{row['call_p99_s']}/{row['call_max_s']} s",
        flush=True,
    )
