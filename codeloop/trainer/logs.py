"""A run's logs: scalar metrics to TensorBoard and `metrics.jsonl`, trajectories per step.

Metric keys are namespaced (`rollout/`, `reward/`, `roc/`, `loss/`, `sandbox/`, `timing/`,
`sft/`). `trajectories/step_NNNNNN.jsonl` holds each step's trajectories for the viewer.

A step appears once however often the run was killed and resumed: a resumed run first
`rewind`s the logs to the step of its checkpoint, dropping what a killed attempt logged past it
(the steps it is about to redo).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from codeloop.files import write_atomic

METRICS = "metrics.jsonl"


class RunLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.run_dir / METRICS).open("a")
        self._tensorboard = tensorboard
        self._writer: Any = None
        self._purge_step: int | None = None

    def rewind(self, step: int) -> None:
        """Forget everything logged after `step`: metrics records, trajectory files and
        TensorBoard events (hidden from its views by a purge marker)."""
        self._jsonl.close()
        write_atomic(self.run_dir / METRICS,
                     "".join(json.dumps(r) + "\n" for r in read_metrics(self.run_dir)
                             if r["step"] <= step))  # fmt: skip
        self._jsonl = (self.run_dir / METRICS).open("a")
        for path in (self.run_dir / "trajectories").glob("step_*.jsonl"):
            if int(path.stem.removeprefix("step_")) > step:
                path.unlink()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._purge_step = step + 1

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self._jsonl.flush()
        if self._tensorboard:
            writer = self._tensorboard_writer()
            for key, value in metrics.items():
                writer.add_scalar(key, value, step)

    def _tensorboard_writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.run_dir / "tensorboard"),
                                         purge_step=self._purge_step)  # fmt: skip
        return self._writer

    def trajectories(self, step: int, records: list[dict[str, Any]]) -> Path:
        path = self.run_dir / "trajectories" / f"step_{step:06d}.jsonl"
        path.parent.mkdir(exist_ok=True)
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
        return path

    def close(self) -> None:
        self._jsonl.close()
        if self._writer is not None:
            self._writer.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of `metrics.jsonl` (none when it is missing), without a last line cut
    short by a killed run."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]
