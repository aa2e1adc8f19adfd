"""`codeloop bench gpu`: its dry run end to end on the CPU (the same sequence as on a card, at
toy sizes), and the pieces that read what each step leaves."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from codeloop.bench.gpu import (
    Step,
    _pytest_counts,
    _recipe_figures,
    _run,
    gpu_test_files,
    markdown,
)

REQUIRED = (
    "date",
    "commit",
    "card",
    "plain_tokens_per_s",
    "agent_tokens_per_s",
    "recipe_minutes",
    "rl_steps",
    "dev_difference",
    "dev_interval95",
)


@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_writes_one_report(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "codeloop",
            "bench",
            "gpu",
            "--dry-run",
            "--out",
            str(tmp_path),
            "--logs",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (report_file,) = tmp_path.glob("gpu-*.json")
    report = json.loads(report_file.read_text())
    assert set(REQUIRED) <= set(report)
    steps = [s["name"] for s in report["steps"]]
    assert steps == [
        "gpu tests",
        "rollout smollm2",
        "rollout qwen2.5-0.5b",
        "rollout qwen2.5-1.5b",
        "recipe",
    ]
    assert {s["outcome"] for s in report["steps"]} == {"ok"}
    assert report["gpu_tests"]["failed"] == 0 and report["gpu_tests"]["passed"] == 0  # no CUDA
    assert report["plain_tokens_per_s"] > 0 and report["agent_tokens_per_s"] > 0
    for shape in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        assert report["shapes"][shape]["model"].startswith(f"{shape} shape")
        assert report["shapes"][shape]["over_transformers"] > 0
    assert report["rl_steps"] == 3  # one step in each of the three stages
    low, high = report["dev_interval95"]
    assert low <= report["dev_difference"] <= high and report["dev_problems"] == 2
    assert report["dev_sft"]["stage"] == "sft" and report["dev_rl"]["stage"] == "stage3-hard"
    low, high = report["trained_interval95"]
    assert low <= report["trained_difference"] <= high and report["trained_problems"] > 0
    text = report_file.with_suffix(".md").read_text()
    assert "| RL steps | 3 |" in text and "a dry run at toy sizes" in text
    assert (tmp_path / "logs" / "recipe.log").is_file()


def test_a_step_past_its_time_is_stopped_with_its_children_and_the_next_one_runs(
    tmp_path: Path,
) -> None:
    report: dict = {"steps": []}
    marker = tmp_path / "child.pid"
    # a shell whose child sleeps: the whole process group must go
    slow = Step("slow", ["sh", "-c", f"sleep 60 & echo $! > {marker}; wait"], timeout_s=6)
    began = time.monotonic()
    record = _run(slow, tmp_path, time.monotonic() + 60, report)
    assert record["outcome"] == "out of time (6 s)" and time.monotonic() - began < 20
    child = int(marker.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text()
    failing = Step("failing", ["sh", "-c", "echo something broke; exit 3"], timeout_s=30)
    record = _run(failing, tmp_path, time.monotonic() + 60, report)
    assert record["outcome"] == "failed (exit 3)" and "something broke" in record["tail"]
    late = Step("late", ["true"], timeout_s=30)
    assert _run(late, tmp_path, time.monotonic() + 2, report)["outcome"] == "skipped"
    assert [s["name"] for s in report["steps"]] == ["slow", "failing", "late"]


def test_pytest_counts_are_read_from_its_last_line() -> None:
    tail = "....\n===== 3 passed, 7 skipped, 1 failed, 1440 deselected in 12.50s =====\n"
    assert _pytest_counts(tail) == {
        "passed": 3,
        "failed": 1,
        "skipped": 7,
        "errors": 0,
        "deselected": 1440,
    }
    assert _pytest_counts("1 error in 0.5s")["errors"] == 1


def test_the_recipe_figures_pair_the_problems_and_count_rl_steps_only(tmp_path: Path) -> None:
    sft = {"1": 0.0, "2": 0.5, "3": 1.0}
    rl = {"1": 1.0, "2": 0.5, "3": 1.0}  # one problem gained a whole sample: +33.3 points
    points = [
        {"stage": "sft", "pass@1": 0.5, "pass@1_low": 0.1, "pass@1_high": 0.9, "per_problem": sft},
        {
            "stage": "stage1",
            "pass@1": 2.5 / 3,
            "pass@1_low": 0.5,
            "pass@1_high": 1.0,
            "per_problem": rl,
        },
    ]
    (tmp_path / "summary.json").write_text(json.dumps({"points": points, "minutes": 8.5}))
    for stage, steps in (("sft", 5), ("1-stage1", 4), ("2-stage2", 2)):
        (tmp_path / stage).mkdir()
        lines = [json.dumps({"step": i + 1}) for i in range(steps)]
        (tmp_path / stage / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    figures = _recipe_figures(tmp_path)
    assert figures["rl_steps"] == 6  # 4 + 2; SFT's 5 are not RL steps
    assert figures["recipe_minutes"] == 8.5 and figures["dev_problems"] == 3
    assert figures["dev_difference"] == pytest.approx(100 / 3)
    low, high = figures["dev_interval95"]
    assert 0 <= low <= 100 / 3 <= high <= 100
    assert figures["dev_sft"] == {"stage": "sft", "pass_at_1": 50.0, "interval95": [10.0, 90.0]}
    report = {
        "date": "2026-11-27",
        "card": "X",
        "commit": "abc",
        "command": "c",
        "minutes": 9,
        "dry_run": False,
        "plain_tokens_per_s": 40000.0,
        "agent_tokens_per_s": None,
        "shapes": {},
        "steps": [],
        **figures,
    }
    text = markdown(report)
    assert "| plain generation, SmolLM2-135M (tokens/s) | 40,000 |" in text
    assert "| agent workload, SmolLM2-135M (tokens/s) | - |" in text
    assert f"| after RL - after SFT (points, paired) | +33.3 [{low:+.1f}, {high:+.1f}] |" in text


def test_steps_not_asked_for_are_reported_as_such_and_the_report_keeps_its_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from codeloop.bench import gpu

    ran: list[str] = []

    def run(step: Step, logs: Path, deadline: float, report: dict) -> dict:
        ran.append(step.name)
        (logs / (step.name.replace(" ", "-") + ".log")).write_text("budget (9 min): ...\n")
        record = {"name": step.name, "outcome": "ok", "seconds": 1.0}
        report["steps"].append(record)
        return record

    monkeypatch.setattr(gpu, "_run", run)
    monkeypatch.setattr(gpu, "_tiny_recipe", lambda work: [])
    argv = ["--dry-run", "--steps", "recipe", "--out", str(tmp_path), "--logs", str(tmp_path)]
    assert gpu.main(argv) == 0
    assert ran == ["recipe"]
    (report_file,) = tmp_path.glob("gpu-*.json")
    assert report_file.name.endswith("-recipe.json")
    report = json.loads(report_file.read_text())
    assert set(REQUIRED) <= set(report) and report["plain_tokens_per_s"] is None
    skipped = {s["name"]: s.get("why") for s in report["steps"] if s["outcome"] == "skipped"}
    assert skipped == dict.fromkeys(
        ["gpu tests", "rollout smollm2", "rollout qwen2.5-0.5b", "rollout qwen2.5-1.5b"],
        "not asked for (--steps)",
    )
    assert report["recipe_budget"] == "budget (9 min): ..."
    assert "| rollout smollm2 | skipped | 0 |" in report_file.with_suffix(".md").read_text()
    with pytest.raises(SystemExit) as stopped:
        gpu.main(["--dry-run", "--steps", "recipe,rollout"])
    assert stopped.value.code == 2
    assert "unknown step rollout: choose from tests, rollouts, recipe" in capsys.readouterr().err


def test_the_mean_seconds_of_an_rl_step_and_of_its_parts(tmp_path: Path) -> None:
    from codeloop.bench.gpu import _rl_step_seconds

    assert _rl_step_seconds(tmp_path) is None
    for stage, times in (("1-stage1", [10.0, 14.0]), ("2-stage2", [18.0])):
        (tmp_path / stage).mkdir()
        rows = [{"step": 1, "timing/step_s": t, "timing/update_s": t / 2} for t in times]
        (tmp_path / stage / "metrics.jsonl").write_text(
            "\n".join(json.dumps(r) for r in rows) + "\nnot json\n"
        )
    assert _rl_step_seconds(tmp_path) == {"step_s": 14.0, "update_s": 7.0}


def test_rollouts_without_the_recipe_share_its_time() -> None:
    from codeloop.bench.gpu import CAPS_S, rollout_cap

    # 9 minutes left for three rollout steps: 180 s each, past their caps
    assert rollout_cap("rollout smollm2", 540.0, 3) == 180.0
    # little left: the cap still holds (the deadline cuts the step short anyway)
    assert rollout_cap("rollout qwen2.5-1.5b", 30.0, 1) == CAPS_S["rollout qwen2.5-1.5b"]


def test_the_gpu_step_collects_the_files_that_mark_gpu_tests_alone(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "test_card.py").write_text("@pytest.mark.gpu\ndef test_a(): ...\n")
    (tmp_path / "test_cpu.py").write_text("def test_b(): ...\n")
    (tmp_path / "gpu_helpers.py").write_text("pytestmark = pytest.mark.gpu\n")  # not a test file
    assert gpu_test_files(tmp_path) == [tmp_path / "engine" / "test_card.py"]
    tests = Path(__file__).parents[1]
    names = [f.relative_to(tests).as_posix() for f in gpu_test_files(tests)]
    assert names == ["engine/test_slot_cache.py", "trainer/test_gpu.py"]
