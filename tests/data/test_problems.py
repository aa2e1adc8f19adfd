import json
from pathlib import Path

import pytest

from codeloop.config import DataConfig
from codeloop.data.problems import DataError, Problem, load_problems


def _write(path: Path, rows: list[object]) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_fields_are_mapped(tmp_path: Path) -> None:
    source = _write(tmp_path / "p.jsonl", [{"q": "1 + 1?", "a": 2, "uid": 7}, "",
                                           {"q": "2 + 2?", "a": "4", "uid": "x"}])  # fmt: skip
    cfg = DataConfig(problem_field="q", answer_field="a", id_field="uid")
    assert load_problems(source, cfg) == [Problem("7", "1 + 1?", "2"), Problem("x", "2 + 2?", "4")]
    numbered = load_problems(source, DataConfig(problem_field="q", answer_field="a", id_field=""))
    assert [p.id for p in numbered] == ["0", "1"]


@pytest.mark.parametrize(
    ("rows", "error"),
    [
        ([{"id": 1, "problem": "x", "answer": "1"}, "{oops"], r"p.jsonl:2: not JSON"),
        ([{"id": 1, "problem": "x"}], r"p.jsonl:1: missing field 'answer'"),
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
