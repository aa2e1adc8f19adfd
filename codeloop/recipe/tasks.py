"""What `codeloop real` trains on with RL and scores, by `data.rl`: GSM8K's or a gym mix's.

- `data.rl` empty: RL screens the training split's problems after the SFT ones, and the
  development split is scored after SFT and after RL (the GSM8K recipe).
- `data.rl = "gym:MIX"` (`data/gym.py`): RL screens `Sizes.rl_problems` drawn from the mix with
  `trainer.seed`; `Sizes.eval_problems` held-out problems of the same mix, drawn with another
  seed and sharing no question with those, are scored after SFT and after RL (the run's
  points), and GSM8K's development split (`Sizes.dev_beside` of it) beside them at the same two
  points. The mix is kept as `gym_mix.json`, the problems as `gym_train.jsonl` and
  `gym_eval.jsonl` in the run directory (a rerun reads them back; `codeloop eval --data
  gym_eval.jsonl` scores them as the run did).
SFT is GSM8K's in both: its worked solutions teach the tool and the answer format.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from codeloop.config import Config, config_path
from codeloop.data import gym
from codeloop.data.curate import write_problems
from codeloop.data.problems import Problem, load_problems
from codeloop.files import write_atomic
from codeloop.intervals import compare, verdict
from codeloop.recipe.sizes import Sizes

EVAL_SEED = 1_000_003  # added to trainer.seed: the held-out gym problems' seed


class TaskData(NamedTuple):
    rl: list[Problem]  # what stage 1 screens
    held_out: list[Problem]  # scored after SFT and after RL: the run's points
    beside: dict[str, list[Problem]]  # scored at the same two points, reported beside


def task_data(
    cfg: Config, run_dir: Path, sizes: Sizes, train: list[Problem], dev: list[Problem]
) -> TaskData:
    """The run's problems (see the module docstring); GSM8K's `train` and `dev` splits."""
    if not cfg.data.rl:
        rl = train[sizes.sft_problems : sizes.sft_problems + sizes.rl_problems]
        return TaskData(rl, dev[: sizes.eval_problems], {})
    if not cfg.data.rl.startswith(gym.PREFIX):
        return TaskData(load_problems(cfg.data.rl, cfg.data), dev[: sizes.eval_problems], {})
    train_file, eval_file = run_dir / "gym_train.jsonl", run_dir / "gym_eval.jsonl"
    if not eval_file.is_file():
        spec = cfg.data.rl.removeprefix(gym.PREFIX)
        mix = gym.parse_mix(str(config_path(spec)) if spec.endswith((".json", ".toml")) else spec)
        rl = gym.generate(mix, sizes.rl_problems, cfg.trainer.seed, split="gym")
        seen = {p.problem for p in rl}
        held = gym.held_out(mix, sizes.eval_problems, cfg.trainer.seed + EVAL_SEED, seen)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "gym_mix.json", gym.mix_json(mix))
        write_problems(train_file, rl)
        write_problems(eval_file, held)
    return TaskData(
        load_problems(str(train_file)),
        load_problems(str(eval_file)),
        {"gsm8k_dev": dev[: sizes.dev_beside]},
    )


def by_task(
    problems: Sequence[Problem], first: Mapping[str, Any], last: Mapping[str, Any]
) -> dict[str, Any]:
    """The paired difference of two points overall and per task (gym problems), in points:
    before, after, difference, its 95% interval and p-value, problems."""
    tasks: dict[str, list[str]] = defaultdict(list)
    for p in problems:
        tasks[p.task or "-"].append(p.id)
    result = {"overall": paired(first["per_problem"], last["per_problem"])}
    for task, ids in sorted(tasks.items()):
        before = {i: first["per_problem"][i] for i in ids if i in first["per_problem"]}
        after = {i: last["per_problem"][i] for i in ids if i in last["per_problem"]}
        if set(before) & set(after):
            result[task] = paired(before, after)
    return result


def paired(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    found = compare(before, after)
    return {
        "before": 100 * found["a"],
        "after": 100 * found["b"],
        "difference": 100 * found["difference"],
        "interval95": [100 * x for x in found["interval95"]],
        "p_value": found["p_value"],
        "problems": found["problems"],
        "verdict": verdict(found, "after SFT", "after RL"),
    }


def report_lines(name: str, table: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line a task (overall first): before -> after, the difference and its interval."""
    lines = []
    for task, row in table.items():
        low, high = row["interval95"]
        lines.append(
            f"{name} {task}: {row['before']:.1f}% -> {row['after']:.1f}%, "
            f"{row['difference']:+.1f} points [{low:+.1f}, {high:+.1f}], "
            f"p = {row['p_value']:.2g}, {row['problems']} problems"
        )
    return lines


def read_beside(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The beside sets' points so far (`beside.json`)."""
    found: dict[str, list[dict[str, Any]]] = json.loads(path.read_text()) if path.is_file() else {}
    return found
