"""`codeloop view`: the page is rendered in headless Chromium and its content checked."""

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from eval_helpers import PROBLEMS, read_jsonl

from codeloop.algo.group import Group
from codeloop.engine.model import tiny_model
from codeloop.eval.entropy import analyse_file
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer.rl import _dump
from codeloop.types import Trajectory

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)"
)
HOSTILE = "</script><script>document.title='pwned'</script><b>bold</b>"


@pytest.fixture(scope="module")
def run_dir(
    scripted_run: tuple[Path, dict], fmt: PromptFormat, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A training stage (metrics + a step dump written by the trainer) and an evaluation."""
    eval_out, _ = scripted_run
    root = tmp_path_factory.mktemp("run")
    shutil.copytree(eval_out, root / "eval")
    model = tiny_model(len(fmt.tokenizer), hidden_size=32, layers=1, heads=4)
    entropy = analyse_file(model, fmt.tokenizer, root / "eval" / "trajectories.jsonl")
    (root / "eval" / "entropy.json").write_text(json.dumps(entropy))
    records = read_jsonl(root / "eval" / "trajectories.jsonl")
    fields = [{k: v for k, v in r.items() if k not in ("problem", "gold")} for r in records]
    trajectories = [Trajectory.from_dict(f) for f in fields if f["prompt_id"] == "p2"]
    trajectories[3].text = HOSTILE
    group = Group(PROBLEMS[2], trajectories, [trajectories[0], trajectories[3]], [1.0, -1.0])
    stage = root / "1-stage"
    (stage / "trajectories").mkdir(parents=True)
    (stage / "trajectories" / "step_000001.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in _dump([group]))
    )
    metrics = [{"step": s, "reward/mean": 0.1 * s, "loss/policy": 1.0 / s} for s in (1, 2, 3)]
    (stage / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    done = subprocess.run(
        [sys.executable, "-m", "codeloop", "view", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "24 trajectories" in done.stdout  # 20 evaluated + 4 from the training step
    return root


def _dom(page: Path, fragment: str = "") -> str:
    assert CHROMIUM is not None
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--dump-dom",
            page.as_uri() + fragment,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _summaries(dom: str) -> list[str]:
    return [html.unescape(s) for s in re.findall(r"<summary>(.*?)</summary>", dom)]


@needs_chromium
def test_the_page_lists_every_trajectory_with_its_content(run_dir: Path) -> None:
    dom = _dom(run_dir / "view.html")
    summaries = _summaries(dom)
    assert len(summaries) == 24
    assert "24 of 24 trajectories" in dom
    title = re.search(r"<title>(.*?)</title>", dom).group(1)  # type: ignore[union-attr]
    assert title.startswith("codeloop: ")  # the hostile text did not run: it stayed text
    assert html.escape(HOSTILE, quote=False) in dom
    assert "What is 3 + 3?" in dom and "gold: 6" in dom
    assert "ZeroDivisionError" in dom  # a tool call's stderr
    assert dom.count('class="code"') == 13 + 2  # every call's code: 13 evaluated, 2 in step 1
    step = [s for s in summaries if s.startswith("1-stage step 1")]
    assert len(step) == 4 and sum("kept" in s and "dropped" not in s for s in step) == 2
    assert "p_err 0" in step[0] and "p_format 0" in step[0]


@needs_chromium
def test_filters_from_the_url_fragment(run_dir: Path) -> None:
    correct = _summaries(_dom(run_dir / "view.html", "#reward=1"))
    assert len(correct) == 12  # 10 evaluated + 2 in the training step
    assert all("reward 1" in s for s in correct)
    wrong_eval = _summaries(_dom(run_dir / "view.html", "#reward=0&source=eval"))
    assert len(wrong_eval) == 10 and all(s.startswith("eval ·") for s in wrong_eval)
    assert _summaries(_dom(run_dir / "view.html", "#status=truncated_length")) == []


@needs_chromium
def test_plots_and_entropy_colours(run_dir: Path) -> None:
    dom = _dom(run_dir / "view.html")
    assert 'data-metric="reward/mean"' in dom and 'data-metric="loss/policy"' in dom
    assert "reward/mean: 0.3 (range 0.1 to 0.3)" in dom
    assert "High-entropy tokens" in dom and "right after a tool response" in dom
    assert dom.count("entropy ") > 100  # coloured tokens carry their entropy as a title
    assert 'class="tok"' in dom


def test_too_many_trajectories_are_counted_not_lost(run_dir: Path) -> None:
    from codeloop.eval.viewer import render

    page, shown, total = render(run_dir, max_trajectories=5)
    assert (shown, total) == (5, 24)
    data = json.loads(re.search(r'id="data">(.*?)</script>', page, re.S).group(1))  # type: ignore[union-attr]
    assert [t["source"] for t in data["trajectories"]] == ["eval"] * 5  # the newest: evaluation


def test_missing_run_directory_is_an_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "codeloop", "view", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "no such run directory" in done.stderr


def test_a_directory_without_trajectories_is_an_error_not_an_empty_page(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')  # metrics, no rollouts
    done = subprocess.run(
        [sys.executable, "-m", "codeloop", "view", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.startswith(f"codeloop view: {tmp_path}: no trajectories in it or below it")
    assert not (tmp_path / "view.html").exists()
