"""Problems (id, text, gold answer) from a JSONL or Parquet file, or a hub dataset name.

Fields are mapped by `DataConfig` (`problem_field`, `answer_field`, `id_field`; an empty id
field numbers the problems). GSM8K's original format is read as it is: a record with `question`
and an `answer` whose last line is `#### 72` (and none of the mapped fields) is the problem
`question` with gold answer `72` (thousands separators dropped), its worked solution kept as
`Problem.solution`, and the line number as its id; the hub names `gsm8k` and `openai/gsm8k`
load the `main` configuration. A line that is not JSON, or a record without a mapped field, is
an error that names the file and the line; nothing is skipped silently. A record with `task` (a
reasoning-gym task's name) and `metadata` is scored by that task (`data/gym.py`); the source
`gym:TASK,TASK` or `gym:MIX_FILE` draws `data.gym_problems` of them with `data.gym_seed`. An
empty `answer_field` (or `problem_field`) reads no gold answer (no text): an environment scores
those problems (`rollout.environment`); each problem keeps its line's keys (`Problem.row`).
"""

from __future__ import annotations

import json
import os
import random
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from codeloop.config import DataConfig
from codeloop.data.problem import DataError as DataError  # re-exported: the readers' error
from codeloop.data.problem import Problem as Problem
from codeloop.errors import read_text_input

GSM8K_TRAIN = Path(__file__).parent / "gsm8k" / "train.jsonl"  # packaged; MIT, OpenAI 2021


def _records(source: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) pairs; `where` is `file:line` or `file:row`."""
    path = Path(source)
    if not source:
        raise DataError(
            "no problem file given: set data.train (a JSONL or Parquet file, or a hub dataset name)"
        )
    if not path.exists() and _looks_like_a_path(source):  # never a minute of hub retries
        raise DataError(f"{source}: no such file")
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(read_text_input(path, "problems").splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append((f"{source}:{number}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise DataError(f"{source}:{number}: not JSON ({err.msg})") from err
        return records
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional: the `hub` extra
        except ImportError:
            raise DataError(
                f"{source}: reading Parquet needs pyarrow: pip install "
                "'codeloop[hub]' (or pip install pyarrow)"
            ) from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow's errors on a bad file are many
            raise DataError(f"{source}: not a readable Parquet file ({err})") from None
        return [(f"{source}:row {i}", row) for i, row in enumerate(rows, 1)]
    if path.exists():
        raise DataError(f"{source}: expected a .jsonl or .parquet file")
    try:
        import datasets  # a hub name: needs the `datasets` package and network access
    except ImportError:
        raise DataError(
            f"{source}: no such file; read as a hub dataset name, it needs the "
            "`datasets` package: pip install 'codeloop[hub]'"
        ) from None
    if why := _hub_unreachable():  # else the hub client retries for half a minute, loudly
        raise DataError(
            f"{source}: no such file; read as a hub dataset name, it needs network access to "
            f"the hub ({why}; HF_HUB_OFFLINE=1 reads a copy cached before)"
        )
    try:
        if source in GSM8K_HUB_NAMES:
            split = datasets.load_dataset("openai/gsm8k", "main", split="train")
        else:
            split = datasets.load_dataset(source, split="train")
    except Exception as err:  # noqa: BLE001 - the hub's errors are many; all mean "not here"
        raise DataError(
            f"{source}: no such file, and not loadable as a hub dataset "
            f"({type(err).__name__}: {err})"
        ) from err
    return [(f"{source}:row {i}", dict(row)) for i, row in enumerate(split, 1)]


def load_problems(source: str, cfg: DataConfig | None = None) -> list[Problem]:
    cfg = cfg or DataConfig()
    if source.startswith("gym:"):  # reasoning-gym tasks, drawn now (data/gym.py)
        from codeloop.data import gym

        return gym.generate(gym.parse_mix(source), cfg.gym_problems, cfg.gym_seed)
    problems = []
    for index, (where, record) in enumerate(_records(source)):
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if _is_gsm8k(record, cfg):
            problems.append(_gsm8k(record, str(index), where))
            continue
        for field in filter(None, (cfg.problem_field, cfg.answer_field, cfg.id_field)):
            if field not in record:
                key = {
                    cfg.problem_field: "problem_field",
                    cfg.answer_field: "answer_field",
                    cfg.id_field: "id_field",
                }[field]
                hint = (
                    ' or data.id_field = "" to number the problems by line'
                    if key == "id_field"
                    else ""
                )
                raise DataError(
                    f"{where}: missing field {field!r} (have {sorted(record)}; "
                    f"set data.{key} to the field that holds it{hint})"
                )
        problem_id = str(record[cfg.id_field]) if cfg.id_field else str(index)
        text = str(record[cfg.problem_field]) if cfg.problem_field else ""
        answer = str(record[cfg.answer_field]) if cfg.answer_field else ""
        problem = Problem(problem_id, text, answer, row=record)
        problems.append(_with_task(problem, record, where) if record.get("task") else problem)
    if not problems:
        raise DataError(f"{source}: holds no problems")
    return problems


def _with_task(problem: Problem, record: dict[str, Any], where: str) -> Problem:
    """A line with `task` (a reasoning-gym task) and `metadata` (an object, as the task yields
    it): the problem is scored by that task (the task checked now, so a bad name fails here)."""
    from codeloop.data import gym

    task, metadata = record["task"], record.get("metadata", {})
    if not isinstance(task, str) or not isinstance(metadata, dict):
        raise DataError(f"{where}: 'task' must be a gym task's name and 'metadata' an object")
    gym.check_mix([gym.GymTask(task)], where)
    return replace(problem, task=task, metadata=json.dumps(metadata))


def _hub_unreachable(timeout_s: float = 3.0) -> str:
    """Why the dataset hub (`HF_ENDPOINT`, default huggingface.co) cannot be reached now; ''
    when it can, or when `HF_HUB_OFFLINE` asks for the local cache alone."""
    if any(os.environ.get(name, "0") not in ("0", "") for name in _OFFLINE):
        return ""
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout_s).close()
    except OSError as err:
        return f"{url.hostname}: {err.strerror or err}"
    return ""


def _looks_like_a_path(source: str) -> bool:
    """A file path rather than a hub name (`owner/name`): absolute or relative to `.`/`~`, with
    a file suffix, or more than one folder deep."""
    return source.startswith(("/", ".", "~")) or bool(Path(source).suffix) or source.count("/") > 1


GSM8K_HUB_NAMES = ("gsm8k", "openai/gsm8k")
_OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")  # the hub clients' own switches


def _is_gsm8k(record: dict[str, Any], cfg: DataConfig) -> bool:
    mapped = {cfg.problem_field, cfg.id_field} - {"", "answer", "question"}
    return (
        "question" in record
        and "\n#### " in str(record.get("answer", ""))
        and not mapped & set(record)
    )


def _gsm8k(record: dict[str, Any], problem_id: str, where: str) -> Problem:
    solution, _, final = str(record["answer"]).rpartition("\n#### ")
    answer = final.strip().replace(",", "")
    if not answer:
        raise DataError(f"{where}: GSM8K answer with an empty '####' line")
    return Problem(problem_id, str(record["question"]), answer, solution.strip())


def split_dev(
    problems: list[Problem], size: int, seed: int = 0
) -> tuple[list[Problem], list[Problem]]:
    """(train, dev): `size` problems drawn by a seeded shuffle are held out, the rest kept in
    their order; the same problems and seed always give the same split."""
    if size >= len(problems):
        raise DataError(
            f"a development split of {size} leaves no training problems (there are {len(problems)})"
        )
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    held = set(order[:size])
    dev = [problems[i] for i in sorted(held)]
    return [p for i, p in enumerate(problems) if i not in held], dev
