"""One RL step under torch.profiler (`trainer/profile.py`): op times read from raw events by
hand, a profile that fails leaves the step alone, and a profiled step prints nothing of its own.
The profile of a step in the loop: tests/trainer/test_group_source.py; on CUDA: test_gpu.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def test_op_times_sum_each_kernel_once_and_keep_cpu_ops_apart() -> None:
    from torch.profiler import DeviceType

    from codeloop.trainer.profile import OpTime, device_seconds, device_span, op_table, op_times

    class Event:  # a raw (kineto) event's methods
        def __init__(
            self,
            name: str,
            device: DeviceType,
            start_s: float,
            seconds: float,
            annotation: bool = False,
        ) -> None:
            self.values = (name, device, round(start_s * 1e9), round(seconds * 1e9), annotation)

        def name(self) -> str:
            return self.values[0]

        def device_type(self) -> DeviceType:
            return self.values[1]

        def start_ns(self) -> int:
            return self.values[2]

        def end_ns(self) -> int:
            return self.values[2] + self.values[3]

        def is_user_annotation(self) -> bool:
            return self.values[4]

    cuda, cpu = DeviceType.CUDA, DeviceType.CPU
    events = [
        Event("aten::mm", cpu, 0.0, 1.6),  # the op that launched a kernel, on the host
        Event("gemm", cuda, 1.0, 1.5),  # 1.0-2.5 s
        Event("softmax", cuda, 3.0, 0.5),  # 3.0-3.5 s
        Event("gemm", cuda, 2.5, 0.25),  # a second call, recorded out of order
        Event("decode", cuda, 0.5, 9.0, annotation=True),  # a span someone named
        Event("aten::add", cpu, 9.0, 0.1),
    ]
    kernels = op_times(events, device=True)
    assert kernels == [OpTime("gemm", 2, 1.75), OpTime("softmax", 1, 0.5)]
    assert device_seconds(kernels) == 2.25
    assert device_span(kernels) == 2.5  # 1.0 s to 3.5 s: the host ops and the span left out
    assert device_span([]) == 0.0
    assert op_times(events, device=False) == [
        OpTime("aten::mm", 1, 1.6),
        OpTime("aten::add", 1, 0.1),
    ]
    table = op_table(kernels, wall=5.0, rows=1).splitlines()
    assert table[0].split() == ["op", "calls", "seconds", "of", "wall"]
    assert table[1].split() == ["gemm", "2", "1.750", "35.0%"]  # 1.75 s of 5 s
    assert table[2].split() == ["(1", "more)", "1", "0.500"]


def test_a_profile_that_fails_leaves_the_step_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from codeloop.trainer import profile as module
    from codeloop.trainer.profile import StepProfile

    def broken(profiler: object) -> None:
        raise RuntimeError("no kineto")

    profile = StepProfile(torch.device("cpu"))
    profile.start()
    monkeypatch.setattr(module, "raw_events", broken)
    assert profile.stop(tmp_path, 2) == {}
    assert "no profile of step 2: RuntimeError('no kineto')" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_profiled_step_prints_nothing_of_its_own(tmp_path: Path) -> None:
    # kineto prints `USDT: ... profiler_start` and `... profiler_stop` on stderr for each
    # profile unless its log level, read when a process's first profile starts, says not to
    code = (
        "import sys, torch; from pathlib import Path; "
        "from codeloop.trainer.profile import StepProfile; "
        "p = StepProfile(torch.device('cpu')); p.start(); torch.ones(8).sum(); "
        "p.stop(Path(sys.argv[1]), 1); print('stopped')"
    )
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("stopped\n", "")
    assert (tmp_path / "profile_step_000001.txt").read_text().startswith("RL step 1: ")
