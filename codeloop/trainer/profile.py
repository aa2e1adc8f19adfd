"""One RL step under torch.profiler (`trainer.profile_step`): how much of it the GPU computes.

A step's wall time is the GPU's kernels plus the time the GPU waits: for the host to launch the
next kernel (a decoding step driven from Python), for tools and the reward, for the engine's
next batch. With the CUDA timeline recorded (no CPU ops, so the profiler adds little to the
host's work), the kernels' summed time over the step's wall time is the share the GPU computed;
the rest is the host-side waiting. The table of the kernels that took the most time goes to
`profile_step_NNNNNN.txt` in the run directory. On a CPU the table lists the CPU ops and no
share is logged. torch's profiler backend (kineto) prints two lines to stderr for each profile:
`quiet_profiler` keeps them off the console.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROWS = 30  # of the table
KINETO_QUIET = "6"  # a kineto log level above its USDT lines' (5): it prints nothing


def quiet_profiler() -> None:
    """Keep kineto's lines (`USDT: ... profiler_start`, `... profiler_stop`) off the console,
    unless KINETO_LOG_LEVEL is set. Kineto reads it when the process's first profile starts."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)


def device_seconds(events: Any) -> float:
    """The kernels' summed time of a profile's events (`key_averages()`), in seconds: the
    device's own events only (as torch's table totals them), since a CPU op's self device
    time repeats its kernels'."""
    from torch.profiler import DeviceType

    kernels = [event for event in events if event.device_type != DeviceType.CPU
               and not getattr(event, "is_user_annotation", False)]  # fmt: skip
    return float(sum(event.self_device_time_total for event in kernels)) / 1e6


class StepProfile:
    """The profiler around one step: `start()`, then `stop(...)` for its metrics."""

    def __init__(self, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile

        quiet_profiler()
        self.cuda = device.type == "cuda"
        self.device = device
        activity = ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU
        self.profiler = profile(activities=[activity])
        self.started = 0.0

    def start(self) -> None:
        self.profiler.start()
        self.started = time.perf_counter()

    def stop(self, run_dir: Path, step: int, write: bool = True) -> dict[str, float]:
        """End the profile; write its table (when `write`) and return `profile/gpu_kernels_s`
        and `profile/gpu_share` (on CUDA; nothing on a CPU). A profile that fails says why on
        stderr and returns nothing: it is a diagnosis, and the run goes on without it."""
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
        events = self.profiler.key_averages()
        metrics, summary = {}, f"RL step {step}: {wall:.2f} s wall"
        if self.cuda:
            kernels = device_seconds(events)
            metrics = {"profile/gpu_kernels_s": kernels, "profile/gpu_share": kernels / wall}
            summary += (f"; GPU kernels {kernels:.2f} s ({100 * kernels / wall:.0f}%: the rest "
                        f"is the GPU waiting on the host, tools and the reward)")  # fmt: skip
        if write:
            order = "self_device_time_total" if self.cuda else "self_cpu_time_total"
            table = events.table(sort_by=order, row_limit=ROWS)
            path = run_dir / f"profile_step_{step:06d}.txt"
            path.write_text(summary + "\n\n" + table + "\n")
        return metrics
