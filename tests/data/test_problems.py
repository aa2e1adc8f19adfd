import json
from pathlib import Path

import pytest

from codeloop.config import DataConfig
from codeloop.data.problems import DataError, Problem, load_problems


def _write(path: Path, rows: list[object]) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_fields_are_mapped(tmp_path: Path) -> None:
    source = _write(
        tmp_path / "p.jsonl",
        [{"q": "1 + 1?", "a": 2, "uid": 7}, "", {"q": "2 + 2?", "a": "4", "uid": "x"}],
    )
    cfg = DataConfig(problem_field="q", answer_field="a", id_field="uid")
    assert load_problems(source, cfg) == [Problem("7", "1 + 1?", "2"), Problem("x", "2 + 2?", "4")]
    numbered = load_problems(source, DataConfig(problem_field="q", answer_field="a", id_field=""))
    assert [p.id for p in numbered] == ["0", "1"]


@pytest.mark.parametrize(
    ("rows", "error"),
    [
        ([{"id": 1, "problem": "x", "answer": "1"}, "{oops"], r"p.jsonl:2: not JSON"),
        ([{"id": 1, "problem": "x"}], r"p.jsonl:1: missing field 'answer' .*set data.answer_field"),
        ([{"problem": "x", "answer": "1"}], r"missing field 'id' .*data.id_field = \"\" to number"),
        ([[1, 2]], r"p.jsonl:1: expected a JSON object, got list"),
    ],
)
def test_errors_name_the_file_and_line(tmp_path: Path, rows: list[object], error: str) -> None:
    with pytest.raises(DataError, match=error):
        load_problems(_write(tmp_path / "p.jsonl", rows))


def test_missing_file_and_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        load_problems(str(tmp_path / "missing.jsonl"))
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="expected a .jsonl or .parquet file"):
        load_problems(str(tmp_path / "p.csv"))


def test_gsm8k_in_its_original_format(tmp_path: Path) -> None:
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nSo 48+24 = <<48+24=72>>72."
    source = _write(
        tmp_path / "gsm8k.jsonl",
        [
            {"question": "How many clips?", "answer": solution + "\n#### 72"},
            {"question": "How many dollars?", "answer": "It costs 1,000 + 250.\n#### 1,250"},
        ],
    )
    assert load_problems(source) == [
        Problem("0", "How many clips?", "72", solution),
        Problem("1", "How many dollars?", "1250", "It costs 1,000 + 250."),
    ]
    empty = _write(tmp_path / "bad.jsonl", [{"question": "q", "answer": "work\n#### "}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: GSM8K answer with an empty '####' line"):
        load_problems(empty)


def test_the_packaged_gsm8k_split_loads_whole() -> None:
    import hashlib

    from codeloop.data.problems import GSM8K_TRAIN

    # verbatim from openai/grade-school-math (train.jsonl at 3101c7d)
    digest = hashlib.sha256(GSM8K_TRAIN.read_bytes()).hexdigest()
    assert digest == "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465"
    assert "MIT License" in GSM8K_TRAIN.with_name("LICENSE").read_text()
    problems = load_problems(str(GSM8K_TRAIN))
    assert len(problems) == 7473  # GSM8K's training split
    first = problems[0]
    assert first.answer == "72" and first.problem.startswith("Natalia sold clips")
    assert all(p.answer.lstrip("-").isdigit() and p.solution for p in problems)


def test_the_development_split_is_fixed_and_disjoint() -> None:
    from codeloop.data.problems import split_dev

    problems = [Problem(str(i), f"q{i}", str(i)) for i in range(100)]
    train, dev = split_dev(problems, 10, seed=0)
    assert len(train) == 90 and len(dev) == 10
    assert {p.id for p in train}.isdisjoint(p.id for p in dev)
    assert [p.id for p in train] == sorted((p.id for p in train), key=int)  # order kept
    assert split_dev(problems, 10, seed=0) == (train, dev)  # the same split every time
    assert split_dev(problems, 10, seed=1)[1] != dev
    with pytest.raises(DataError, match="leaves no training problems"):
        split_dev(problems, 100)


def test_a_hub_name_with_the_hub_unreachable_fails_at_once_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not half a minute of the hub client's retries: one refused connection names the hub."""
    pytest.importorskip("datasets", reason="without datasets a hub name fails before the hub")
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(DataError) as raised:
        load_problems("owner/name")
    assert str(raised.value) == (
        "owner/name: no such file; read as a hub dataset name, it needs network access to the "
        "hub (127.0.0.1: Connection refused; HF_HUB_OFFLINE=1 reads a copy cached before)"
    )
