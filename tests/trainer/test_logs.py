"""The run log's rewind and the writes that a killed run never leaves half done."""

import json
import sys
from pathlib import Path

import pytest

from codeloop.files import directory_atomic, write_atomic
from codeloop.trainer.logs import RunLogger, TensorBoardSink, read_metrics


def test_rewind_forgets_the_steps_after_the_checkpoint(tmp_path: Path) -> None:
    logger = RunLogger(tmp_path)
    for step in (1, 2, 3, 4):
        logger.log(step, {"reward/mean": step / 10})
        logger.trajectories(step, [{"step": step}])
    logger.rewind(2)
    logger.log(3, {"reward/mean": 0.9})  # the step done again
    logger.close()
    assert read_metrics(tmp_path) == [
        {"step": 1, "reward/mean": 0.1},
        {"step": 2, "reward/mean": 0.2},
        {"step": 3, "reward/mean": 0.9},
    ]
    assert sorted(p.name for p in (tmp_path / "trajectories").iterdir()) == [
        "step_000001.jsonl",
        "step_000002.jsonl",
    ]


def test_a_last_line_cut_short_by_a_kill_is_not_a_record(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x": 1}\n{"step": 2, "x"')
    assert read_metrics(tmp_path) == [{"step": 1, "x": 1}]
    logger = RunLogger(tmp_path)
    logger.rewind(5)  # keeps what is whole, drops the fragment
    logger.log(2, {"x": 2})
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n'


def test_rewind_to_zero_starts_the_log_over(tmp_path: Path) -> None:
    logger = RunLogger(tmp_path)
    logger.log(1, {"x": 1})
    logger.rewind(0)
    logger.close()
    assert read_metrics(tmp_path) == []


def test_tensorboard_hides_the_events_after_the_rewound_step(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = RunLogger(tmp_path, [TensorBoardSink(tmp_path)])
    for step in (1, 2, 3):
        first.log(step, {"x": float(step)})
    first.close()
    # A resumed run is a later process, so its event file sorts after the first run's (the name
    # starts with the time in seconds). Within one second, one process's files sort by a
    # counter as text ("10" before "9"): the first run's file is dated a second earlier.
    for old in (tmp_path / "tensorboard").glob("events.out.tfevents.*"):
        stamp = old.name.split(".")[3]
        old.rename(old.with_name(old.name.replace(stamp, f"{int(stamp) - 1:010d}", 1)))
    again = RunLogger(
        tmp_path, [TensorBoardSink(tmp_path)]
    )  # a resumed run: its checkpoint was step 1
    again.rewind(1)
    again.log(2, {"x": 20.0})
    again.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(1, 1.0), (2, 20.0)]


def test_a_failed_directory_write_leaves_the_old_one(tmp_path: Path) -> None:
    target = tmp_path / "model"
    with directory_atomic(target) as partial:
        (partial / "weights").write_text("old")
    with pytest.raises(RuntimeError), directory_atomic(target) as partial:
        (partial / "weights").write_text("half")
        raise RuntimeError("killed")
    assert (target / "weights").read_text() == "old"
    with directory_atomic(target) as partial:  # the next write clears the scratch copy
        (partial / "weights").write_text("new")
    assert (target / "weights").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_write_atomic_replaces_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "stage.json"
    write_atomic(path, json.dumps({"a": 1}))
    write_atomic(path, json.dumps({"b": 2}))
    assert json.loads(path.read_text()) == {"b": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage.json"]


def test_loggers_are_named_and_a_missing_wandb_is_said_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from codeloop.config import Config, ConfigError, load_config

    with pytest.raises(ConfigError, match=r"trainer.loggers\[1\]: expected one of"):
        load_config(None, ["--trainer.loggers", '["tensorboard", "mlflow"]'])  # when it loads
    cfg = Config()
    cfg.trainer.loggers = ["wandb"]
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'codeloop\[wandb\]'"):
        RunLogger.for_run(cfg, tmp_path)
    cfg.trainer.loggers = []  # metrics.jsonl only
    logger = RunLogger.for_run(cfg, tmp_path)
    logger.log(1, {"x": 1.0})
    logger.close()
    assert read_metrics(tmp_path) == [{"step": 1, "x": 1.0}]
    assert not (tmp_path / "tensorboard").exists()
