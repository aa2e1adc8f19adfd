"""SFT demonstrations of guess-the-number: games played by a player that opens with a random
guess, keeps track of where the secret can be, and then guesses the middle of it.

The report's first stage is SFT on the tool-call format, not on the task: these conversations
teach the format of a call, how to read an answer ("higher": the secret is above the guess) and
how to halve what is left, while the opening is drawn at random from 1 to 8. The opening decides
how often the rest can win (of 8 secrets, 7 after opening with 4 or 5, 4 after 1 or 8: 69% of
games over random openings, 87.5% with the best one), and it does not depend on the secret: RL
has that choice left to learn. Every message is what a trajectory holds: the config's system
prompt, the row's prompt followed by what `reset` returned, each call's answer as the game gave
it.

    python -m codeloop.environments.guess_number_demos OUT.jsonl [--games N] [--seed S]

wrote `guess_number_sft.jsonl` beside this file (`--games 256 --seed 1`), the file
`configs/env_guess_number.toml` names as `sft.data`.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from typing import Any

from codeloop.config import config_path, load_config
from codeloop.environments.guess_number import GuessNumber

CONFIG = "env_guess_number.toml"


def call(number: int) -> str:
    body = json.dumps({"name": "guess", "arguments": {"number": number}})
    return f"<tool_call>\n{body}\n</tool_call>"


def play(
    row: dict[str, Any], rng: random.Random, system: str, instruction: str
) -> list[dict[str, str]]:
    """One game of the row as a conversation: system, user, then (assistant call, tool answer)
    until the game is over."""
    game = GuessNumber()
    shown = game.reset(**row) or ""
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": instruction.format(problem=row["prompt"]) + shown},
    ]
    low, high = 1, game.high
    number = rng.randint(low, high)  # the opening; afterwards the middle of what is left
    while not game.done:
        where = f"It is from {low} to {high}." if low < high else f"It is {low}."
        thought = f"<reason>{where} I guess {number}.</reason>"
        messages.append({"role": "assistant", "content": f"{thought}\n{call(number)}"})
        answer = game.guess(number)
        messages.append({"role": "tool", "content": answer})
        if answer.startswith("higher"):
            low = number + 1
        elif answer.startswith("lower"):
            high = number - 1
        number = (low + high) // 2
    return messages


def demonstrations(games: int, seed: int, high: int = 8, guesses: int = 3) -> list[dict[str, Any]]:
    """`games` conversations ({"messages": [...]}) with secrets drawn from `seed`, rendered with
    the system prompt and instruction of `configs/env_guess_number.toml`."""
    cfg = load_config(config_path(CONFIG))
    rng = random.Random(seed)
    rows = [
        {
            "prompt": "Play the game.",
            "secret": rng.randint(1, high),
            "high": high,
            "guesses": guesses,
        }
        for _ in range(games)
    ]
    system, instruction = cfg.rollout.system_prompt, cfg.rollout.user_instruction
    return [{"messages": play(row, rng, system, instruction)} for row in rows]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSONL file to write")
    parser.add_argument("--games", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    lines = [json.dumps(d) for d in demonstrations(args.games, args.seed)]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
