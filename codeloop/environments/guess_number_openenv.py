"""Guess the number served by OpenEnv: the game of `guess_number.py` as an OpenEnv environment.

    pip install 'codeloop[openenv]'
    python -m codeloop.environments.guess_number_openenv --port 8000 [--max-concurrent-envs 8]

serves it on 127.0.0.1:8000 (OpenEnv's `create_app`, uvicorn); `configs/env_guess_number.toml`
with `--rollout.environment 'http://127.0.0.1:8000#guess'` trains on it, and with
`--rollout.environment codeloop.environments.guess_number_openenv:GuessNumberServed#guess` on
the class constructed in-process, without the server. Its action is
`{"number": n}`, each observation's `message` the game's answer, `done` the game's end, and the
reward 1.0 on the winning step (0.0 on the others), so the final and the summed reward agree.
`--max-concurrent-envs` is how many episodes the server holds at once (OpenEnv's setting of
that name); with 1, codeloop runs a group's trajectories one after another.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field

from codeloop.environments.guess_number import GuessNumber


class Guess(Action):
    """Guess the secret number."""

    number: int = Field(description="The whole number guessed.")


class Answer(Observation):
    message: str = Field(default="", description="The game's answer.")


class GuessNumberServed(Environment[Guess, Answer, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session has its own game

    def __init__(self) -> None:
        super().__init__()
        self.game, self.steps = GuessNumber(), 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **row: Any) -> Answer:
        self.steps = 0
        return Answer(message=self.game.reset(**row).strip())

    def step(self, action: Guess, timeout_s: float | None = None, **kwargs: Any) -> Answer:
        self.steps += 1
        message = self.game.guess(action.number)
        return Answer(message=message, done=self.game.done, reward=self.game.get_reward())

    @property
    def state(self) -> State:
        return State(step_count=self.steps)


def app(sessions: int = 8) -> Any:
    return create_app(GuessNumberServed, Guess, Answer, max_concurrent_envs=sessions)


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-concurrent-envs", type=int, default=8, help="episodes at once")
    args = parser.parse_args(argv)
    served = app(args.max_concurrent_envs)
    uvicorn.run(served, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
