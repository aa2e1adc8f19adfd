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
SFT is GSM8K's in both: its worked solutions teach the tool and the answer format. With
`data.sft_gym` (a gym mix), `Sizes.sft_gym_problems` problems of those families, drawn with
another seed, become SFT demonstrations too (`gym_sft.py`), kept as `gym_sft.jsonl`. With
`data.held_out_gym`, `Sizes.held_out_family_problems` problems of families in neither SFT nor
RL are scored beside the others (`held_out_families`), as are `Sizes.sft_family_problems` of the
SFT families (`sft_families`, other seeds than the demonstrations'). The three sets of
families are kept as `families.json` (`{"sft": [...], "rl": [...], "held_out": [...]}`, task
names as reasoning-gym spells them); a family in two of them is a `ConfigError` naming it.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from codeloop.config import Config, ConfigError, config_path
from codeloop.data import gym
from codeloop.data.curate import write_problems
from codeloop.data.problems import Problem, load_problems
from codeloop.files import write_atomic
from codeloop.intervals import compare, verdict
from codeloop.recipe.sizes import Sizes

EVAL_SEED = 1_000_003  # added to trainer.seed: the held-out gym problems' seed
SFT_SEED = 2_000_003  # added to trainer.seed: the gym SFT demonstrations' problems
FAMILIES_SEED = 3_000_003  # added to trainer.seed: the held-out families' problems
SFT_EVAL_SEED = 4_000_003  # added to trainer.seed: the SFT families' scored problems
HELD_OUT_FAMILIES = "held_out_families"  # names among the sets scored beside
SFT_FAMILIES = "sft_families"


class TaskData(NamedTuple):
    rl: list[Problem]  # what stage 1 screens
    held_out: list[Problem]  # scored after SFT and after RL: the run's points
    beside: dict[str, list[Problem]]  # scored at the same two points, reported beside
    sft: list[Problem] = []  # gym problems whose programs become SFT demonstrations
    families: dict[str, list[str]] = {}  # `families.json`: sft, rl, held_out


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
    sft_file, families_file = run_dir / "gym_sft.jsonl", run_dir / "held_out_families.jsonl"
    sft_eval_file = run_dir / "sft_families.jsonl"
    if not eval_file.is_file():
        mix = gym_mix(cfg.data.rl)
        sft_mix, family_mix = gym_mix(cfg.data.sft_gym), gym_mix(cfg.data.held_out_gym)
        families = family_sets(sft_mix, mix, family_mix)
        seed = cfg.trainer.seed
        rl = gym.generate(mix, sizes.rl_problems, seed, split="gym")
        seen = {p.problem for p in rl}
        held = gym.held_out(mix, sizes.eval_problems, seed + EVAL_SEED, seen)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "gym_mix.json", gym.mix_json(mix))
        write_atomic(run_dir / "families.json", json.dumps(families, indent=2) + "\n")
        if sft_mix:
            sft = gym.generate(sft_mix, sizes.sft_gym_problems, seed + SFT_SEED, split="gym-sft")
            write_problems(sft_file, sft)
            if sizes.sft_family_problems:  # scored beside: what SFT's demonstrations taught
                seen = {p.problem for p in sft}
                count = sizes.sft_family_problems
                scored = gym.held_out(
                    sft_mix, count, seed + SFT_EVAL_SEED, seen, split="gym-sft-eval"
                )
                write_problems(sft_eval_file, scored)
        if family_mix:
            count, split = sizes.held_out_family_problems, "gym-families"
            write_problems(
                families_file, gym.generate(family_mix, count, seed + FAMILIES_SEED, split=split)
            )
        write_problems(train_file, rl)
        write_problems(eval_file, held)
    else:
        _check_kept_families(cfg, run_dir)
    beside = {"gsm8k_dev": dev[: sizes.dev_beside]}
    if sft_eval_file.is_file():
        beside[SFT_FAMILIES] = load_problems(str(sft_eval_file))
    if families_file.is_file():
        beside[HELD_OUT_FAMILIES] = load_problems(str(families_file))
    return TaskData(
        load_problems(str(train_file)),
        load_problems(str(eval_file)),
        beside,
        load_problems(str(sft_file)) if sft_file.is_file() else [],
        json.loads((run_dir / "families.json").read_text())
        if (run_dir / "families.json").is_file()
        else {},
    )


def _check_kept_families(cfg: Config, run_dir: Path) -> None:
    """A rerun reads its problems back: where the config now names other families than the
    run kept (`families.json`, or none before the sets existed), say so in one line."""
    path = run_dir / "families.json"
    kept = json.loads(path.read_text()) if path.is_file() else {}
    asked = {"sft": cfg.data.sft_gym, "held_out": cfg.data.held_out_gym}
    wanted = {name: sorted({t.task for t in gym_mix(spec)}) for name, spec in asked.items()}
    differ = [name for name in wanted if wanted[name] != kept.get(name, [])]
    if differ:
        print(
            f"{run_dir}: the run keeps its own families ({path.name}"
            f"{'' if path.is_file() else ': none, made before the sets'}); the config's "
            f"{' and '.join(f'data.{name}_gym' for name in differ)} apply to a new run "
            "directory (--out DIR)",
            file=sys.stderr,
            flush=True,
        )


def gym_mix(spec: str, setting: str = "") -> list[gym.GymTask]:
    """The gym mix a setting names (`gym:TASKS` or `gym:MIX_FILE`; empty: none); checked
    (`gym.parse_mix`)."""
    if not spec:
        return []
    if not spec.startswith(gym.PREFIX):
        where = f"{setting}: " if setting else ""
        raise ConfigError(f"{where}{spec!r} is not a gym mix (gym:TASKS or gym:MIX_FILE)")
    body = spec.removeprefix(gym.PREFIX)
    return gym.parse_mix(str(config_path(body)) if body.endswith((".json", ".toml")) else body)


def family_sets(
    sft: list[gym.GymTask], rl: list[gym.GymTask], held_out: list[gym.GymTask]
) -> dict[str, list[str]]:
    """`families.json`: the task names of each set; a family in two sets is a `ConfigError`
    naming it and the two settings."""
    sets = {
        "sft": sorted({t.task for t in sft}),
        "rl": sorted({t.task for t in rl}),
        "held_out": sorted({t.task for t in held_out}),
    }
    settings = {"sft": "data.sft_gym", "rl": "data.rl", "held_out": "data.held_out_gym"}
    names = list(sets)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if shared := sorted(set(sets[a]) & set(sets[b])):
                raise ConfigError(
                    f"{settings[a]} and {settings[b]} share {', '.join(shared)}: a family is "
                    "in one set (SFT demonstrations, RL, or neither)"
                )
    return sets


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
