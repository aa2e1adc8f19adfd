import asyncio
import copy
import json
import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_rl import PROBLEMS, _config, _served_policy

from codeloop.algo.loss import behaviour_weights, policy_loss
from codeloop.config import ConfigError, SandboxConfig
from codeloop.data.problems import Problem
from codeloop.engine.hf_engine import TransformersEngine
from codeloop.engine.model import tiny_model
from codeloop.engine.protocol import Generation, SamplingParams
from codeloop.eval.viewer import render
from codeloop.rollout.prompt import PromptFormat
from codeloop.sandbox.pool import LocalSandbox
from codeloop.trainer.async_rl import Gate, GatedEngine
from codeloop.trainer.batch import Sample
from codeloop.trainer.checkpoint import read_state
from codeloop.trainer.distributed import World
from codeloop.trainer.learner import Learner
from codeloop.trainer.logs import RunLogger, read_metrics
from codeloop.trainer.rl import RLRun, build_run

MORE = PROBLEMS + [
    Problem(f"q{i}", f"What is {a} + {b}?", str(a + b))
    for i, (a, b) in enumerate([(2, 5), (6, 1), (4, 4), (9, 3)])
]


def _async_run(
    fmt: PromptFormat,
    weights: Any,
    run_dir: Path,
    steps: int,
    resume: bool = False,
    fail_at: int = 0,
    **trainer: Any,
) -> tuple[list[dict[str, float]], RLRun]:
    """An async RL run on MORE; `fail_at` = k: the k-th update raises (a stop mid-step)."""

    async def main() -> tuple[list[dict[str, float]], RLRun]:
        model = tiny_model(len(fmt.tokenizer), hidden_size=64, layers=2)
        model.load_state_dict(weights)
        engine = TransformersEngine(
            copy.deepcopy(model), fmt.tokenizer, fmt.end_of_turn_ids, batch_window_ms=0
        )
        cfg = _config(run_dir)
        cfg.trainer.mode, cfg.trainer.max_staleness = "async", 1
        for key, value in trainer.items():
            setattr(cfg.trainer, key, value)
        async with LocalSandbox(SandboxConfig(workers=1)) as sandbox:
            logger = RunLogger(run_dir)
            run = build_run(cfg, model, fmt, MORE, tools=sandbox, logger=logger, engine=engine)
            if resume:
                assert run.resume()
            if fail_at:
                update, calls = run.learner.update_async, [0]

                async def failing(
                    samples: list[Sample], in_thread: bool | None = None
                ) -> dict[str, float]:
                    calls[0] += 1
                    if calls[0] == fail_at:
                        raise KeyboardInterrupt("stopped mid-step")
                    return await update(samples, in_thread)

                run.learner.update_async = failing  # type: ignore[method-assign]
            try:
                return await run.train(steps), run
            finally:
                logger.close()
                await run.close()

    return asyncio.run(main())


def _trained_positions(run_dir: Path) -> dict[int, list[int]]:
    """step -> the data positions whose groups trained in it (from the trajectory dumps)."""
    out = {}
    for path in sorted((run_dir / "trajectories").glob("step_*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        out[int(path.stem.split("_")[1])] = sorted({r["position"] for r in records if r["kept"]})
    return out


@pytest.mark.slow
def test_async_steps_train_within_the_staleness_bound(
    trainer_fmt: PromptFormat, sft_weights: Any, tmp_path: Path
) -> None:
    metrics, run = _async_run(trainer_fmt, sft_weights, tmp_path, 3)
    # 2 groups a step, or fewer (even none) after 8 without signal in a row: the tiny policy
    # answers most of MORE right, so a step without a group to train on happens by chance
    kept = [m["rollout/groups_kept"] for m in metrics]
    assert all(0 <= k <= 2 for k in kept) and sum(kept) > 0
    for m, k in zip(metrics, kept, strict=True):
        assert 0 <= m["async/staleness_mean"] <= m["async/staleness_max"] <= 1
        assert (m["loss/policy_tokens"] > 0) == (k > 0)
        assert (m["throughput/trained_tokens_per_s"] > 0) == (k > 0)
        assert 0.0 <= m["async/overlap"] <= 1.0
    trained = _trained_positions(tmp_path)
    flat = [p for step in trained.values() for p in step]
    assert len(flat) == sum(kept) and len(set(flat)) == len(flat)  # each trained once
    dumped = [
        json.loads(line)
        for path in (tmp_path / "trajectories").glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]
    for record in dumped:  # tokens of versions 0..2 (the weights of steps 0, 1, 2)
        assert record["versions"] and 0 <= record["versions"][0] <= record["versions"][1] <= 2
    assert any(r["versions"][1] > 0 for r in dumped)  # later groups sampled with new weights
    for name, value in run.learner.model.state_dict().items():  # the engine serves the last weights
        assert torch.equal(value, run.rollout.engines[0].model.state_dict()[name])
    assert run.rollout.engines[0].version == 3
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    page, shown, _ = render(tmp_path)  # `codeloop view` plots the async metrics
    for name in ("async/staleness_mean", "async/regenerated_groups", "async/overlap"):
        assert f'data-metric="{name}"' in page
    assert shown == len(dumped)


@pytest.mark.slow
def test_no_staleness_means_every_trained_token_is_on_policy(
    trainer_fmt: PromptFormat, sft_weights: Any, tmp_path: Path
) -> None:
    metrics, _ = _async_run(
        trainer_fmt, sft_weights, tmp_path, 2, max_staleness=0, partial_rollout="wait"
    )
    assert [m["async/staleness_max"] for m in metrics] == [0.0, 0.0]
    dumped = [
        json.loads(line)
        for path in (tmp_path / "trajectories").glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]
    for record in dumped:
        if record["kept"]:  # trained in step s: sampled by the weights of step s - 1 only
            assert record["versions"][0] == record["versions"][1]


@pytest.mark.slow
def test_a_stop_mid_step_loses_and_duplicates_no_problem(
    trainer_fmt: PromptFormat, sft_weights: Any, tmp_path: Path
) -> None:
    with pytest.raises(KeyboardInterrupt):
        _async_run(trainer_fmt, sft_weights, tmp_path, 4, fail_at=3)
    before = _trained_positions(tmp_path)
    assert sorted(before) == [1, 2]  # step 3 died in its update: not logged
    checkpoint = read_state(tmp_path / "checkpoints" / "step_000002")
    pending = checkpoint["extra"]["sources"]["async"]["pending"]
    drawn = checkpoint["extra"]["data_position"]
    assert pending, "groups were in flight or queued at the checkpoint"
    _, run = _async_run(trainer_fmt, sft_weights, tmp_path, 2, resume=True)
    assert run.step_index == 4
    after = _trained_positions(tmp_path)
    flat = [p for step in after.values() for p in step]
    kept = sum(m["rollout/groups_kept"] for m in read_metrics(tmp_path))
    assert len(flat) == kept >= 4 and len(set(flat)) == len(flat)  # none trained twice
    seen = set()
    for path in (tmp_path / "trajectories").glob("*.jsonl"):
        seen |= {json.loads(line)["position"] for line in path.read_text().splitlines()}
    # every position drawn before the stop was trained or dropped (without signal) afterwards
    # or before it, or is still pending now
    still = set(run.state.sources["async"]["pending"])
    assert set(range(drawn)) <= seen | still
    assert set(pending) <= seen | still


def test_the_gate_holds_new_calls_until_those_inside_are_done() -> None:
    class Slow:
        def __init__(self) -> None:
            self.started: list[int] = []

        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
            self.started.append(prompt_ids[0])
            await asyncio.sleep(0.05)
            return Generation([1, 2], [-0.5, -0.5], "stop")

    async def main() -> None:
        gate, slow = Gate(version=3), Slow()
        engine = GatedEngine(slow, gate)  # type: ignore[arg-type]
        first = asyncio.create_task(engine.generate([1], SamplingParams(2)))
        await asyncio.sleep(0.01)
        order: list[str] = []

        async def update() -> None:
            async with gate.closed():
                order.append(f"update with {gate.inside} inside")
                gate.version = 4
                second = asyncio.create_task(engine.generate([2], SamplingParams(2)))
                await asyncio.sleep(0.02)
                order.append(f"started {slow.started}")
            await second
            assert (await second).versions == [4, 4]

        await update()
        assert (await first).versions == [3, 3]  # entered before the update
        assert order == ["update with 0 inside", "started [1]"]

    asyncio.run(main())


def test_decoupled_weights_and_loss_by_hand() -> None:
    # prox logprobs (recomputed) -0.5, -1.0; behaviour (engine) -1.0, -0.2; cap 1.5
    sample = Sample([1, 2, 3], [0, 1, 1], [0.0, -0.5, -1.0], 1.0)
    weights = behaviour_weights(sample.old_logprobs, [0.0, -1.0, -0.2], sample.loss_mask, cap=1.5)
    assert weights == pytest.approx([0.0, min(math.exp(0.5), 1.5), math.exp(-0.8)])
    assert weights[1] == 1.5  # exp(0.5) = 1.65, truncated
    # new logprobs -0.4, -1.0 against prox -0.5, -1.0: ratios e^0.1 = 1.105 and 1; A = 1
    logprobs, old = torch.tensor([[-0.4, -1.0]]), torch.tensor([[-0.5, -1.0]])
    mask = torch.ones(1, 2)
    loss, _ = policy_loss(
        logprobs, old, torch.tensor([1.0]), mask, denominator=2, weights=torch.tensor([weights[1:]])
    )
    expected = -(1.5 * math.exp(0.1) + math.exp(-0.8) * 1.0) / 2
    assert float(loss) == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_async_rl_on_a_server_waits_for_requests_before_each_reload(
    trainer_fmt: PromptFormat, sft_weights: Any, tmp_path: Path, codeloop_serve: Any
) -> None:
    fmt = trainer_fmt
    model, served, cfg = _served_policy(fmt, sft_weights, tmp_path)
    cfg.rollout.backend, cfg.trainer.mode, cfg.trainer.max_staleness = "openai", "async", 1

    async def main(url: str) -> list[dict[str, float]]:
        cfg.rollout.endpoints = [url]
        async with LocalSandbox(SandboxConfig(workers=1)) as sandbox:
            logger = RunLogger(tmp_path / "run")
            run = build_run(cfg, model, fmt, MORE, tools=sandbox, logger=logger)
            try:
                with pytest.raises(ConfigError, match="servers need 'wait'"):
                    await run.train(1)  # partial_rollout = continue: not with a server
                cfg.trainer.partial_rollout = "wait"
                return await run.train(2)  # each reload is checked (rollout.reload_check_tol)
            finally:
                logger.close()
                await run.close()

    with codeloop_serve(served) as url:
        metrics = asyncio.run(main(url))
    # the policy solves about one sample in ten: a step whose refill rounds all draw groups
    # without signal trains none (and says so); the run as a whole trains
    assert all(m["rollout/groups_kept"] <= 2 for m in metrics)
    assert sum(m["rollout/groups_kept"] for m in metrics) > 0
    assert all(m["async/staleness_max"] <= 1 for m in metrics)
    dumped = [
        json.loads(line)
        for path in (tmp_path / "run" / "trajectories").glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]
    # a server does not say which weights sampled a token: the gate stamps the version current
    # when the call entered, exact since no reload runs while a call is inside
    assert {v for r in dumped for v in r["versions"]} <= {0, 1}


def test_a_step_without_any_signal_ends_after_the_refill_budget(
    trainer_fmt: PromptFormat, tmp_path: Path
) -> None:
    fmt = trainer_fmt

    class AlwaysRight:  # every sample right: no group has signal
        version = 0

        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
            ids = fmt.encode("<answer>\\\\boxed{3}</answer><|im_end|>")
            return Generation(ids, [-0.1] * len(ids), "stop")

        def update_weights(self, state: object, version: int = 0) -> None:
            self.version = version

    cfg = _config(tmp_path)
    cfg.trainer.mode = "async"
    problems = [Problem(f"p{i}", "What is 1 + 2?", "3") for i in range(4)]
    model = tiny_model(len(fmt.tokenizer), hidden_size=32)

    async def main() -> list[dict[str, float]]:
        logger = RunLogger(tmp_path)
        run = build_run(cfg, model, fmt, problems, tools=None, logger=logger, engine=AlwaysRight())  # type: ignore[arg-type]
        try:
            return await run.train(2)
        finally:
            logger.close()
            await run.close()

    metrics = asyncio.run(asyncio.wait_for(main(), timeout=120))
    # 2 groups a step; as in sync mode at most 4 rounds' worth (8) are passed over, then the
    # step trains on nothing
    assert [m["rollout/groups_kept"] for m in metrics] == [0, 0]
    assert [m["rollout/groups_dropped"] for m in metrics] == [8, 8]
    assert [m["loss/policy_tokens"] for m in metrics] == [0, 0]


@pytest.mark.parametrize("in_thread", [False, True])
def test_update_async_takes_the_same_step_beside_other_work(
    trainer_fmt: PromptFormat, tmp_path: Path, in_thread: bool
) -> None:
    """On the loop's thread (a CPU's default) the update yields to the loop after each of its
    four micro-batches, so a task beside it runs in between; in a worker thread it runs there.
    Either way the step equals `update`'s."""
    cfg = _config(tmp_path)
    cfg.trainer.micro_batch_tokens, cfg.trainer.updates_per_step = 3, 1  # one sample each
    model = tiny_model(len(trainer_fmt.tokenizer), hidden_size=32, layers=2)
    samples = [
        Sample(
            [5 + i, 6 + i, 7 + i],
            [0, 1, 1],
            [0.0, -1.0, -2.0 - i],
            advantage=1.0 if i % 2 else -1.0,
        )
        for i in range(4)
    ]
    alone, beside = (Learner(copy.deepcopy(model), cfg, World()) for _ in range(2))
    expected = alone.update(copy.deepcopy(samples))
    forwards: list[int] = []  # the thread of each forward pass of `beside`
    beside.model.register_forward_hook(lambda *_: forwards.append(threading.get_ident()))
    seen: list[int] = []  # forward passes done each time the task beside ran

    async def main() -> dict[str, float]:
        async def beside_the_update() -> None:
            while True:
                seen.append(len(forwards))
                await asyncio.sleep(0)

        task = asyncio.create_task(beside_the_update())
        try:
            return await beside.update_async(samples, in_thread)
        finally:
            task.cancel()

    metrics = asyncio.run(main())
    assert metrics == pytest.approx(expected)
    for a, b in zip(alone.model.parameters(), beside.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert len(forwards) == 4
    if in_thread:
        assert threading.get_ident() not in forwards
    else:
        assert set(forwards) == {threading.get_ident()}
        assert {1, 2, 3, 4} <= set(seen)  # the task ran after each micro-batch


def test_a_gated_engine_declares_what_the_engine_behind_it_declares() -> None:
    from codeloop.config import RolloutConfig
    from codeloop.engine.protocol import Batched, KVPolled, KVReporting
    from codeloop.engine.scheduler import Scheduler

    class Plain:
        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
            return Generation([1], [0.0], "stop")

    class InProcess(Plain):
        max_batch, kv_capacity_tokens, kv_tokens_used = 8, 300, 40

    class Served(Plain):
        kv_capacity_tokens, kv_tokens_used = 500, None
        refreshed = 0

        async def refresh_kv(self) -> None:
            Served.refreshed += 1

    gate = Gate()
    plain, local, served = (GatedEngine(e, gate) for e in (Plain(), InProcess(), Served()))
    assert [isinstance(e, Batched) for e in (plain, local, served)] == [False, True, False]
    assert [isinstance(e, KVReporting) for e in (plain, local, served)] == [False, True, True]
    assert all(isinstance(e, KVPolled) for e in (plain, local, served))  # a no-op where none
    assert (local.max_batch, local.kv_capacity_tokens, local.kv_tokens_used) == (8, 300, 40)
    asyncio.run(served.refresh_kv())
    asyncio.run(plain.refresh_kv())
    assert Served.refreshed == 1
    # the scheduler reads each one's capacity (no limit where an engine has none)
    scheduler = Scheduler.for_rollout([plain, local, served], RolloutConfig(), sharing=2)
    assert [s.capacity_tokens for s in scheduler.slots] == [1 << 40, 150, 250]


class _NoRollout:
    """What a `Producer` keeps of a run's rollout side, for a producer that never samples."""

    verifier = None
    engines: list[Any] = []

    def agent(self, batch_size: int, engines: Any) -> None:
        return None


@pytest.mark.parametrize(("max_staleness", "ahead"), [(0, 4), (1, 8), (2, 12)])
def test_the_producer_runs_ahead_by_at_most_the_staleness_bound(
    max_staleness: int, ahead: int
) -> None:
    """With weights of version 2 and 4 groups a step (two steps taken), groups may start for
    the step those weights train next and `max_staleness` steps after it: 4 x (1 + bound)."""
    from codeloop.config import Config
    from codeloop.trainer.async_rl import Producer
    from codeloop.trainer.state import RunState

    cfg = Config()
    cfg.trainer.prompts_per_step, cfg.trainer.max_staleness = 4, max_staleness
    producer = Producer(
        cfg,
        World(),
        RunState(),
        lambda position: Problem(f"p{position}", "What is 1 + 1?", "2"),
        rollout=_NoRollout(),  # type: ignore[arg-type]
        version=2,
        on_scored=lambda trajectory: None,
    )
    started = 0
    while producer._may_start():
        producer.outstanding += 1
        started += 1
    assert producer.taken == 8 and started == ahead
    producer.take(4)  # a step took 4 finished groups, which left the pipeline
    producer.outstanding -= 4
    assert not producer._may_start()  # none more may start before new weights
    producer.publish(3)  # they came
    assert producer._may_start()
