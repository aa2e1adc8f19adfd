"""Guess the number: a stateful multi-turn game in TRL's environment form.

The secret is a whole number from 1 to `high`; each `guess` is answered "higher", "lower" or
"right", and the game ends when the guess is right or the guesses run out. The reward is 1.0
for a win and 0.0 otherwise. A problem row gives the game: `secret`, `high` and `guesses`
(`guess_number.jsonl` beside this file holds 256 of them). Run by codeloop with
`rollout.environment = "codeloop.environments.guess_number:GuessNumber"`
(`configs/env_guess_number.toml`), or by TRL's GRPOTrainer with
`environment_factory=GuessNumber`: the class uses nothing of codeloop's.
"""

from __future__ import annotations


class GuessNumber:
    def __init__(self) -> None:
        self.secret, self.high, self.left, self.won = 0, 0, 0, False

    def reset(self, secret: int = 1, high: int = 8, guesses: int = 3, **row: object) -> str:
        self.secret, self.high, self.left, self.won = int(secret), int(high), int(guesses), False
        return (
            f"\n\nI am thinking of a whole number from 1 to {self.high}. Find it with the guess "
            f"tool; you have {self.left} guesses, and each is answered higher, lower or right."
        )

    def guess(self, number: int) -> str:
        """
        Guess the secret number.

        Args:
            number: The whole number guessed.

        Returns:
            Whether the secret is higher, lower or right, and the guesses left.
        """
        if self.left <= 0 or self.won:
            raise ValueError("the game is over")
        if not isinstance(number, int) or isinstance(number, bool):
            raise ValueError(f"{number!r} is not a whole number")
        self.left -= 1
        if number == self.secret:
            self.won = True
            return "right: you found it"
        hint = "higher" if self.secret > number else "lower"
        if not self.left:
            return f"{hint}; no guesses left"
        return f"{hint} ({self.left} guess{'es' * (self.left > 1)} left)"

    @property
    def done(self) -> bool:
        return self.won or self.left <= 0

    def get_reward(self) -> float:
        return 1.0 if self.won else 0.0
