"""A run's logs: scalar metrics to `metrics.jsonl` and to sinks (`trainer.loggers`:
`TensorBoardSink`, `WandbSink`; anything with `log`, `rewind` and `close` can be one),
trajectories per step.

Metric keys are namespaced (`rollout/`, `reward/`, `roc/`, `loss/`, `sandbox/`, `timing/`,
`sft/`). `trajectories/step_NNNNNN.jsonl` holds each step's trajectories for the viewer.

A step appears once however often the run was killed and resumed: a resumed run first
`rewind`s the logs to the step of its checkpoint, dropping what a killed attempt logged past it
(the steps it is about to redo).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from codeloop.config import Config, ConfigError
from codeloop.files import write_atomic

METRICS = "metrics.jsonl"
WANDB_ID = "wandb_id"  # in the run directory: a resumed run goes on in the same W&B run


class Sink(Protocol):
    """Where a run's scalar metrics go besides `metrics.jsonl`."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def rewind(self, step: int) -> None:
        """A resumed run redoes the steps after `step`: hide or forget what was logged past it."""

    def close(self) -> None: ...


class TensorBoardSink:
    """The metrics as TensorBoard scalars under `<run_dir>/tensorboard`; a rewound run's later
    events are hidden from its views by a purge marker."""

    def __init__(self, run_dir: Path) -> None:
        self.directory = run_dir / "tensorboard"
        self._writer: Any = None
        self._purge_step: int | None = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.directory), purge_step=self._purge_step)
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def rewind(self, step: int) -> None:
        self.close()
        self._purge_step = step + 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink:
    """The metrics of a run, with its config, to a Weights & Biases run (the `wandb` extra; with
    WANDB_MODE=offline it is written under `<run_dir>/wandb/` for `wandb sync`)."""

    def __init__(self, project: str, run_dir: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "trainer.loggers names wandb, which is not installed: pip install 'codeloop[wandb]'"
            ) from None
        id_file = run_dir / WANDB_ID
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        write_atomic(id_file, run_id + "\n")
        settings = wandb.Settings(silent=True, console="off")  # the console stays the run's
        try:
            self.run = wandb.init(
                project=project,
                dir=str(run_dir),
                id=run_id,
                name=run_dir.name,
                config=config,
                resume="allow",
                settings=settings,
            )
        except Exception as err:  # no API key, no network: W&B's own words, in one line
            raise ConfigError(
                f"trainer.loggers: wandb could not start a run ({err}); log in "
                "with `wandb login` or set WANDB_MODE=offline"
            ) from None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def rewind(self, step: int) -> None:
        """W&B keeps the last value logged at a step: the redone steps replace the old ones."""

    def close(self) -> None:
        self.run.finish()


class RunLogger:
    def __init__(self, run_dir: str | Path, sinks: Sequence[Sink] = ()) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.run_dir / METRICS).open("a")
        self.sinks = list(sinks)

    @classmethod
    def for_run(cls, cfg: Config, run_dir: str | Path, is_main: bool = True) -> RunLogger:
        """The logger with the sinks `trainer.loggers` names (only the main rank has sinks)."""
        run_dir = Path(run_dir)
        sinks: list[Sink] = []
        if is_main and "tensorboard" in cfg.trainer.loggers:
            sinks.append(TensorBoardSink(run_dir))
        if is_main and "wandb" in cfg.trainer.loggers:
            run_dir.mkdir(parents=True, exist_ok=True)
            sinks.append(WandbSink(cfg.trainer.wandb_project, run_dir, dataclasses.asdict(cfg)))
        return cls(run_dir, sinks)

    def rewind(self, step: int) -> None:
        """Forget everything logged after `step`: metrics records, trajectory files, and what
        the sinks logged past it."""
        self._jsonl.close()
        write_atomic(
            self.run_dir / METRICS,
            "".join(json.dumps(r) + "\n" for r in read_metrics(self.run_dir) if r["step"] <= step),
        )
        self._jsonl = (self.run_dir / METRICS).open("a")
        for path in (self.run_dir / "trajectories").glob("step_*.jsonl"):
            if int(path.stem.removeprefix("step_")) > step:
                path.unlink()
        for sink in self.sinks:
            sink.rewind(step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self._jsonl.flush()
        for sink in self.sinks:
            sink.log(step, metrics)

    def trajectories(self, step: int, records: list[dict[str, Any]]) -> Path:
        path = self.run_dir / "trajectories" / f"step_{step:06d}.jsonl"
        path.parent.mkdir(exist_ok=True)
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
        return path

    def close(self) -> None:
        self._jsonl.close()
        for sink in self.sinks:
            sink.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of `metrics.jsonl` (none when it is missing), without a last line cut
    short by a killed run."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]
