"""An environment served by OpenEnv, reached by URL (one WebSocket session per trajectory) or
constructed in this process (one instance per trajectory).

`rollout.environment = "http://host:port"` (or `ws://...`) names an OpenEnv server (PyPI
`openenv`: `create_app(...)`, started from a Docker image, a Space or a Python process). Its
HTTP `/reset` and `/step` build a fresh environment for every request, so an episode is one
session on `/ws`: `{"type": "reset", "data": row}`, then `{"type": "step", "data": action}`
per tool call, each answered `{"type": "observation", "data": {"observation", "reward",
"done"}}`, then `{"type": "close"}`.

The server looks to the agent like an environment in TRL's form (`environment.py`), so both
run through the same loop: one tool, `step` (or the name after the URL's `#`:
`http://host:port#guess`), whose arguments are the server's action (its JSON schema from
`/schema`); the reset observation is appended to the user's message and each step's
observation is the tool's answer (a lone text field as it is, else the fields as JSON); the
observation's `done` ends the episode; the reward is the last observation's, or the sum of the
step rewards (`rollout.environment_reward`).

A server serves as many sessions as it says (`max_concurrent_envs`, one unless the environment
supports more): a session it refuses for capacity waits for one of this process's sessions to
end and tries again, and the server's stated limit gates every later session, so a group of 8
on a one-session server completes, one trajectory after another. A server that cannot be
reached, or that goes away mid-episode, is an infrastructure fault (`EnvFault` at the reset,
a `sandbox_error` answer at a step): the trajectory is left out of its group and of scores,
never scored 0.

`rollout.environment = "module:Name"` where Name subclasses OpenEnv's `Environment` (as
`Environment[Action, Observation, State]`) constructs it in the running process instead
(`LocalSession`): no server, the same tool, observations, rewards and errors; an environment
that does not declare `SUPPORTS_CONCURRENT_SESSIONS` runs one episode at a time, as its server
would.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from codeloop.errors import CodeloopError

URL_SCHEMES = ("http://", "https://", "ws://", "wss://")
CAPACITY = "CAPACITY_REACHED"
BASE = "openenv.core.env_server.interfaces.Environment"  # OpenEnv's environment class


class EnvFault(CodeloopError, RuntimeError):
    """The environment's infrastructure failed (a server unreachable or gone), not the model."""


def is_url(name: str) -> bool:
    return name.startswith(URL_SCHEMES)


def _http(url: str) -> str:
    return "http" + url.removeprefix("ws") if url.startswith("ws") else url


def _ws(url: str) -> str:
    return "ws" + url.removeprefix("http") if url.startswith("http") else url


def action_schema(url: str, name: str = "step", timeout: float = 30.0) -> dict[str, Any]:
    """The tool `name`'s schema from the server's `/schema` (its action model), fetched once:
    the action's fields less `metadata`, its docstring the description."""
    address = _http(url).rstrip("/") + "/schema"
    try:
        with urllib.request.urlopen(address, timeout=timeout) as response:
            action = dict(json.loads(response.read())["action"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise EnvFault(f"{address}: {type(err).__name__}: {err}") from None
    return tool_schema(action, name)


def tool_schema(action: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The tool `name` whose arguments are an action's fields (its JSON schema, less
    `metadata`), its docstring the description."""
    properties = {
        field: {key: value for key, value in spec.items() if key != "title"}
        for field, spec in action.get("properties", {}).items()
        if field != "metadata" and isinstance(spec, dict)
    }
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": action.get("description") or "Take one action in the environment.",
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": [k for k in action.get("required", []) if k in properties],
            },
        },
    }


def _base(cls: type) -> type | None:
    """OpenEnv's `Environment` among `cls`'s bases (found by name: openenv need not be
    installed to load a class that is not one)."""
    return next((c for c in cls.__mro__ if f"{c.__module__}.{c.__qualname__}" == BASE), None)


def is_openenv_class(value: Any) -> bool:
    return inspect.isclass(value) and _base(value) is not None


def action_class(cls: type) -> type | None:
    """The action model of an OpenEnv environment class: the first parameter of its
    `Environment[Action, Observation, State]` base, else the annotation of `step`'s action."""
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            if origin is not None and inspect.isclass(origin) and _base(origin) is not None:
                found = next(iter(typing.get_args(base)), None)
                if inspect.isclass(found) and hasattr(found, "model_validate"):
                    return found
    try:
        hint = typing.get_type_hints(cls.step).get("action")  # type: ignore[attr-defined]
    except Exception:
        return None
    return hint if inspect.isclass(hint) and hasattr(hint, "model_validate") else None


class Gate:
    """The sessions this process holds on one server: unbounded until the server refuses one
    for capacity, then at most the number it stated."""

    def __init__(self) -> None:
        self.limit: int | None = None
        self.active = 0
        self._changed: asyncio.Condition | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _condition(self) -> asyncio.Condition:
        loop = asyncio.get_running_loop()
        if self._changed is None or self._loop is not loop:  # a new run's event loop
            self._changed, self._loop, self.active = asyncio.Condition(), loop, 0
        return self._changed

    async def enter(self) -> None:
        changed = self._condition()
        async with changed:
            await changed.wait_for(lambda: self.limit is None or self.active < self.limit)
            self.active += 1

    async def leave(self, refused_at: int | None = None) -> None:
        """One session ended; `refused_at`: the server refused it, saying it holds so many."""
        changed = self._condition()
        async with changed:
            self.active -= 1
            if refused_at is not None:
                self.limit = max(1, min(refused_at, self.limit or refused_at))
            changed.notify_all()


def _text(data: dict[str, Any]) -> str:
    """What the model reads of an observation: its one text field, or its fields as JSON."""
    fields = {k: v for k, v in (data.get("observation") or {}).items() if v not in (None, {}, [])}
    fields.pop("metadata", None)
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return str(next(iter(fields.values())))
    return json.dumps(fields, ensure_ascii=False)


class _Steps:
    """What an episode's observations said: its step rewards, and whether it is done."""

    def __init__(self) -> None:
        self.rewards: list[float] = []
        self.done = False

    def get_reward(self) -> float:
        return self.rewards[-1] if self.rewards else 0.0

    def _record(self, data: dict[str, Any]) -> None:
        reward = data.get("reward")
        if isinstance(reward, (int, float)) and not isinstance(reward, bool):
            self.rewards.append(float(reward))
        self.done = bool(data.get("done"))


class OpenEnvSession(_Steps):
    """One trajectory's session on an OpenEnv server, in TRL's environment form."""

    def __init__(self, url: str, gate: Gate, timeout: float) -> None:
        super().__init__()
        self.url, self.gate, self.timeout = url, gate, timeout
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse[bool] | None = None

    async def reset(self, **row: Any) -> str:
        while True:
            await self.gate.enter()
            try:
                data = await self._open(row)
            except _Refused as refused:
                await self._close_quietly()
                await self.gate.leave(refused_at=refused.max_sessions)
                continue
            except BaseException:
                await self._close_quietly()
                await self.gate.leave()
                raise
            self._record(data)
            return "\n\n" + _text(data)

    async def step(self, **action: Any) -> str:
        """The action, sent to the server; its observation is the answer."""
        if self._ws is None:
            raise EnvFault(f"{self.url}: no session (the reset failed)")
        data = await self._send({"type": "step", "data": action}, "step")
        self._record(data)
        return _text(data)

    async def aclose(self) -> None:
        """Ends the session (the server frees its environment) and lets the next one in."""
        if self._http is None:
            return
        if self._ws is not None and not self._ws.closed:
            try:
                await self._ws.send_str(json.dumps({"type": "close"}))
            except (aiohttp.ClientError, OSError, RuntimeError):
                pass
        await self._close_quietly()
        await self.gate.leave()

    async def _open(self, row: dict[str, Any]) -> dict[str, Any]:
        limit = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout)
        self._http = aiohttp.ClientSession(timeout=limit)
        try:
            self._ws = await self._http.ws_connect(_ws(self.url).rstrip("/") + "/ws")
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as err:
            raise EnvFault(f"{self.url}/ws: {type(err).__name__}: {err}") from None
        return await self._send({"type": "reset", "data": row}, "reset")

    async def _send(self, message: dict[str, Any], what: str) -> dict[str, Any]:
        assert self._ws is not None
        failed: BaseException | None = None
        try:
            await self._ws.send_str(json.dumps(message))
        except (aiohttp.ClientError, OSError, RuntimeError) as err:
            failed = err  # a refusal the server sent before closing may still be there to read
        try:
            reply = await self._ws.receive(timeout=self.timeout)
        except (aiohttp.ClientError, OSError, RuntimeError, asyncio.TimeoutError) as err:
            failed = failed or err
            raise EnvFault(f"{self.url}: {what}: {type(failed).__name__}: {failed}") from None
        if reply.type != aiohttp.WSMsgType.TEXT:
            cause = f"{type(failed).__name__}: {failed}" if failed else reply.type.name
            raise EnvFault(f"{self.url}: {what}: the session ended ({cause})")
        answer = json.loads(reply.data)
        if answer.get("type") == "error":
            error = answer.get("data") or {}
            if error.get("code") == CAPACITY:
                raise _Refused(int(error.get("max_sessions") or 1))
            if what == "step":  # the environment's own error: the model's answer, as in TRL
                raise ValueError(_error_text(error))
            raise EnvFault(f"{self.url}: {what}: {error.get('message', error)}")
        data: dict[str, Any] = answer.get("data") or {}
        return data

    async def _close_quietly(self) -> None:
        if self._http is not None:
            await self._http.close()
        self._http, self._ws = None, None


class LocalSession(_Steps):
    """One trajectory's episode of an OpenEnv environment constructed in this process, in the
    form of `OpenEnvSession`: reset with the row's fields the method accepts, each action
    validated by the action model (an invalid one is the model's answer, as the server's is),
    `*_async` awaited where the class overrides them and the others run on a thread (as the
    server runs them), `close()` at the end."""

    def __init__(self, make: Callable[[], Any], action: type, gate: Gate) -> None:
        super().__init__()
        self.make, self.action, self.gate = make, action, gate
        self._env: Any = None
        self._entered = False

    async def reset(self, **row: Any) -> str:
        await self.gate.enter()
        self._entered = True
        try:
            self._env = self.make()
            data = await self._run("reset", (), row)
        except BaseException:
            await self.aclose()
            raise
        return "\n\n" + _text(data)

    async def step(self, **action: Any) -> str:
        """The action, validated, to the instance's step (a tool exists only after a reset)."""
        from pydantic import ValidationError  # OpenEnv's models are pydantic's

        try:
            validated = self.action.model_validate(action)  # type: ignore[attr-defined]
        except ValidationError as err:
            error = {"message": "Invalid action", "errors": err.errors()}
            raise ValueError(_error_text(error)) from None
        return _text(await self._run("step", (validated,), {}))

    async def aclose(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            await asyncio.to_thread(env.close)
        if self._entered:
            self._entered = False
            await self.gate.leave()

    async def _run(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        from openenv.core.env_server.serialization import serialize_observation

        env, base = self._env, _base(type(self._env))
        overridden = getattr(type(env), f"{name}_async") is not getattr(base, f"{name}_async")
        method = getattr(env, f"{name}_async" if overridden else name)
        parameters = inspect.signature(method).parameters.values()
        if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters):
            named = {p.name for p in parameters}
            kwargs = {k: v for k, v in kwargs.items() if k in named}
        if overridden:
            observation = await method(*args, **kwargs)
        else:
            observation = await asyncio.to_thread(method, *args, **kwargs)
        data: dict[str, Any] = serialize_observation(observation)
        self._record(data)
        return data


def _error_text(error: dict[str, Any]) -> str:
    """The server's error message, with each invalid field of the action it names."""
    fields = [
        f"{'.'.join(str(part) for part in e.get('loc', []))}: {e.get('msg', '')}"
        for e in error.get("errors") or []
        if isinstance(e, dict)
    ]
    message = str(error.get("message", "error"))
    return f"{message} ({'; '.join(fields)})" if fields else message


class _Refused(Exception):
    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
