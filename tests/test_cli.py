import subprocess
import sys
from pathlib import Path

import pytest

from codeloop.cli import _packaged_model, main, split_overrides
from codeloop.config import Config, load_config
from codeloop.data import pretrained

TOP_LEVEL = [
    "sandbox",
    "serve",
    "sft",
    "train",
    "recipe",
    "eval",
    "compare",
    "view",
    "entropy",
    "demo",
    "data",
    "bench",
    "config",
]


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in TOP_LEVEL:
        assert f"    {name} " in out or f"    {name}\n" in out, name


def test_config_show_prints_a_loadable_resolved_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = Path(__file__).resolve().parents[1]
    recipe = repo / "configs" / "rstar2_agent.toml"
    assert main(["config", "show", str(recipe), "--algo.clip_high", "0.3"]) == 0
    shown = tmp_path / "shown.toml"
    shown.write_text(capsys.readouterr().out)
    assert load_config(shown) == load_config(recipe, ["--algo.clip_high", "0.3"])


def test_config_show_reports_errors_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--algo.clip_low", "-0.1"]) == 2
    err = capsys.readouterr().err
    assert "command line: algo.clip_low: must be > 0, got -0.1" in err


def test_split_overrides_keeps_negative_values_away_from_argparse() -> None:
    assert split_overrides(["config", "show", "f.toml", "--algo.clip_high", "-1"]) == (
        ["config", "show", "f.toml"],
        ["--algo.clip_high", "-1"],
    )


def test_overrides_and_the_command_options_mix_in_any_order() -> None:
    """An override before `--data` used to swallow it (and `--k`, `--out`) as overrides."""
    argv = [
        "eval",
        "--model",
        "m",
        "--eval.max_response_tokens",
        "512",
        "--data",
        "d.jsonl",
        "--trainer.seed=3",
        "--k",
        "4",
        "--algo.clip_low",
        "-0.5",
    ]
    assert split_overrides(argv) == (
        ["eval", "--model", "m", "--data", "d.jsonl", "--k", "4"],
        ["--eval.max_response_tokens", "512", "--trainer.seed=3", "--algo.clip_low", "-0.5"],
    )
    assert split_overrides(["train", "--algo.clip_high"]) == (["train"], ["--algo.clip_high"])


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "codeloop"
    assert script.exists(), "run `pip install -e .` (make test does)"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "config" in done.stdout and "demo" in done.stdout
    done = subprocess.run([str(script), "eval"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "required: --data" in done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--model", "m", "--max-batch"],
        ["serve", "--model", "m", "--kv-capacity-tokens"],
        ["eval", "--model", "m", "--data", "d", "--concurrency"],  # 0: no problem ever starts
        ["entropy", "run", "--model", "m", "--window"],
        ["data", "filter", "f", "--out", "o", "--k"],
        ["data", "decontaminate", "f", "--against", "b", "--out", "o", "--ngram"],
    ],
)
def test_a_commands_count_below_one_is_a_usage_error_naming_the_option(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "0"])
    assert exited.value.code == 2
    assert f"argument {argv[-1]}: '0' is not a count of 1 or more" in capsys.readouterr().err


def test_a_packaged_models_name_as_trainer_model_is_its_imported_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    imported = []
    monkeypatch.setitem(
        pretrained.PACKAGED, "smollm2", lambda: imported.append(1) or tmp_path / "SmolLM2"
    )
    cfg = Config()
    cfg.trainer.model = "smollm2"
    _packaged_model(cfg)
    assert cfg.trainer.model == str(tmp_path / "SmolLM2") and imported == [1]
    cfg.trainer.model = str(tmp_path)  # a directory is left as it is
    _packaged_model(cfg)
    assert cfg.trainer.model == str(tmp_path) and imported == [1]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()  # a directory of that name wins over the packaged model
    cfg.trainer.model = "smollm2"
    _packaged_model(cfg)
    assert cfg.trainer.model == "smollm2" and imported == [1]
