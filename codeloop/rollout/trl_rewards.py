"""Reward functions in TRL's signature (`rollout.reward_functions`), called once a trajectory.

TRL's `GRPOTrainer` calls each of its `reward_funcs` on a batch as
`f(prompts=..., completions=..., completion_ids=..., environments=..., trainer_state=...,
log_extra=..., log_metric=..., **columns)`, every argument a list with one entry per completion,
and takes back a list of rewards, `None` where the function does not apply. With an
`environment_factory` whose environment has `get_reward`, TRL adds it as one more such function.
Its reward is the sum of the values that are not `None` (0 when all are).

codeloop calls the same functions unchanged, on one trajectory at a time (lists of one): the
prompt's text, the decoded response (the tool answers inside it, as the model read them), its
token ids, the trajectory's environment instance (when `rollout.environment` names one), and
every field of the problem's row. `trainer_state` is None; `log_extra` and `log_metric` accept
and drop what they are given. The reward is the sum of the functions' values, each times its
weight (`rollout.reward_weights`, TRL's `reward_weights`), and of the environment's
`get_reward()` where it has one (weight 1, as TRL gives it); the gold answer is then not scored.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from codeloop.config import ConfigError
from codeloop.errors import RunError
from codeloop.rollout.environment import imported_function

SKIPPED = ("prompt", "completion", "completion_ids")  # row fields TRL does not pass on


def load_reward_function(name: str) -> Callable[..., Any]:
    """The function `name` (`module:function`) names; a `ConfigError` says what is wrong."""
    return imported_function(name, "rollout.reward_functions")


def _drop(*args: Any, **kwargs: Any) -> None:
    """`log_extra` and `log_metric`: what a function logs is not kept."""


def check_weights(names: Sequence[str], weights: Sequence[float]) -> None:
    """`rollout.reward_weights` against `rollout.reward_functions`: none, or one a function."""
    if weights and len(weights) != len(names):
        raise ConfigError(
            f"rollout.reward_weights: {len(weights)} weights for {len(names)} reward functions "
            "(rollout.reward_functions): give one a function, or none"
        )


async def trl_reward(
    names: Sequence[str],
    *,
    weights: Sequence[float] = (),
    prompt: str,
    completion: str,
    completion_ids: list[int],
    row: Mapping[str, Any],
    environment: Any = None,
    environment_reward: float | None = None,
) -> float:
    """The reward TRL would give one trajectory: the functions' values that are not None, each
    times its weight (`weights`: one a function, or none for 1 each), and the environment's own
    reward (`environment_reward`, None without one), summed (`weights` checked by
    `check_weights` before the run)."""
    kwargs: dict[str, Any] = {k: [v] for k, v in row.items() if k not in SKIPPED}
    kwargs |= {
        "prompts": [prompt],
        "completions": [completion],
        "completion_ids": [completion_ids],
        "trainer_state": None,
        "log_extra": _drop,
        "log_metric": _drop,
    }
    if environment is not None:
        kwargs["environments"] = [environment]
    values = [] if environment_reward is None else [environment_reward]
    for index, name in enumerate(names):
        function = load_reward_function(name)
        try:
            if inspect.iscoroutinefunction(function):
                returned = await function(**kwargs)
            else:
                returned = await asyncio.to_thread(functools.partial(function, **kwargs))
        except Exception as err:
            raise RunError(f"reward function {name}: {type(err).__name__}: {err}") from None
        value = _one_value(name, returned)
        if value is not None:
            values.append(value * (weights[index] if weights else 1.0))
    return float(sum(values))


def _one_value(name: str, returned: Any) -> float | None:
    """The one reward of a list of one, checked: a finite number or None."""
    if not isinstance(returned, (list, tuple)) or len(returned) != 1:
        raise RunError(
            f"reward function {name} returned {returned!r}; expected a list of one reward per "
            "completion (codeloop passes one completion at a time)"
        )
    [value] = returned
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RunError(f"reward function {name} returned [{value!r}]; expected a finite number")
    return float(value)
