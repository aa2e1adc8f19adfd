"""The installed package stands alone: a wheel carries what `codeloop demo` reads."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_wheel_runs_the_demo_and_config_commands(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a clean copy: no stale build/ from an earlier build
    skipped = (
        ".git",
        ".venv",
        "runs",
        "build",
        "dist",
        "*.egg-info",
        "__pycache__",
        ".*_cache",
        "bench-results",
        ".gpu",
    )  # not "*cache*": it would drop engine/slot_cache.py
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*skipped))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [
            *pip,
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("codeloop-*.whl")
    site = tmp_path / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    work = tmp_path / "elsewhere"  # neither the checkout nor its configs/ are reachable here
    work.mkdir()

    def codeloop(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "codeloop", *args],
            cwd=work,
            env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    assert "usage: codeloop demo" in codeloop("demo", "--help")
    assert "[trainer]" in codeloop("config", "show")
    # the real recipe's configs and template resolve to the wheel's copies, and GSM8K ships
    shown = codeloop("config", "show", "configs/gsm8k_smollm2_gpu.toml")
    assert 'output_dir = "runs/real-gpu"' in shown and "engine_max_batch = 256" in shown
    real = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from codeloop.config import load_config; "
            "import codeloop.recipe.real; "
            "from codeloop.data.problems import GSM8K_TRAIN, load_problems; "
            "from codeloop.rollout.prompt import PromptFormat; "
            "from codeloop.data.tokenizer import train_tokenizer; "
            "c = load_config('configs/gsm8k_smollm2.toml'); "
            "f = PromptFormat.from_config(train_tokenizer(['a b c'] * 5, 300), c.rollout); "
            "print(len(load_problems(str(GSM8K_TRAIN))), str(GSM8K_TRAIN).startswith(sys.argv[1]))",
            str(site),
        ],
        cwd=work,
        env={"PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert real.returncode == 0, real.stderr[-2000:]
    assert real.stdout.split() == ["7473", "True"]
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "from codeloop.recipe.demo import DEMO_CONFIG as d; "
            "from codeloop.config import load_config; c = load_config(str(d)); "
            "print(d); print(c.trainer.output_dir, len(c.recipe.stages))",
        ],
        cwd=work,
        env={"PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    path, settings = loaded.stdout.splitlines()
    assert path.startswith(str(site))  # the wheel's copy, not the checkout's
    assert settings == "runs/demo 3"
