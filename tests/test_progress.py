"""Progress: a bar on a terminal, plain lines (no carriage returns) anywhere else."""

import pytest
from tqdm import tqdm

from codeloop import progress
from codeloop.progress import Lines, progress_bar


def test_redirected_output_gets_plain_lines(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    with progress_bar(total=4, desc="eval", unit="problem") as bar:  # a line at the start
        assert isinstance(bar, Lines)
        now[0] = 5.0
        bar.update()  # too soon for a line
        now[0] = 31.0
        bar.update()  # 31 s after the last line: one
        now[0] = 32.0
        bar.update(2)  # too soon
    err = capsys.readouterr().err  # close: the last line
    assert "\r" not in err
    assert err.splitlines() == ["eval: 0/4 problem", "eval: 2/4 problem", "eval: 4/4 problem"]


def test_a_line_waits_for_the_postfix_of_its_update_and_never_repeats(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    with progress_bar(total=3, desc="sft", unit="step") as bar:
        for step, loss in enumerate((2.0, 1.5, 1.0), 1):
            now[0] = 40.0 * step  # every update is due
            bar.update()
            bar.set_postfix(loss=f"{loss:.1f}")  # as the trainers do: update, then the loss
    assert capsys.readouterr().err.splitlines() == [
        "sft: 0/3 step",
        "sft: 1/3 step",  # the first update cannot know a postfix follows
        "sft: 2/3 step (loss=1.5)",
        "sft: 3/3 step (loss=1.0)",  # once: closing repeats nothing
    ]


def test_a_transient_bar_prints_only_work_that_lasts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    with progress_bar(total=8, desc="rollout", unit="traj", leave=False) as bar:
        bar.update(8)  # a quick one: nothing at all
    assert capsys.readouterr().err == ""
    with progress_bar(total=8, desc="rollout", unit="traj", leave=False) as bar:
        now[0] = 45.0
        bar.update(3)  # a long one: a line when due, and its end
        bar.update(5)
    assert capsys.readouterr().err.splitlines() == ["rollout: 3/8 traj", "rollout: 8/8 traj"]


def test_an_iterable_counts_its_items(capsys: pytest.CaptureFixture[str]) -> None:
    assert list(progress_bar(["a", "b", "c"], desc="entropy", unit="trajectory")) == ["a", "b", "c"]
    assert capsys.readouterr().err.splitlines()[-1] == "entropy: 3/3 trajectory"


def test_a_terminal_gets_tqdm_and_disabled_stays_silent(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with progress_bar(total=2, disable=True) as bar:
        bar.update()
    assert isinstance(bar, tqdm) and capsys.readouterr().err == ""
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True)
    with progress_bar(total=2, desc="sft") as bar:
        assert isinstance(bar, tqdm)
