"""`codeloop sft` then `codeloop train` (and a resumed `train`) through the real CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from trainer_helpers import cli_inputs, rl_arguments

from codeloop.cli import main
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer.logs import read_metrics


def _codeloop(*args: str) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(
        [sys.executable, "-m", "codeloop", *args], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.slow
def test_sft_then_train_then_resume(trainer_fmt: PromptFormat, tmp_path: Path) -> None:
    base, sft_data, problems = cli_inputs(trainer_fmt, tmp_path)
    run_dir = tmp_path / "run"
    _codeloop(
        "sft",
        "--trainer.model",
        str(base),
        "--sft.data",
        str(sft_data),
        "--trainer.output_dir",
        str(run_dir),
        "--sft.epochs",
        "2",
    )
    assert len(read_metrics(run_dir)) == 2 and (run_dir / "sft_model" / "config.json").is_file()
    # the policy carries how it is prompted and scored (codeloop eval --model without --config)
    saved = json.loads((run_dir / "sft_model" / "codeloop.json").read_text())
    assert saved["rollout"]["chat_template"] == "codeloop_chat_template.jinja"
    assert (
        saved["eval"]["k"] == 16
        and (run_dir / "sft_model" / saved["rollout"]["chat_template"]).read_text()
        == trainer_fmt.template
    )
    common = rl_arguments(run_dir / "sft_model", problems, run_dir / "rl", 1)
    _codeloop("train", *common, "--trainer.max_steps", "2")
    again = _codeloop("train", *common, "--trainer.max_steps", "3")
    assert "resumed from step 2" in again.stdout
    assert [m["step"] for m in read_metrics(run_dir / "rl")] == [1, 2, 3]
    assert (run_dir / "rl" / "trajectories" / "step_000003.jsonl").is_file()
    assert (run_dir / "rl" / "checkpoints" / "step_000003" / "state.pt").is_file()
    assert (run_dir / "rl" / "checkpoints" / "step_000003" / "model" / "codeloop.json").is_file()


@pytest.mark.slow
def test_train_runs_the_asynchronous_loop_when_asked(
    trainer_fmt: PromptFormat, tmp_path: Path
) -> None:
    base, _, problems = cli_inputs(trainer_fmt, tmp_path)
    run_dir = tmp_path / "rl"
    run = _codeloop(
        "train",
        *rl_arguments(base, problems, run_dir, 1),
        "--trainer.max_steps",
        "2",
        "--trainer.mode",
        "async",
    )
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all("async/staleness_max" in m and "async/overlap" in m for m in metrics)
    assert "rl: 2/2 step" in run.stderr  # the steps' progress, to its end
    assert "\r" not in run.stderr  # captured output: plain lines, not a bar


def test_config_errors_exit_2(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "codeloop", "train", "--trainer.lr", "-1"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and "trainer.lr" in run.stderr


@pytest.mark.parametrize(
    ("command", "arguments", "message"),
    [
        (
            "train",
            ["--data.train", "{bad}", "--trainer.model", "{model}"],
            "{bad}:2: not JSON (Expecting value)",
        ),
        (
            "train",
            ["--data.train", "{good}", "--trainer.model", "{model}"],
            "model '{model}': no such directory",
        ),
        (
            "sft",
            ["--sft.data", "{tmp}/none.jsonl", "--trainer.model", "{model}"],
            "sft.data: {tmp}/none.jsonl: no such file",
        ),
    ],
)
def test_input_errors_exit_2_with_the_file_named(
    tmp_path: Path, command: str, arguments: list[str], message: str
) -> None:
    names = {
        "tmp": str(tmp_path),
        "bad": str(tmp_path / "bad.jsonl"),
        "good": str(tmp_path / "good.jsonl"),
        "model": str(tmp_path / "no_model"),
    }
    line = '{"id": "a", "problem": "1+1", "answer": "2"}\n'
    (tmp_path / "good.jsonl").write_text(line)
    (tmp_path / "bad.jsonl").write_text(line + "not json\n")
    run = subprocess.run(
        [sys.executable, "-m", "codeloop", command, *(a.format(**names) for a in arguments)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip() == f"codeloop {command}: {message.format(**names)}"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("missing.jinja", "rollout.chat_template: {tmp}/missing.jinja: no such file"),
        (
            "no_tools.jinja",
            "the chat template does not render a 'tool' message (no tool support?): "
            "give rollout.chat_template one that does",
        ),
    ],
)
def test_a_chat_template_that_cannot_serve_is_named(
    trainer_fmt: PromptFormat,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    template: str,
    message: str,
) -> None:
    base, _, problems = cli_inputs(trainer_fmt, tmp_path)
    (tmp_path / "no_tools.jinja").write_text(
        "{% for m in messages if m.role != 'tool' %}{{ m.content }}{% endfor %}"
    )
    argv = [
        "train",
        "--trainer.model",
        str(base),
        "--data.train",
        str(problems),
        "--trainer.output_dir",
        str(tmp_path / "run"),
        "--rollout.chat_template",
        str(tmp_path / template),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err  # after the model's loading bars: one line
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"codeloop train: {message.format(tmp=tmp_path)}"


def _wandb_history(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The logged rows and the config of the offline W&B run under `run_dir`: its `.wandb` file
    is a log of protobuf records in blocks of 32 KiB (wandb's `wandb_internal_pb2.Record`),
    after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows, config, pos, payload = [], {}, 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind not in (1, 4):  # 1: a whole record, 2-4: first, middle, last piece
            continue
        record = pb.Record()
        record.ParseFromString(payload)
        payload = b""
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
        elif record.WhichOneof("record_type") == "run":
            config |= {i.key: json.loads(i.value_json) for i in record.run.config.update}
    return rows, config


@pytest.mark.slow
def test_train_scores_held_out_problems_and_logs_them_to_tensorboard_and_wandb(
    trainer_fmt: PromptFormat, tmp_path: Path
) -> None:
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    base, _, problems = cli_inputs(trainer_fmt, tmp_path)
    held_out = tmp_path / "held_out.jsonl"
    rows = [{"id": f"h{i}", "problem": f"What is {i} + 2?", "answer": str(i + 2)} for i in range(3)]
    held_out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dir = tmp_path / "rl"
    args = [
        "train",
        *rl_arguments(base, problems, run_dir, 1),
        "--trainer.max_steps",
        "4",
        "--trainer.eval_every",
        "2",
        "--eval.data",
        str(held_out),
        "--eval.k",
        "2",
        "--eval.max_response_tokens",
        "24",
        "--trainer.loggers",
        '["tensorboard", "wandb"]',
        "--trainer.wandb_project",
        "held-out-test",
    ]
    offline = {**os.environ, "WANDB_MODE": "offline"}
    done = subprocess.run(
        [sys.executable, "-m", "codeloop", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=offline,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wandb" not in done.stdout + done.stderr  # W&B keeps quiet on the run's console
    metrics = read_metrics(run_dir)
    scored = [(m["step"], m["eval/pass@1"]) for m in metrics if "eval/pass@1" in m]
    assert [step for step, _ in scored] == [2, 4]
    for m in metrics:
        if "eval/pass@1" in m:
            assert m["eval/problems"] == 3 and m["eval/infrastructure_failures"] == 0
            assert m["eval/pass@1_low"] <= m["eval/pass@1"] <= m["eval/pass@1_high"]
            assert m["timing/eval_s"] > 0
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("eval/pass@1")] == scored
    history, config = _wandb_history(run_dir)
    assert [(r["_step"], r["eval/pass@1"]) for r in history if "eval/pass@1" in r] == scored
    assert [r["_step"] for r in history] == [1, 2, 3, 4]  # every step's metrics, not only eval's
    assert config["trainer"]["eval_every"] == 2 and config["eval"]["data"] == str(held_out)
    [offline] = run_dir.glob("wandb/offline-run-*")  # its id kept for a resumed run
    assert offline.name.endswith("-" + (run_dir / "wandb_id").read_text().strip())
