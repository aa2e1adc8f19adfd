import json
import re
import subprocess
import sys
from pathlib import Path


def test_bench_train_reports_throughput_memory_and_the_step_split(tmp_path: Path) -> None:
    out_file = tmp_path / "train.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "codeloop",
            "bench",
            "train",
            "--hidden",
            "32",
            "--layers",
            "1",
            "--sequences",
            "4",
            "--length",
            "64",
            "--steps",
            "1",
            "--out",
            str(out_file),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    tokens = int(re.search(r"(\d+) tokens per update", out).group(1))  # type: ignore[union-attr]
    assert 4 * 32 <= tokens <= 4 * 64
    plain = re.search(r"plain forward/backward\s+([\d.]+)\s+(\d+)\s+1\.00", out)
    trainer = re.search(r"RL update \(trainer\)\s+([\d.]+)\s+(\d+)\s+([\d.]+)", out)
    assert plain and trainer
    report = json.loads(out_file.read_text())
    seconds = report["seconds_per_update"]
    # the printed ratio is the ratio of the unrounded times the report keeps (the printed times
    # are rounded to 3 decimals, too coarse for a ratio of times near 0.005 s)
    assert abs(float(trainer.group(3)) - seconds["plain"] / seconds["rl_update"]) <= 0.006
    assert abs(float(plain.group(1)) - seconds["plain"]) <= 0.0005
    assert abs(float(trainer.group(1)) - seconds["rl_update"]) <= 0.0005
    assert int(re.search(r"peak resident memory: (\d+) MiB", out).group(1)) > 100  # type: ignore[union-attr]
    split = re.search(
        r"RL step \(([\d.]+) s\): rollout\+reward ([\d.]+) s .* update ([\d.]+) s "
        r".* weight sync ([\d.]+) s",
        out,
    )
    assert split and abs(sum(map(float, split.groups()[1:])) - float(split.group(1))) < 0.03
    assert report["tokens_per_update"] == tokens
