"""Environments in TRL's form as a trajectory's world: one instance per trajectory, its public
methods the model's tools, `reset(**row)` before the first turn, `get_reward()` after the last.

The convention is TRL's `environment_factory` (`GRPOTrainer`), unchanged, so that a class
written for TRL runs here without edits:
- the class (or any callable returning an instance) takes no arguments; every trajectory gets
  its own instance, so trajectories of a group never share state;
- `reset(**row)` receives the problem row's fields (every key of its line in the problem file)
  and returns None or a string, which is appended to the user's message;
- every public method other than `reset` and `get_reward` is a tool: its name, type hints and
  Google-style docstring make its schema (`transformers.utils.get_json_schema`, as TRL makes
  it); what it returns is the tool's answer (`str(value)`), and an exception it raises is the
  answer TRL gives, `{'error': '...'}`, not a failed rollout;
- `get_reward()` (optional) returns the trajectory's reward, a number, read once after its last
  turn: the environment owns the reward, and the problem row needs no gold answer. Without it,
  the final answer is scored against the row's gold answer as for any problem;
- `done` (optional, an attribute or a method of no arguments, codeloop's own addition): when it
  is true after a tool call, the episode is over and the trajectory ends there.

`rollout.environment = "module:Name"` names it (`load_environment`); the tools of
`rollout.tools` are listed beside its methods (set `rollout.tools = []` for the environment's
alone). The tokens are the agent loop's: the model's turns are the sampled ids, each tool answer
is inserted as masked ids, never re-rendered (`agent.py`).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
import math
import numbers
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from codeloop.config import ConfigError
from codeloop.errors import CodeloopError, RunError
from codeloop.rollout.openenv import (
    EnvFault,
    Gate,
    LocalSession,
    OpenEnvSession,
    action_class,
    action_schema,
    is_openenv_class,
    is_url,
    tool_schema,
)
from codeloop.rollout.toolcall import checked_call
from codeloop.rollout.tools import Tool
from codeloop.types import ExecResult, ExecStatus, ToolCall

RESERVED = ("reset", "get_reward", "done")
SERVED_TIMEOUT = 300.0  # seconds a served environment may take to answer a reset or a step


class EnvError(CodeloopError, RuntimeError):
    """An environment that broke its contract during a run (a reward that is not a number,
    a `reset` that raised): the message names the class and the method."""


@dataclass(frozen=True)
class Environment:
    """A loaded `rollout.environment`: how to make an instance and what its tools are."""

    name: str  # as configured: module:Name
    factory: Callable[[], Any]
    label: str  # the class's name, for messages
    methods: tuple[str, ...]  # the tool methods' names
    schemas: tuple[dict[str, Any], ...]  # their schemas, in the same order
    owns_reward: bool  # it has get_reward
    served: bool = False  # an OpenEnv server's sessions (`openenv.py`): step rewards, aclose()

    async def open(self, row: Mapping[str, Any]) -> Episode:
        """A new instance, reset with the row's fields: the episode of one trajectory. A server
        that cannot be reached raises `EnvFault` (infrastructure, not the model)."""
        try:
            instance = self.factory()
        except Exception as err:
            raise EnvError(f"{self.label}(): {type(err).__name__}: {err}") from None
        try:
            text = await _call(instance.reset, **row)
        except EnvFault:
            raise
        except Exception as err:
            raise EnvError(
                f"{self.label}.reset: {type(err).__name__}: {err} (its row's keys: {sorted(row)})"
            ) from None
        if text is not None and not isinstance(text, str):
            raise EnvError(
                f"{self.label}.reset returned {type(text).__name__}; expected None or a string"
            )
        tools: dict[str, Tool] = {  # a served environment's one tool is its session's step
            name: MethodTool(self.label, getattr(instance, "step" if self.served else name), schema)
            for name, schema in zip(self.methods, self.schemas, strict=True)
        }
        return Episode(self, instance, text or "", tools)


@dataclass
class Episode:
    """One trajectory's environment instance, its tools bound to it."""

    environment: Environment
    instance: Any
    reset_text: str  # appended to the user's message
    tools: dict[str, Tool]

    def done(self) -> bool:
        """Whether the instance says its episode is over (`done`, when it has one)."""
        done = getattr(self.instance, "done", False)
        return bool(done() if callable(done) else done)

    async def reward(self, total: bool = False) -> float:
        """`get_reward()`, checked to be a finite number; `total`: the sum of a served
        environment's step rewards (`rollout.environment_reward = "sum"`)."""
        label = self.environment.label
        if total and self.environment.served:
            return float(sum(self.instance.rewards))
        try:
            value = await _call(self.instance.get_reward)
        except Exception as err:
            raise EnvError(f"{label}.get_reward: {type(err).__name__}: {err}") from None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise EnvError(
                f"{label}.get_reward returned {type(value).__name__} ({value!r}); expected a number"
            )
        if not math.isfinite(value):
            raise EnvError(f"{label}.get_reward returned {value}; expected a finite number")
        return float(value)

    async def close(self) -> None:
        """Ends a served environment's session; nothing for an instance of a class."""
        if self.environment.served:
            await self.instance.aclose()


class MethodTool:
    """One public method of an environment instance as a `Tool`."""

    def __init__(self, label: str, method: Callable[..., Any], schema: dict[str, Any]) -> None:
        self.label, self.method, self.schema = label, method, schema
        self.name: str = schema["function"]["name"]

    def check(self, arguments: dict[str, Any]) -> dict[str, Any] | str:
        return arguments  # the method's own signature checks them, as in TRL

    async def run(self, arguments: dict[str, Any]) -> ExecResult:
        try:
            value = await _call(self.method, **arguments)
        except EnvFault as err:  # the server, not the model: left out of groups and scores
            return ExecResult(status=ExecStatus.SANDBOX_ERROR, stderr=str(err))
        except Exception as err:  # the answer TRL gives the model
            return ExecResult(
                status=ExecStatus.ERROR,
                stderr=str({"error": str(err)}),
                error_type=type(err).__name__,
            )
        return ExecResult(status=ExecStatus.OK, stdout=str(value))


async def _call(method: Callable[..., Any], /, **kwargs: Any) -> Any:
    """A method's value: awaited when it is a coroutine function, else run on a thread (an
    environment may block: a game's step, a browser's page)."""
    if inspect.iscoroutinefunction(method):
        return await method(**kwargs)
    return await asyncio.to_thread(functools.partial(method, **kwargs))


def imported(name: str, where: str, form: str) -> Any:
    """What `module:attribute` names, the working directory importable (a module of one's own
    beside the config, as in TRL scripts); a one-line `ConfigError` after `where` if not."""
    module, _, attribute = name.partition(":")
    if not module or not attribute:
        raise ConfigError(f"{where} is not {form}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return getattr(importlib.import_module(module), attribute)
    except ImportError as err:
        raise ConfigError(f"{where}: cannot import {module} ({err})") from None
    except AttributeError:
        raise ConfigError(f"{where}: {module} has no {attribute}") from None


@functools.cache
def load_environment(name: str) -> Environment:
    """The environment `rollout.environment` names (`module:Name`): imported, one instance made
    to read its tool methods (as TRL probes one), each method's schema made from its docstring
    and type hints. A `ConfigError` names the class and the method that is wrong."""
    where = f"rollout.environment: {name!r}"
    spec, _, tool = name.partition("#")
    if tool and not tool.isidentifier():
        raise ConfigError(f"{where}: {tool!r} after '#' is not a tool name")
    if is_url(name):
        return _served(name, where)
    factory = imported(spec, where, "module:Name")
    attribute = spec.partition(":")[2]
    if is_openenv_class(factory):
        return _constructed(factory, name, where, tool or "step")
    if tool:
        raise ConfigError(f"{where}: '#' names an OpenEnv environment's tool; {attribute} is none")
    if not callable(factory):
        raise ConfigError(f"{where}: {attribute} is not a class or a callable")
    try:
        probe = factory()
    except Exception as err:
        raise ConfigError(f"{where}: {attribute}() failed: {type(err).__name__}: {err}") from None
    cls = type(probe)
    label = cls.__name__
    if not callable(getattr(probe, "reset", None)):
        raise ConfigError(f"{where}: {label} has no reset method (TRL's environments need one)")
    from transformers.utils.chat_template_utils import get_json_schema

    methods, schemas = [], []
    # the class's functions, as TRL lists them (the instance's properties are not evaluated)
    for method_name, _ in inspect.getmembers(cls, predicate=inspect.isfunction):
        if method_name.startswith("_") or method_name in RESERVED:
            continue
        try:
            schema = get_json_schema(getattr(probe, method_name))
        except Exception as err:
            raise ConfigError(
                f"{where}: {label}.{method_name}: cannot make its tool schema ({err}; a tool "
                "method needs a docstring with an Args: line per argument and type hints)"
            ) from None
        methods.append(method_name)
        schemas.append(schema)
    owns_reward = callable(getattr(probe, "get_reward", None))
    if not methods:
        raise ConfigError(f"{where}: {label} has no public method to offer as a tool")
    return Environment(name, factory, label, tuple(methods), tuple(schemas), owns_reward)


def _served(name: str, where: str) -> Environment:
    """An OpenEnv server at `name`'s URL: its sessions as instances, its action as one tool,
    `step` or the name after the URL's `#`."""
    url, _, tool = name.partition("#")
    try:
        schema = action_schema(url, tool or "step")
    except EnvFault as err:
        raise ConfigError(f"{where}: cannot read the OpenEnv server's schema ({err})") from None
    gate = Gate()  # this process's sessions on that server

    def session() -> OpenEnvSession:
        return OpenEnvSession(url, gate, timeout=SERVED_TIMEOUT)

    label = f"OpenEnv at {url}"
    return Environment(name, session, label, (tool or "step",), (schema,), True, served=True)


def _constructed(cls: type, name: str, where: str, tool: str) -> Environment:
    """An OpenEnv environment class constructed in this process: an instance per trajectory,
    its action one tool (`step` or the name after `#`), as its server would offer it."""
    action = action_class(cls)
    if action is None:
        raise ConfigError(
            f"{where}: cannot tell {cls.__name__}'s action class (subclass "
            "Environment[Action, Observation, State], or annotate step's action)"
        )
    schema = tool_schema(action.model_json_schema(), tool)  # type: ignore[attr-defined]
    gate = Gate()  # one episode at a time unless the class says its instances are independent
    gate.limit = None if getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1

    def session() -> LocalSession:
        return LocalSession(cls, action, gate)

    label = f"OpenEnv {cls.__name__}"
    return Environment(name, session, label, (tool,), (schema,), True, served=True)


@functools.cache
def imported_function(name: str, setting: str) -> Callable[..., Any]:
    """The function `name` (`module:function`) that the setting `setting` names (a reward
    function, an action parser); a `ConfigError` if it does not import or is not callable."""
    where = f"{setting}: {name!r}"
    found = imported(name, where, "module:function")
    if not callable(found):
        raise ConfigError(f"{where}: {name.partition(':')[2]} is not a function")
    return found  # type: ignore[no-any-return]


def load_action_parser(name: str) -> Callable[[str], Any]:
    """The function `rollout.action_parser` names."""
    return imported_function(name, "rollout.action_parser")


def parsed_action(name: str, turn_text: str, tools: Mapping[str, Tool]) -> ToolCall | str | None:
    """What `rollout.action_parser` reads in a turn: None (no action), a call checked against
    `tools`, or the error text to show the model. A parser that raises or returns something
    else stops the run with one line naming it."""
    parser = load_action_parser(name)
    try:
        value = parser(turn_text)
    except Exception as err:
        raise RunError(f"action parser {name}: {type(err).__name__}: {err}") from None
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, Mapping) or "name" not in value:
        raise RunError(
            f"action parser {name} returned {value!r}; expected None, a string, or "
            "{'name': tool, 'arguments': {...}}"
        )
    return checked_call(dict(value), tools, json.dumps(dict(value), default=str))


def environment_schemas(name: str) -> list[dict[str, Any]]:
    """The tool schemas of `rollout.environment` (none when it is empty)."""
    return list(load_environment(name).schemas) if name else []


def load_environments(environment: str, environments: Mapping[str, Any]) -> dict[str, Environment]:
    """`rollout.environments` (TRL's dict form: several environments, each problem naming its
    own in its `environment` field), each loaded as `load_environment` loads one; refused with a
    `ConfigError` beside `rollout.environment` or where a value is not a string."""
    if environment and environments:
        raise ConfigError(
            "rollout.environment and rollout.environments are both set: name one environment, "
            "or a table of them that the problems choose from"
        )
    loaded = {}
    for name, source in environments.items():
        if not isinstance(source, str) or not source:
            raise ConfigError(
                f"rollout.environments.{name}: expected 'module:Name' or an OpenEnv URL, "
                f"got {source!r}"
            )
        loaded[name] = load_environment(source)
    return loaded


def schemas_by_environment(environments: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each environment of `rollout.environments`: its tools' schemas."""
    return {name: list(env.schemas) for name, env in load_environments("", environments).items()}


def chosen_environment(row: Mapping[str, Any], names: Sequence[str], problem: str) -> str:
    """The name a problem's `environment` field gives (TRL's column), checked against the
    names of `rollout.environments`; a one-line `RunError` naming the problem if it is not
    one of them."""
    if "environment" not in row:
        raise RunError(
            f"problem {problem}: no environment field, and rollout.environments has several "
            f"({', '.join(names)}): give each problem the name of its own"
        )
    chosen = row["environment"]
    if not isinstance(chosen, str) or chosen not in names:
        raise RunError(
            f"problem {problem}: its environment field is {chosen!r}, not one of "
            f"rollout.environments ({', '.join(names)})"
        )
    return chosen
