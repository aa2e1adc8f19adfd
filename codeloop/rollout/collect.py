"""One path from problems to scored trajectories: RL, evaluation, refiltering and the demo.

An `Agent` is what the policy talks to and how: its engine (one, or a `Scheduler` over
several), the tool executor, the prompt format and the rollout settings. `collect` samples k
trajectories per problem through the agent loop and scores each one with the verifier as soon
as it ends, so verification overlaps the generation of the others (the verifier works on its
own thread, its slow checks in worker processes). Sample j of a problem is seeded from
(seed, key, j), the key being the problem's id unless the caller gives one (RL gives the
problem's position in its data order).

With an environment (`rollout.environment`, `environment.py`), each trajectory opens its own
episode: an instance reset with the problem's row, whose text is appended to the prompt, whose
methods join the agent's tools, whose `done` ends the trajectory and whose `get_reward()` is its
reward (else the verifier scores the final answer against the gold one).
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from codeloop.config import RolloutConfig
from codeloop.data.problems import Problem
from codeloop.engine.protocol import Batched, Engine
from codeloop.engine.scheduler import Scheduler
from codeloop.errors import RunError
from codeloop.progress import progress_bar
from codeloop.reward import Verdict, Verifier
from codeloop.rollout.agent import run_trajectory
from codeloop.rollout.environment import (
    Environment,
    chosen_environment,
    load_action_parser,
    load_environment,
    load_environments,
)
from codeloop.rollout.openenv import EnvFault
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.tools import Tool, Toolbox, ToolExecutor, toolbox
from codeloop.rollout.trl_rewards import check_weights, load_reward_function, trl_reward
from codeloop.types import RolloutStatus, Trajectory

UNSCORED = (Verdict.TIMEOUT, Verdict.VERIFIER_ERROR)  # a gym task's scorer hung or raised


@dataclass(frozen=True)
class Agent:
    """The engine (or a scheduler over engines), tools, format and settings of a rollout.
    `tools`: the tools by name (`tools.toolbox` makes them from a sequence of tools, or from a
    `ToolExecutor`: the tools `rollout.tools` names); the prompt format must list the same
    ones."""

    engine: Engine | Scheduler
    tools: ToolExecutor | Toolbox | Sequence[Tool]
    fmt: PromptFormat
    rollout: RolloutConfig
    # `rollout.environment`, loaded (None: the tools alone); its methods are tools too
    environment: Environment | None = None
    # `rollout.environments`, loaded: each problem's `environment` field names its own
    environments: Mapping[str, Environment] | None = None

    def __post_init__(self) -> None:
        tools = toolbox(self.tools, self.rollout.tools)
        environment = self.environment
        if environment is None and self.rollout.environment:
            environment = load_environment(self.rollout.environment)
        environments = self.environments
        if environments is None:
            environments = load_environments(self.rollout.environment, self.rollout.environments)
        methods = list(environment.methods) if environment is not None else []
        for each in environments.values():
            methods += [m for m in each.methods if m not in methods]
        listed = [schema.get("function", schema).get("name") for schema in self.fmt.tools]
        if sorted(map(str, listed)) != sorted([*tools, *methods]):
            raise ValueError(
                f"the prompt lists the tools {listed}, the agent has {[*tools, *methods]}: "
                "give PromptFormat(tools=...) the agent's tools' schemas"
            )
        object.__setattr__(self, "tools", tools)
        object.__setattr__(self, "environment", environment)
        object.__setattr__(self, "environments", dict(environments))

    def world(self, problem: Problem) -> tuple[str, Environment | None]:
        """The environment a problem's trajectories open, and its name in
        `rollout.environments` ("" for `rollout.environment`'s, or for none)."""
        if self.environments:
            name = chosen_environment(problem.row, list(self.environments), problem.id)
            return name, self.environments[name]
        return "", self.environment


def in_flight_limit(scheduler: Scheduler) -> int:
    """How many trajectories to run at once on these engines: twice the rows the in-process
    engines decode together (the second half waits on tool calls or queues), or 0 (no limit)
    when an engine does not say (a server keeps its own queue). Unbounded, every next turn
    queued behind all the first ones, by when the prefix cache had often let its context go:
    320 trajectories of the real SFT policy on a 2-core AMD EPYC reused 71K prompt tokens from the
    prefix cache unbounded and 112K bounded (128), in 241 and 231 s."""
    rows = [s.engine.max_batch if isinstance(s.engine, Batched) else 0 for s in scheduler.slots]
    return 2 * sum(rows) if all(rows) else 0


def seed_of(*parts: str | int) -> int:
    """A seed derived from `parts` (sample j of a problem: `seed_of(seed, key, j)`; RL's data
    order: `seed_of(seed, epoch)`)."""
    return zlib.crc32(" ".join(map(str, parts)).encode()) & 0x7FFFFFFF


async def collect(
    agent: Agent,
    problems: Sequence[Problem],
    k: int,
    verifier: Verifier,
    *,
    seed: int = 0,
    keys: Sequence[str | int] | None = None,
    progress: str = "",
    on_trajectory: Callable[[Trajectory], None] | None = None,
    concurrency: int | None = None,
) -> list[list[Trajectory]]:
    """k scored trajectories per problem (`reward` and `final_answer` set), in problem order.
    With a `Scheduler`, each trajectory leases one of its engines. `progress`: the label of a
    progress bar over the trajectories (none when empty); `on_trajectory` is called with each
    one as soon as it is scored. At most `concurrency` trajectories run at once (0: all; None:
    `in_flight_limit` of the engines)."""
    engine = agent.engine
    retry_s = agent.rollout.server_retry_s
    scheduler = (
        engine if isinstance(engine, Scheduler) else Scheduler([engine], "static", retry_s=retry_s)
    )
    keys = list(keys) if keys is not None else [p.id for p in problems]
    if len(keys) != len(problems):
        raise ValueError(f"collect: {len(keys)} keys for {len(problems)} problems")
    limit = in_flight_limit(scheduler) if concurrency is None else concurrency
    gate = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()

    # each problem's prompt rendered once, when its first sample passes the gate (rendering
    # them all before it blocked the event loop ~1.8 s for 2,000 samples)
    rendered: dict[int, list[int]] = {}

    for name in agent.rollout.reward_functions:  # a wrong name fails before any sampling
        load_reward_function(name)
    check_weights(agent.rollout.reward_functions, agent.rollout.reward_weights)
    if agent.rollout.action_parser:  # as a wrong reward function's, before any sampling
        load_action_parser(agent.rollout.action_parser)
    scored_by_gold = not agent.rollout.reward_functions
    # each problem's environment, and a problem no environment can score, before any sampling
    worlds = {id(problem): agent.world(problem) for problem in problems}
    for problem in problems:
        environment = worlds[id(problem)][1]
        if environment is None or environment.owns_reward or not scored_by_gold:
            continue
        if not problem.answer:
            raise RunError(
                f"problem {problem.id}: no gold answer, and {environment.label} has no "
                "get_reward to score it (give the problems answers, or the environment a reward)"
            )

    def prompt_of(problem: Problem, appended: str) -> list[int]:
        listing = worlds[id(problem)][0]  # the environment whose tools the prompt lists
        if appended:  # an environment's reset text: this trajectory's own prompt
            return agent.fmt.prompt_ids(problem.problem, appended, listing)
        if id(problem) not in rendered:
            rendered[id(problem)] = agent.fmt.prompt_ids(problem.problem, "", listing)
        return rendered[id(problem)]

    async def sample(problem: Problem, key: str | int, index: int) -> Trajectory:
        episode = None
        environment = worlds[id(problem)][1]
        try:
            async with gate, scheduler.lease() as leased:
                tools, done = toolbox(agent.tools), None
                if environment is not None:
                    episode = await environment.open(problem.row)
                    tools, done = {**tools, **episode.tools}, episode.done
                prompt = prompt_of(problem, episode.reset_text if episode is not None else "")
                trajectory = await run_trajectory(
                    leased,
                    tools,
                    agent.fmt,
                    agent.rollout,
                    prompt_id=problem.id,
                    sample_index=index,
                    prompt_ids=prompt,
                    seed=seed_of(seed, key, index),
                    done=done,
                )
            own = None  # the environment's reward, where it has one
            if episode is not None and episode.environment.owns_reward:
                own = await episode.reward(agent.rollout.environment_reward == "sum")
            if agent.rollout.reward_functions:  # TRL's reward functions, plus get_reward
                trajectory.reward = await trl_reward(
                    agent.rollout.reward_functions,
                    weights=agent.rollout.reward_weights,
                    prompt=problem.problem + (episode.reset_text if episode else ""),
                    completion=trajectory.text,
                    completion_ids=list(trajectory.response_ids),
                    row=problem.row,
                    environment=episode.instance if episode else None,
                    environment_reward=own,
                )
            elif own is not None:
                trajectory.reward = own
            if trajectory.reward is not None:
                trajectory.final_answer = ""
        except EnvFault as fault:  # the environment's server, not the model: left out
            trajectory = Trajectory(
                problem.id, index, prompt_of(problem, ""), [], [], [], RolloutStatus.ERROR
            )
            trajectory.text = f"[environment fault: {fault}]"  # status error: never in a group
        finally:
            if episode is not None:
                await episode.close()
        if trajectory.reward is None:  # the gold scores it (a fault's: unscorable all the same)
            result = await verifier.score_async(trajectory, problem.gold)
            trajectory.reward, trajectory.final_answer = result.reward, result.extracted
            trajectory.scorer_failed = bool(problem.task) and result.reason in UNSCORED
        bar.update()
        if on_trajectory is not None:
            on_trajectory(trajectory)
        return trajectory

    with progress_bar(
        total=len(problems) * k, desc=progress, unit="traj", leave=False, disable=not progress
    ) as bar:
        flat = await asyncio.gather(
            *(sample(p, key, i) for p, key in zip(problems, keys, strict=True) for i in range(k))
        )
    return [list(flat[j * k : (j + 1) * k]) for j in range(len(problems))]
