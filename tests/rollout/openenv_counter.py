"""An OpenEnv server for the tests: a counter whose every step has a reward of its own.

Each `{"amount": n}` adds n; the step's reward is n / 10; the episode is done after three steps.
So the final reward (the last step's) and the summed one differ. Run as a script:
`python openenv_counter.py --port P [--max-concurrent-envs N]`.
"""

import argparse
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-concurrent-envs", type=int, default=1)
    args = parser.parse_args()
    app = create_app(Counter, Add, Count, max_concurrent_envs=args.max_concurrent_envs)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
