"""reasoning-gym's procedural tasks as problems (`pip install 'codeloop[gym]'`).

A mix names gym tasks, each with its config (the task's own dataclass fields: `min_value`,
`max_terms`, ...) and a weight. It is spelled on the command line as `gym:lcm,gcd` (each task at
its default config, weight 1) or `gym:FILE` for a mix file: JSON, the list that a run keeps as
`gym_mix.json` (`[{"task": "lcm", "config": {"max_value": 100}, "weight": 1.0}, ...]`), or TOML
with the same keys under `[[tasks]]`. `generate` draws problems from a mix with a seed
(reasoning-gym's `composite` dataset: the same mix and seed always give the same problems);
`held_out` draws from another seed and drops any problem whose question is in a given set, so
training and evaluation never share a question. Each problem carries its task and the metadata
the task's scorer reads (`Problem.task`, `Problem.metadata`, JSON), so a problem file holding
them (`curate.write_problems`) is scored by that task's `score_answer` wherever it is read
(`reward/task.py`). A wrong task name or config key is a `DataError` naming it and the valid
ones; nothing is dropped silently.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codeloop.data.problem import DataError, Problem

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PREFIX = "gym:"
INSTALL = "reasoning-gym tasks need the gym extra: pip install 'codeloop[gym]'"


@dataclass(frozen=True)
class GymTask:
    """One task of a mix: its name, its config (fields of the task's config class; missing ones
    keep their defaults) and its weight in the mix."""

    task: str
    config: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0


def _registry() -> dict[str, Any]:
    """reasoning-gym's tasks: name -> (dataset class, config class)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise DataError(INSTALL) from None
    return dict(DATASETS)


def parse_mix(spec: str) -> list[GymTask]:
    """The mix that `gym:...` names (with or without the prefix): task names separated by
    commas, or a mix file (.json or .toml). Checked (`check_mix`)."""
    body = spec.removeprefix(PREFIX).strip()
    if body.endswith((".json", ".toml")):
        return read_mix(Path(body))
    names = [name.strip() for name in body.split(",") if name.strip()]
    if not names:
        raise DataError(f"{spec!r}: name gym tasks after 'gym:' (gym:lcm,gcd) or a mix file")
    mix = [GymTask(name) for name in names]
    check_mix(mix, spec)
    return mix


def read_mix(path: Path) -> list[GymTask]:
    """A mix file: JSON (a list of objects) or TOML (`[[tasks]]`), each with `task` and
    optionally `config` (a table) and `weight` (a positive number)."""
    try:
        text = path.read_text()
    except OSError as err:
        raise DataError(f"{path}: cannot read the gym mix ({err.strerror})") from None
    try:
        entries = tomllib.loads(text).get("tasks") if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: not a readable gym mix ({err})") from None
    if not isinstance(entries, list) or not entries:
        raise DataError(f"{path}: expected a non-empty list of tasks ({_MIX_SHAPE})")
    mix = [_entry(item, f"{path}: task {i + 1}") for i, item in enumerate(entries)]
    check_mix(mix, str(path))
    return mix


_MIX_SHAPE = '[{"task": "lcm", "config": {...}, "weight": 1.0}, ...]'
_KEYS = {"task", "config", "weight"}


def _entry(item: Any, where: str) -> GymTask:
    if not isinstance(item, dict) or not isinstance(item.get("task"), str):
        raise DataError(f"{where}: expected an object with a task name ({_MIX_SHAPE})")
    if extra := set(item) - _KEYS:
        raise DataError(f"{where}: unknown keys {sorted(extra)} (valid: {sorted(_KEYS)})")
    config, weight = item.get("config", {}), item.get("weight", 1.0)
    if not isinstance(config, dict):
        raise DataError(f"{where}: config must be a table of the task's settings")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise DataError(f"{where}: weight must be a positive number, got {weight!r}")
    return GymTask(item["task"], dict(config), float(weight))


def check_mix(mix: list[GymTask], where: str) -> None:
    """Each task exists and its config names only fields of the task's config class, with
    values the class accepts; else a `DataError` naming the task or key and the valid ones."""
    registry = _registry()
    for task in mix:
        if task.task not in registry:
            raise DataError(
                f"{where}: no gym task {task.task!r}; valid: {', '.join(sorted(registry))}"
            )
        config_class = registry[task.task][1]
        valid = {f.name for f in dataclasses.fields(config_class)} - {"seed", "size"}
        if unknown := sorted(set(task.config) - valid):
            raise DataError(
                f"{where}: {task.task} has no setting {', '.join(unknown)}; "
                f"valid: {', '.join(sorted(valid))}"
            )
        try:
            config = config_class(**task.config, seed=0, size=1)
            if hasattr(config, "validate"):  # most tasks' configs check their ranges
                config.validate()
        except (AssertionError, ValueError, TypeError) as err:
            raise DataError(f"{where}: {task.task} {task.config}: {err or 'invalid'}") from None


def generate(mix: list[GymTask], count: int, seed: int, *, split: str = "gym") -> list[Problem]:
    """`count` problems drawn from `mix` with `seed` (tasks in proportion to their weights),
    each carrying its task and metadata; ids `split-seed-index`."""
    from reasoning_gym import create_dataset
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec(t.task, t.weight, dict(t.config)) for t in mix]
    dataset = create_dataset("composite", size=count, seed=seed, datasets=specs)
    problems = []
    for index, entry in enumerate(dataset):
        metadata = dict(entry["metadata"])
        task = metadata.pop("source_dataset")
        try:
            text = json.dumps(metadata)
        except TypeError as err:  # the scorer would read back something else
            raise DataError(f"gym task {task}: its metadata is not JSON ({err})") from None
        problems.append(
            Problem(
                f"{split}-{seed}-{index}",
                entry["question"],
                str(entry["answer"]),
                task=task,
                metadata=text,
            )
        )
    return problems


def held_out(
    mix: list[GymTask], count: int, seed: int, seen: set[str], *, split: str = "gym-eval"
) -> list[Problem]:
    """`count` problems from `mix` with `seed` whose questions are not in `seen` (nor repeated):
    an evaluation set disjoint from the training problems. Draws more when some collide."""
    drawn = count
    for _ in range(8):
        kept: list[Problem] = []
        questions = set(seen)
        for problem in generate(mix, drawn, seed, split=split):
            if problem.problem not in questions:
                questions.add(problem.problem)
                kept.append(problem)
                if len(kept) == count:
                    return kept
        drawn *= 2
    raise DataError(
        f"the gym mix has fewer than {count} questions unlike the training ones "
        f"(found {len(kept)} in {drawn // 2} drawn): widen its configs' ranges"
    )


def mix_json(mix: list[GymTask]) -> str:
    """The mix as `gym_mix.json` holds it (`read_mix` reads it back)."""
    return json.dumps([dataclasses.asdict(t) for t in mix], indent=2) + "\n"
