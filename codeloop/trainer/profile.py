"""One RL step under torch.profiler (`trainer.profile_step`): how much of it the GPU computes.

A step's wall time is the GPU's kernels plus the time the GPU waits: for the host to launch the
next kernel (a decoding step driven from Python), for tools and the reward, for the engine's
next batch. With the CUDA timeline recorded (no CPU ops, so the profiler adds little to the
host's work), the kernels' summed time over the step's wall time is the share the GPU computed;
the rest is the host-side waiting. The table of the kernels that took the most time goes to
`profile_step_NNNNNN.txt` in the run directory. On a CPU the table lists the CPU ops and no
share is logged.

The figures are read from the profiler's raw events (`op_times`), not from torch's own tables
(`key_averages()`), which build Python objects per event: for a profile of a million events
on a 2-core Xeon, 51-72 s and 4.9 GB at peak, against 3.5 s for one pass over its raw events. An
RL step records millions of CPU ops on a CPU, and of the order of a million kernels on a GPU (a
few hundred a decoding step). torch's profiler backend (kineto) prints two lines
to stderr for each profile: `profiler` keeps them off the console.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROWS = 30  # of the table
KINETO_QUIET = "6"  # a kineto log level above its USDT lines' (5): it prints nothing


def profiler(device: torch.device) -> Any:
    """A torch profiler, not started, of the GPU's timeline on CUDA (no CPU ops, so it adds
    little to the host's work), else of the CPU ops; kineto's lines (`USDT: ...
    profiler_start`, `... profiler_stop`) kept off the console unless KINETO_LOG_LEVEL is set
    (kineto reads it when the process's first profile starts)."""
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
    cuda = device.type == "cuda"
    return profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])


@dataclass
class OpTime:
    """One op name's calls and summed time in a profile."""

    name: str
    calls: int
    seconds: float
    first_ns: int = field(default=0, compare=False)  # the earliest start of a call
    last_ns: int = field(default=0, compare=False)  # the latest end of one


def op_times(events: Iterable[Any], device: bool) -> list[OpTime]:
    """The time of each op name in a stopped profile's raw events (`raw_events`), most first:
    with `device`, the device's own events (kernels, copies; not the spans a user named, which
    cover kernels), which never nest; else the CPU ops, each timed with the ops it calls."""
    from torch.profiler import DeviceType

    totals: dict[str, OpTime] = {}
    for event in events:
        if (event.device_type() != DeviceType.CPU) != device or event.is_user_annotation():
            continue
        start, end = event.start_ns(), event.end_ns()
        op = totals.get(event.name())
        if op is None:
            totals[event.name()] = OpTime(event.name(), 1, (end - start) / 1e9, start, end)
        else:
            op.calls, op.seconds = op.calls + 1, op.seconds + (end - start) / 1e9
            op.first_ns, op.last_ns = min(op.first_ns, start), max(op.last_ns, end)
    return sorted(totals.values(), key=lambda op: -op.seconds)


def device_span(times: list[OpTime]) -> float:
    """Seconds from the first call's start to the last one's end among `times` (0 without any).
    The profiler keeps a bounded buffer of device records and stops recording when it is full:
    a span of the device's ops well short of the profiled wall time says their total misses
    the rest."""
    if not times:
        return 0.0
    return (max(op.last_ns for op in times) - min(op.first_ns for op in times)) / 1e9


def raw_events(profiler: Any) -> list[Any]:
    """A stopped `torch.profiler.profile`'s raw (kineto) events."""
    return list(profiler.profiler.kineto_results.events())


def device_seconds(times: list[OpTime]) -> float:
    """The device's busy time: the summed time of `op_times(..., device=True)`."""
    return sum(op.seconds for op in times)


def op_table(times: list[OpTime], wall: float, rows: int = ROWS) -> str:
    """The ops that took the most time: calls, seconds and share of `wall` seconds."""
    width = max([len("op"), *(len(op.name[:90]) for op in times[:rows])])
    lines = [f"{'op':{width}}  {'calls':>8}  {'seconds':>9}  {'of wall':>7}"]
    for op in times[:rows]:
        lines.append(
            f"{op.name[:90]:{width}}  {op.calls:8d}  {op.seconds:9.3f}  "
            f"{100 * op.seconds / wall:6.1f}%"
        )
    if len(times) > rows:
        rest = times[rows:]
        lines.append(
            f"{f'({len(rest)} more)':{width}}  {sum(op.calls for op in rest):8d}  "
            f"{sum(op.seconds for op in rest):9.3f}"
        )
    return "\n".join(lines)


class StepProfile:
    """The profiler around one step: `start()`, then `stop(...)` for its metrics."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.profiler = profiler(device)
        self.started = 0.0

    def start(self) -> None:
        self.profiler.start()
        self.started = time.perf_counter()

    def stop(self, run_dir: Path, step: int, write: bool = True) -> dict[str, float]:
        """End the profile; write its table (when `write`) and return `profile/gpu_kernels_s`,
        `profile/gpu_share` and `profile/gpu_span_s` (`device_span`) on CUDA, nothing on a CPU.
        A profile that fails says why on stderr and returns nothing: it is a diagnosis, and the
        run goes on without it."""
        try:
            return self._stop(run_dir, step, write)
        except Exception as err:  # noqa: BLE001 - torch's profiler differs between versions
            print(f"trainer.profile_step: no profile of step {step}: {err!r}", file=sys.stderr)
            return {}

    def _stop(self, run_dir: Path, step: int, write: bool) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self.started
        self.profiler.stop()
        times = op_times(raw_events(self.profiler), device=self.cuda)
        metrics, summary = {}, f"RL step {step}: {wall:.2f} s wall"
        if self.cuda:
            kernels, span = device_seconds(times), device_span(times)
            metrics = {
                "profile/gpu_kernels_s": kernels,
                "profile/gpu_share": kernels / wall,
                "profile/gpu_span_s": span,
            }
            summary += (
                f"; GPU kernels {kernels:.2f} s ({100 * kernels / wall:.0f}%: the rest "
                f"is the GPU waiting on the host, tools and the reward), recorded from "
                f"the first to the last over {span:.2f} s"
            )
        else:
            summary += "; CPU ops, each with the ops it calls"
        if write:
            path = run_dir / f"profile_step_{step:06d}.txt"
            path.write_text(summary + "\n\n" + op_table(times, wall) + "\n")
        return metrics
