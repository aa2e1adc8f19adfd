"""An OpenEnv environment for the tests: a counter whose every step has a reward of its own.

Each `{"amount": n}` adds n; the step's reward is n / 10; the episode is done after three steps.
So the final reward (the last step's) and the summed one differ. Run as a script to serve it:
`python openenv_counter.py --port P [--max-concurrent-envs N]`; or constructed in-process
(`openenv_counter:Counter`), with variants: `OneAtATime` (no concurrent sessions declared; it
counts its live episodes), `Awaited` (its own `reset_async`/`step_async`) and `Untyped` (no
action class to be found).
"""

import argparse
import asyncio
from typing import Any

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field


class Add(Action):
    amount: int = Field(description="How much to add.")


class Count(Observation):
    message: str = Field(default="")


class Counter(Environment[Add, Count, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.value, self.steps = 0, 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **row: Any) -> Count:
        self.value, self.steps = int(row.get("start", 0)), 0
        return Count(message=f"The counter starts at {self.value}.")

    def step(self, action: Add, timeout_s: float | None = None, **kwargs: Any) -> Count:
        self.value += action.amount
        self.steps += 1
        return Count(
            message=f"the counter is {self.value}", reward=action.amount / 10, done=self.steps == 3
        )

    @property
    def state(self) -> State:
        return State(step_count=self.steps)


class OneAtATime(Counter):
    SUPPORTS_CONCURRENT_SESSIONS = False
    live = most = 0  # episodes between reset and close, now and at most

    def reset(self, seed: int | None = None, episode_id: str | None = None, **row: Any) -> Count:
        OneAtATime.live += 1
        OneAtATime.most = max(OneAtATime.most, OneAtATime.live)
        return super().reset(seed, episode_id, **row)

    def close(self) -> None:
        OneAtATime.live -= 1


class Awaited(Counter):
    async def reset_async(self, seed: int | None = None, **row: Any) -> Count:
        await asyncio.sleep(0)
        return Count(message=f"{self.reset(seed, None, **row).message} (awaited)")

    async def step_async(self, action: Add, timeout_s: float | None = None, **kw: Any) -> Count:
        await asyncio.sleep(0)
        counted = self.step(action)
        return Count(
            message=f"{counted.message} (awaited)", reward=counted.reward, done=counted.done
        )


class Untyped(Environment):  # type: ignore[type-arg]
    def reset(self, seed: int | None = None, episode_id: str | None = None, **row: Any) -> Count:
        return Count()

    def step(self, action, timeout_s=None, **kwargs):  # type: ignore[no-untyped-def]
        return Count()

    @property
    def state(self) -> State:
        return State()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-concurrent-envs", type=int, default=1)
    args = parser.parse_args()
    app = create_app(Counter, Add, Count, max_concurrent_envs=args.max_concurrent_envs)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
