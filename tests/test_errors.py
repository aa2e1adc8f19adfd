"""One error type for bad input, and the command line's one handler: a message, exit 2."""

import subprocess
import sys
from pathlib import Path

import pytest

import codeloop
from codeloop.config import ConfigError
from codeloop.data.pretrained import PretrainedError
from codeloop.data.problems import DataError
from codeloop.engine.openai_engine import EngineError
from codeloop.errors import ModelError
from codeloop.sandbox.pool import IsolationError
from codeloop.trainer.sft import SFTDataError


def test_every_public_error_is_a_codeloop_error() -> None:
    for error in (
        ConfigError,
        DataError,
        ModelError,
        SFTDataError,
        EngineError,
        IsolationError,
        PretrainedError,
    ):
        assert issubclass(error, codeloop.CodeloopError), error


def _codeloop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "codeloop", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["eval", "--model", "x", "--data", "gsm8k_typo"],
            "codeloop eval: gsm8k_typo: no such file; read as a hub dataset name, it needs",
        ),
        (
            ["serve", "--model", "./no/such/model"],
            "codeloop serve: model './no/such/model': no such directory",
        ),
        (["serve", "--model", "{empty}"], "no model there (no config.json)"),
        (
            ["eval", "--model", "{empty}", "--data", "{data}"],
            "codeloop eval: model '{empty}': no model there (no config.json)",
        ),
        (["eval", "--model", "{empty}", "--data", "{bad}"], "bad.jsonl:2: not JSON"),
        (["config", "show", "nothing.toml"], "codeloop config show: nothing.toml: no such"),
        (
            ["eval", "--model", "{untokenized}", "--data", "{data}"],
            "tokenizer '{untokenized}': no tokenizer there",
        ),
        (
            ["eval", "--model", "{unreadable}", "--data", "{data}"],
            "tokenizer '{unreadable}': KeyError",
        ),
    ],
)
def test_bad_input_is_a_message_and_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for name in ("untokenized", "unreadable"):  # a config.json transformers cannot read
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "unreadable" / "tokenizer.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text('{"id": "a", "problem": "1 + 1?", "answer": "2"}\n')
    (tmp_path / "bad.jsonl").write_text('{"problem": "1 + 1?", "answer": "2"}\n{oops\n')
    names = {name: str(tmp_path / name) for name in ("empty", "untokenized", "unreadable")}
    names |= {"data": str(tmp_path / "data.jsonl"), "bad": str(tmp_path / "bad.jsonl")}
    done = _codeloop(*(a.format(**names) for a in args))
    assert done.returncode == 2
    assert message.format(**names) in done.stderr
    assert "Traceback" not in done.stderr
