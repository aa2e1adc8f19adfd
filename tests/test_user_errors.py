"""A user's mistakes on the command line end in one line naming the input, exit status 2: never
a traceback, never a silent success on empty input."""

from pathlib import Path

import pytest

from codeloop.cli import main


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "binary.jsonl").write_bytes(bytes(range(128, 256)))
    (tmp_path / "folder.jsonl").mkdir()
    (tmp_path / "not.gguf").write_text("not a model")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "ok.jsonl").write_text('{"id": "1", "problem": "2 + 2?", "answer": "4"}\n')
    (tmp_path / "broken_run" / "trajectories").mkdir(parents=True)
    (tmp_path / "broken_run" / "trajectories" / "step_000001.jsonl").write_text("{oops\n")
    return {
        name: str(tmp_path / name)
        for name in (
            "empty.jsonl",
            "blank.jsonl",
            "binary.jsonl",
            "folder.jsonl",
            "not.gguf",
            "a_file",
            "ok.jsonl",
            "broken_run",
        )
    }


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["data", "stats", "{empty.jsonl}"], "problems: {empty.jsonl} is empty"),
        (["data", "stats", "{blank.jsonl}"], "problems: {blank.jsonl} is empty"),
        (["data", "stats", "{binary.jsonl}"], "{binary.jsonl} is not UTF-8 text"),
        (["data", "stats", "{folder.jsonl}"], "{folder.jsonl} is a directory; expected a file"),
        (["data", "stats", "no/such/file.jsonl"], "no/such/file.jsonl: no such file"),
        (["data", "stats", "./data"], "./data: no such file"),  # a path: never a hub lookup
        (["train"], "no problem file given: set data.train"),
        (["sft"], "sft.data: not set"),
        (["sft", "--sft.data", "{binary.jsonl}"], "sft.data: {binary.jsonl} is not UTF-8 text"),
        (["import-gguf", "{not.gguf}", "--out", "{a_file}.out"], "not a GGUF file"),
        (["config", "show", "{folder.jsonl}"], "is a directory; expected a TOML file"),
        (["config", "show", "{binary.jsonl}"], "not valid TOML"),
        (["eval", "--model", "{a_file}", "--data", "{ok.jsonl}"], "model '{a_file}'"),
        (["demo", "--run-dir", "{a_file}"], "{a_file}/"),  # a file where a folder goes
        (["view", "no/such/run"], "no such run directory: no/such/run"),
        (["view", "{broken_run}"], "step_000001.jsonl:1: not JSON"),
    ],
)
def test_a_mistake_is_one_line_and_exit_2(
    argv: list[str], expected: str, inputs: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    def fill(text: str) -> str:
        for name, path in inputs.items():
            text = text.replace("{" + name + "}", path)
        return text

    argv = [fill(a) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith(f"codeloop {argv[0]}") and fill(expected) in err


def test_a_gpu_option_without_a_gpu_says_so_and_runs_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from codeloop.bench import rollout
    from codeloop.recipe import real

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(real, "main", lambda *args: pytest.fail("the recipe ran"))
    monkeypatch.setattr(rollout, "_load", lambda args: pytest.fail("the bench loaded a model"))
    assert main(["real", "--gpu"]) == 2
    assert main(["bench", "rollout", "--device", "cuda"]) == 2
    recipe, bench = capsys.readouterr().err.strip().split("\n")
    version = torch.__version__
    assert recipe == (
        f"codeloop real: --gpu needs a GPU, and torch {version} is a CPU build: "
        "install a CUDA build of torch (docs/installation.md), or leave --gpu out "
        "for the recipe sized for a CPU"
    )
    assert bench.startswith("codeloop bench rollout: --device cuda needs a GPU")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert main(["real", "--gpu"]) == 2
    assert "is a CUDA 12.8 build that finds no GPU" in capsys.readouterr().err
