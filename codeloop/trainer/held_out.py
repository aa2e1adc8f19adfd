"""Evaluation during RL: every `trainer.eval_every` steps the policy, as the run's own engines
now hold it, samples `eval.k` trajectories of each problem of `eval.data` at the `[eval]`
settings, and the step's log gets:

- the metrics of `rollout/score.py` under `eval/`: `eval/pass@1` (avg@k over the problems) with
  its 95% interval (`eval/pass@1_low`, `eval/pass@1_high`), `eval/problems` scored and
  `eval/infrastructure_failures` (trajectories that the engine, a server or the sandbox failed:
  left out of the score);
- `timing/eval_s` (part of the step's time).

Each rank scores its share of the problems with its engines; the shares are gathered so that
every rank logs the same figures. Samples are seeded by (trainer.seed, problem id, sample), so an
evaluation of the same weights samples the same trajectories.
"""

from __future__ import annotations

from collections.abc import Sequence

from codeloop.config import Config, ConfigError, eval_rollout_config
from codeloop.data.problems import Problem, load_problems
from codeloop.rollout.score import Scores, score_policy
from codeloop.trainer.distributed import World, all_gather
from codeloop.trainer.rollout_side import RolloutSide


class HeldOut:
    """The held-out problems of a run and when to score them."""

    def __init__(self, cfg: Config, problems: Sequence[Problem]) -> None:
        self.cfg, self.problems = cfg, list(problems)

    @classmethod
    def from_config(cls, cfg: Config) -> HeldOut:
        """`eval.data` when `trainer.eval_every` asks for evaluations (none otherwise)."""
        if not cfg.trainer.eval_every:
            return cls(cfg, [])
        if not cfg.eval.data:
            raise ConfigError("trainer.eval_every needs the held-out problems: set eval.data")
        return cls(cfg, load_problems(cfg.eval.data, cfg.data))

    def due(self, step: int) -> bool:
        every = self.cfg.trainer.eval_every
        return bool(self.problems) and every > 0 and step % every == 0

    async def score(self, rollout: RolloutSide, world: World) -> dict[str, float]:
        """The `eval/` metrics of the policy the engines now sample from
        (`rollout/score.py`)."""
        mine = self.problems[world.rank :: world.size]
        agent = rollout.agent(rollout=eval_rollout_config(self.cfg))
        found = await score_policy(
            agent, mine, self.cfg.eval.k, rollout.verifier, seed=self.cfg.trainer.seed
        )
        merged = gather_scores(found, world)
        return {f"eval/{key}": value for key, value in merged.metrics().items()}


def gather_scores(found: Scores, world: World) -> Scores:
    """Every rank's shares and failures merged, on every rank; this rank's trajectories stay
    with it (they are not sent)."""
    shares = Scores.merged(all_gather(Scores(found.per_problem, found.failed), world))
    return Scores(shares.per_problem, shares.failed, found.trajectories)
