"""A bench's counts (requests, steps, sequences, ...) are 1 or more: 0 or a word is argparse's
one-line usage error naming the option (exit 2), never a traceback from deep inside the run
(`bench rollout --trajectories 0` divided by a zero speed after eight minutes of work)."""

import importlib

import pytest

COUNTS = {
    "ceiling": ["--max-batch"],
    "lora": ["--rank", "--sequences", "--length", "--micro-batch-tokens", "--steps"],
    "rollout": [
        "--hidden",
        "--layers",
        "--requests",
        "--gen-tokens",
        "--trajectories",
        "--tokens",
        "--max-batch",
    ],
    "sandbox": ["--workers", "--soak", "--concurrency", "--overload-runs", "--overload-soak"],
    "scheduler": [
        "--engines",
        "--prompts",
        "--group",
        "--capacity",
        "--budget",
        "--turn-cap",
        "--saturation",
        "--seeds",
    ],
    "train": ["--hidden", "--layers", "--sequences", "--length", "--micro-batch-tokens", "--steps"],
    "trl": ["--steps", "--prompts", "--group", "--max-tokens"],
}


@pytest.mark.parametrize(
    ("bench", "option"),
    [(bench, option) for bench, options in COUNTS.items() for option in options],
)
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_a_count_below_one_is_a_usage_error_naming_the_option(
    bench: str, option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main = importlib.import_module(f"codeloop.bench.{bench}").main
    with pytest.raises(SystemExit) as exited:
        main([option, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {value!r} is not a count of 1 or more" in err
    assert "Traceback" not in err
