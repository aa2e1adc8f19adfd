"""A run's logs: scalar metrics to TensorBoard and `metrics.jsonl`, trajectories per step.

Metric keys are namespaced (`rollout/`, `reward/`, `roc/`, `loss/`, `sandbox/`, `timing/`,
`sft/`). `trajectories/step_NNNNNN.jsonl` holds each step's trajectories for the viewer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class RunLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.run_dir / "metrics.jsonl").open("a")
        self._writer: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self._jsonl.flush()
        if self._writer is not None:
            for key, value in metrics.items():
                self._writer.add_scalar(key, value, step)

    def trajectories(self, step: int, records: list[dict[str, Any]]) -> Path:
        path = self.run_dir / "trajectories" / f"step_{step:06d}.jsonl"
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path

    def close(self) -> None:
        self._jsonl.close()
        if self._writer is not None:
            self._writer.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
