"""Problems (id, text, gold answer) from a JSONL or Parquet file, or a hub dataset name.

Fields are mapped by `DataConfig` (`problem_field`, `answer_field`, `id_field`; an empty id
field numbers the problems). A line that is not JSON, or a record without a mapped field, is an
error that names the file and the line; nothing is skipped silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codeloop.config import DataConfig


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str


class DataError(ValueError):
    """A problem file that cannot be read as the config says."""


def _records(source: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) pairs; `where` is `file:line` or `file:row`."""
    path = Path(source)
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise DataError(f"{source}: no such file")
        records = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append((f"{source}:{number}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise DataError(f"{source}:{number}: not JSON ({err.msg})") from err
        return records
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # optional: installed with `datasets`

        rows = pq.read_table(path).to_pylist()
        return [(f"{source}:row {i}", row) for i, row in enumerate(rows, 1)]
    if path.exists():
        raise DataError(f"{source}: expected a .jsonl or .parquet file")
    import datasets  # a hub name: needs the `datasets` package and network access

    split = datasets.load_dataset(source, split="train")
    return [(f"{source}:row {i}", dict(row)) for i, row in enumerate(split, 1)]


def load_problems(source: str, cfg: DataConfig | None = None) -> list[Problem]:
    cfg = cfg or DataConfig()
    problems = []
    for index, (where, record) in enumerate(_records(source)):
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        for field in filter(None, (cfg.problem_field, cfg.answer_field, cfg.id_field)):
            if field not in record:
                raise DataError(f"{where}: missing field {field!r} (have {sorted(record)})")
        problem_id = str(record[cfg.id_field]) if cfg.id_field else str(index)
        problems.append(
            Problem(problem_id, str(record[cfg.problem_field]), str(record[cfg.answer_field]))
        )
    return problems
