import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from codeloop.bench import scheduler as bench_scheduler
from codeloop.bench.scheduler import SimEngine, Trajectory, _Prompt, run_simulated
from codeloop.engine import scheduler as scheduler_module
from codeloop.engine.protocol import EngineUnavailable, Generation, SamplingParams
from codeloop.engine.scheduler import Scheduler

PARAMS = SamplingParams(1)


class Recorder:
    def __init__(self, name: str, log: list[str], gate: asyncio.Event | None = None) -> None:
        self.name, self.log, self.gate = name, log, gate

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.log.append(self.name)
        if self.gate is not None:
            await self.gate.wait()
        return Generation([1], [-0.1], "stop")


def _engines(log: list[str], *names: str, gate: asyncio.Event | None = None) -> list[Recorder]:
    return [Recorder(name, log, gate) for name in names]


def test_static_splits_round_robin_or_in_contiguous_chunks() -> None:
    async def main(batch_size: int) -> list[str]:
        log: list[str] = []
        scheduler = Scheduler(_engines(log, "a", "b", "c"), "static", batch_size=batch_size)
        for _ in range(6):
            async with scheduler.lease() as engine:
                await engine.generate([1], PARAMS)
                await engine.generate([1], PARAMS)  # a second turn stays on the same engine
        return log

    assert asyncio.run(main(0)) == ["a", "a", "b", "b", "c", "c"] * 2
    assert asyncio.run(main(6)) == ["a"] * 4 + ["b"] * 4 + ["c"] * 4


def test_kv_aware_reserves_context_plus_max_tokens_and_waits_for_room() -> None:
    async def main() -> tuple[list[str], list[str]]:
        log: list[str] = []
        events: list[str] = []
        gates = {name: asyncio.Event() for name in ("t1", "t2", "t3")}
        engines = [Recorder("a", log, gates["t1"]), Recorder("b", log, gates["t2"])]
        scheduler = Scheduler(engines, "kv_aware", capacity_tokens=100)

        async def trajectory(name: str) -> None:
            async with scheduler.lease() as engine:
                await engine.generate([1] * 40, SamplingParams(20))  # reserves 60
                events.append(f"{name} done")

        tasks = [asyncio.create_task(trajectory(n)) for n in ("t1", "t2", "t3")]
        await asyncio.sleep(0.05)
        assert [s.reserved_tokens for s in scheduler.slots] == [60, 60]  # t3 waits: 40 free
        assert log == ["a", "b"]
        gates["t2"].set()  # t2 ends; t3 takes b's room (b's gate is open now) and ends
        await asyncio.sleep(0.05)
        assert events == ["t2 done", "t3 done"]
        assert [s.reserved_tokens for s in scheduler.slots] == [60, 0]
        gates["t1"].set()
        await asyncio.gather(*tasks)
        assert [s.reserved_tokens for s in scheduler.slots] == [0, 0]
        return log, events

    log, events = asyncio.run(main())
    assert log == ["a", "b", "b"]
    assert events == ["t2 done", "t3 done", "t1 done"]


def test_kv_aware_admits_the_longest_context_first() -> None:
    async def main() -> list[int]:
        gate = asyncio.Event()
        order: list[int] = []

        class Tracker(Recorder):
            async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
                order.append(len(prompt_ids))
                return await super().generate(prompt_ids, params)

        scheduler = Scheduler([Tracker("a", [], gate)], "kv_aware", capacity_tokens=100)

        async def call(context: int) -> None:
            async with scheduler.lease() as engine:
                await engine.generate([1] * context, SamplingParams(10))

        first = asyncio.create_task(call(80))  # holds 90 of 100: the others wait
        await asyncio.sleep(0.01)
        waiting = [asyncio.create_task(call(c)) for c in (10, 30, 20)]
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(first, *waiting)
        return order

    assert asyncio.run(main()) == [80, 30, 20, 10]


class HeldAt(Recorder):
    """Calls with a context of `held` tokens wait for the gate; the others return at once."""

    def __init__(self, name: str, log: list[str], gate: asyncio.Event, held: int) -> None:
        super().__init__(name, log, gate)
        self.held = held

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.log.append(self.name)
        if len(prompt_ids) == self.held:
            await self.gate.wait()  # type: ignore[union-attr]
        return Generation([1], [-0.1], "stop")


def test_kv_aware_keeps_a_trajectory_on_its_engine_and_moves_only_with_room_to_spare() -> None:
    async def main(move_share: float) -> list[str]:
        log: list[str] = []
        gate = asyncio.Event()
        engines = [HeldAt(name, log, gate, held=60) for name in ("a", "b")]
        scheduler = Scheduler(engines, "kv_aware", capacity_tokens=100, move_share=move_share)
        async with scheduler.lease() as mine, scheduler.lease() as filler:
            await mine.generate([1] * 10, SamplingParams(10))  # both empty: a, the first
            held = asyncio.create_task(filler.generate([1] * 60, SamplingParams(10)))
            await asyncio.sleep(0.01)  # filler holds 70 on a (a tie again: a)
            await mine.generate([1] * 10, SamplingParams(10))  # fits a's 30: stays on a
            moved = asyncio.create_task(mine.generate([1] * 40, SamplingParams(10)))
            await asyncio.sleep(0.01)  # 50 does not fit a: b, if b has room to spare
            gate.set()
            await asyncio.gather(held, moved)
        return log

    assert asyncio.run(main(0.0)) == ["a", "a", "a", "b"]
    assert asyncio.run(main(0.6)) == ["a", "a", "a", "a"]  # b lacks 50 + 60: waits for a


def test_an_oversized_call_runs_on_an_idle_engine() -> None:
    async def main() -> str:
        log: list[str] = []
        scheduler = Scheduler(_engines(log, "a"), "kv_aware", capacity_tokens=100)
        async with scheduler.lease() as engine:
            await asyncio.wait_for(engine.generate([1] * 500, SamplingParams(500)), 1)
        return log[0]

    assert asyncio.run(main()) == "a"


def test_least_outstanding_routes_each_call_to_the_least_busy_engine() -> None:
    async def main() -> list[str]:
        log: list[str] = []
        gate = asyncio.Event()
        scheduler = Scheduler(_engines(log, "a", "b", gate=gate), "least_outstanding")
        async with scheduler.lease() as engine:
            calls = [asyncio.create_task(engine.generate([1], PARAMS)) for _ in range(4)]
            await asyncio.sleep(0.02)
            gate.set()
            await asyncio.gather(*calls)
        return log

    assert sorted(asyncio.run(main())) == ["a", "a", "b", "b"]


def test_bad_configuration() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        Scheduler([Recorder("a", [])], "fastest")
    with pytest.raises(ValueError, match="at least one engine"):
        Scheduler([], "static")


# -- the simulation --------------------------------------------------------------------------


def test_the_virtual_clock_jumps_instead_of_sleeping() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        await asyncio.gather(asyncio.sleep(3600), asyncio.sleep(1800))
        return loop.time()

    wall = time.perf_counter()
    assert run_simulated(main()) == pytest.approx(3600)
    assert time.perf_counter() - wall < 1


def test_sim_engine_steps_caches_prefixes_and_preempts_on_overflow() -> None:
    async def main() -> tuple[float, SimEngine]:
        engine = SimEngine(capacity=100, step_ms=10, saturation=2, prefill_ms=1)
        loop = asyncio.get_running_loop()
        # three requests of 40 context: all start (120 > 100? no: the third waits)
        await asyncio.gather(
            *(engine.generate(_Prompt(k, 40, 5), SamplingParams(5)) for k in range(3))
        )
        return loop.time(), engine

    elapsed, engine = run_simulated(main())
    # two start (80 tokens, prefill 80 x 1 ms), 5 steps of 10 ms; then the third (prefill 40)
    assert engine.preemptions == 0
    assert engine.prefill_tokens == 120
    assert elapsed == pytest.approx(0.080 + 5 * 0.010 + 0.040 + 5 * 0.010)

    async def cached() -> SimEngine:
        engine = SimEngine(capacity=100, step_ms=10, saturation=2, prefill_ms=1)
        await engine.generate(_Prompt(7, 30, 10), SamplingParams(10))
        await engine.generate(_Prompt(7, 50, 1), SamplingParams(1))  # 40 cached + 10 new
        return engine

    assert run_simulated(cached()).prefill_tokens == 30 + 10

    async def overflow() -> SimEngine:
        engine = SimEngine(capacity=100, step_ms=10, saturation=2, prefill_ms=0)
        await asyncio.gather(
            *(engine.generate(_Prompt(k, 45, 20), SamplingParams(20)) for k in range(2))
        )
        return engine

    engine = run_simulated(overflow())  # 90 -> 100 after 5 steps -> 102: the newest is preempted
    assert engine.preemptions == 1
    assert engine.prefill_tokens == 45 + 45 + 51


def test_lower_bound_by_hand() -> None:
    import argparse

    args = argparse.Namespace(engines=2, capacity=1000, step_ms=10.0, saturation=2, prefill_ms=1.0)
    trajectories = [Trajectory(10, [4, 2], [(1.5, 3)]), Trajectory(20, [6], [])]
    bound = bench_scheduler.lower_bound(trajectories, args)
    # work: 12 tokens x 5 ms + 33 prefilled x 1 ms, over 2 engines
    assert bound["work_s"] == pytest.approx((12 * 0.005 + 33 * 0.001) / 2)
    # memory: per sampled token its context x 10 ms, over 2 x 1000 tokens
    token_contexts = [11, 12, 13, 14] + [18, 19] + [21, 22, 23, 24, 25, 26]
    assert bound["memory_s"] == pytest.approx(sum(token_contexts) * 0.010 / 2000)
    # the first alone: 6 steps, 13 prefilled, a 1.5 s tool call
    assert bound["longest_s"] == pytest.approx(6 * 0.010 + 0.013 + 1.5)
    assert bound["bound_s"] == bound["longest_s"]


def test_bench_scheduler_kv_aware_never_overflows(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    args = [
        "--prompts",
        "16",
        "--group",
        "8",
        "--engines",
        "2",
        "--seeds",
        "1",
        "--capacity",
        "16384",
        "--steps",
        "3",
        "--max-staleness",
        "1",
        "--out",
        str(out),
    ]
    assert bench_scheduler.main(args) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    training = result["training"]
    assert [(r["mix"], r["mode"]) for r in training] == [
        (mix, mode) for mix in ("heavy", "light") for mode in ("sync", "async, staleness 1")
    ]
    for sync, ahead in zip(training[::2], training[1::2], strict=True):
        # engines idle while a synchronous batch trains; async keeps them generating
        assert sync["idle"] > 0.05 and ahead["idle"] < 0.01
        assert sync["regenerated"] == 0 and sync["trained_tokens"] > 0
    assert [(r["mix"], r["policy"]) for r in rows] == [
        (mix, policy)
        for mix in ("heavy", "light")
        for policy in ("static", "least_outstanding", "kv_aware")
    ]
    for row in rows:
        assert row["makespan_s"] >= row["bound"]["bound_s"] * 0.999
        assert 0 <= row["idle"] < 1
    assert all(r["preemptions"] == 0 for r in rows if r["policy"] == "kv_aware")
    assert any(r["preemptions"] > 0 for r in rows if r["policy"] == "static")


def test_a_scheduler_takes_each_engines_own_kv_capacity_when_none_is_set() -> None:
    from codeloop.config import RolloutConfig

    class Sized:  # `KVReporting`: its capacity, its use not yet known
        def __init__(self, capacity: int) -> None:
            self.kv_capacity_tokens, self.kv_tokens_used = capacity, None

    class Unsized:
        pass

    engines = [Sized(1000), Sized(0), Unsized()]
    slots = Scheduler.for_rollout(engines, RolloutConfig(), sharing=2).slots  # type: ignore[arg-type]
    assert [s.capacity_tokens for s in slots] == [500, 1 << 40, 1 << 40]  # unknown: no limit
    set_here = Scheduler.for_rollout(engines, RolloutConfig(kv_capacity_tokens=300)).slots  # type: ignore[arg-type]
    assert [s.capacity_tokens for s in set_here] == [300, 300, 300]  # the config wins


def test_training_loop_simulation_by_hand() -> None:
    import argparse

    # one prompt x one sample a step; a trajectory is 10 decode steps of 10 ms (0.1 s, batch
    # size free up to 1,000); an update takes 500 x its work (10 tokens x 10 ms / 1,000) = 0.05 s
    args = argparse.Namespace(
        engines=1,
        capacity=10_000,
        step_ms=10.0,
        saturation=1000,
        prefill_ms=0.0,
        prompts=1,
        group=1,
        steps=3,
        train_share=500.0,
        turn_cap=100,
        budget=100,
    )
    groups = [[Trajectory(20, [10], [])] for _ in range(8)]

    def run(mode: str, staleness: int) -> dict[str, Any]:
        return run_simulated(bench_scheduler._training(mode, staleness, groups, args))

    sync = run("sync", 0)  # steps end at 0.15, 0.30, 0.45
    assert sync["makespan_s"] == pytest.approx(0.45)
    assert sync["s_per_token"] == pytest.approx((0.45 - 0.15) / 20)
    # Staleness 0: a group starts only when the last one is taken and the weights published,
    # which is the synchronous schedule.
    assert run("async", 0)["makespan_s"] == pytest.approx(0.45)
    # Staleness 1: groups 0 and 1 generate together (done at 0.10); 0 trains (to 0.15), then 1
    # (sampled by version 0, trained at version 1: allowed) while group 2 generates (0.15-0.25);
    # group 2 trains 0.25-0.30. Steps end at 0.15, 0.20, 0.30.
    ahead = run("async", 1)
    assert ahead["makespan_s"] == pytest.approx(0.30)
    assert ahead["s_per_token"] == pytest.approx((0.30 - 0.15) / 20)
    assert ahead["regenerated"] == 0 and ahead["trained_tokens"] == 30


class Flaky(Recorder):
    """An engine that cannot serve its first `failures` calls (a server down, then back)."""

    def __init__(self, name: str, log: list[str], failures: int) -> None:
        super().__init__(name, log)
        self.failures = failures

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if self.failures:
            self.failures -= 1
            self.log.append(f"{self.name} down")
            raise EngineUnavailable(f"{self.name} cannot serve")
        return await super().generate(prompt_ids, params)


@pytest.mark.parametrize("policy", ["static", "least_outstanding", "kv_aware"])
def test_a_call_that_an_engine_cannot_serve_goes_to_another_and_it_is_left_out(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler_module, "COOL_DOWN_S", 0.2)

    async def main() -> list[str]:
        log: list[str] = []
        scheduler = Scheduler([Flaky("a", log, 1), Recorder("b", log)], policy, capacity_tokens=100)
        for _ in range(3):  # each trajectory would start on a (static: every other one)
            async with scheduler.lease() as engine:
                await engine.generate([1], PARAMS)
        await asyncio.sleep(0.3)  # the cool-down is over: a serves again
        async with scheduler.lease() as engine:
            await engine.generate([1], PARAMS)
        # nothing is left counted against either engine, the failed call's neither
        assert [(s.outstanding, s.reserved_tokens) for s in scheduler.slots] == [(0, 0)] * 2
        return log

    log = asyncio.run(main())
    # a failed once: that call went to b, and a was left out while it cooled down
    assert log[:4] == ["a down", "b", "b", "b"]
    assert log[4] == ("b" if policy == "static" else "a")  # static: the 4th is b's by turn
    assert len(log) == 5


def test_with_every_engine_down_a_call_waits_for_one_and_gives_up_after_retry_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scheduler_module, "COOL_DOWN_S", 0.05)

    async def main(failures: int, retry_s: float) -> tuple[list[str], float]:
        log: list[str] = []
        scheduler = Scheduler([Flaky("a", log, failures)], "kv_aware", retry_s=retry_s)
        started = time.monotonic()
        try:
            async with scheduler.lease() as engine:
                await engine.generate([1], PARAMS)
        except EngineUnavailable:
            log.append("gave up")
        return log, time.monotonic() - started

    log, took = asyncio.run(main(3, retry_s=5.0))
    assert log == ["a down"] * 3 + ["a"] and took >= 3 * 0.05  # tried again after each cool-down
    log, took = asyncio.run(main(100, retry_s=0.3))
    assert log[-1] == "gave up" and 4 <= log.count("a down") <= 8 and took < 1.0


def test_once_every_engine_has_failed_for_retry_s_a_call_fails_at_once_between_probes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scheduler_module, "COOL_DOWN_S", 0.1)

    async def main() -> list[tuple[int, float]]:
        log: list[str] = []
        scheduler = Scheduler([Flaky("a", log, 100)], "static", retry_s=0.25)
        seen = []
        for pause in (0.0, 0.0, 0.15):  # the last after a cool-down: a tries once more
            await asyncio.sleep(pause)
            started = time.monotonic()
            async with scheduler.lease() as engine:
                with pytest.raises(EngineUnavailable):
                    await engine.generate([1], PARAMS)
            seen.append((log.count("a down"), time.monotonic() - started))
        return seen

    (first, took), (second, at_once), (third, _) = asyncio.run(main())
    assert took >= 0.25 and first >= 3  # the outage's first call waited retry_s
    assert second == first and at_once < 0.05  # the next failed without trying or waiting
    assert third == first + 1  # a probe after the cool-down


def test_with_every_engine_cooling_down_a_call_waits_for_the_first_back() -> None:
    async def main() -> tuple[list[str], float]:
        log: list[str] = []
        scheduler = Scheduler(_engines(log, "a", "b"), "least_outstanding")
        now = asyncio.get_running_loop().time()
        scheduler.slots[0].down_until, scheduler.slots[1].down_until = now + 1.0, now + 0.1
        started = time.monotonic()
        async with scheduler.lease() as engine:
            await engine.generate([1], PARAMS)
        return log, time.monotonic() - started

    log, waited = asyncio.run(main())
    assert log == ["b"] and 0.1 <= waited < 0.6


def test_a_dead_engine_does_not_fail_calls_that_a_live_one_can_serve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scheduler_module, "COOL_DOWN_S", 5.0)

    async def main() -> list[str]:
        log: list[str] = []
        scheduler = Scheduler([Flaky("a", log, 100), Recorder("b", log)], "static", retry_s=0.05)
        for _ in range(2):  # the first finds a dead, then b; a is past retry_s for the second
            async with scheduler.lease() as engine:
                await engine.generate([1], PARAMS)
            await asyncio.sleep(0.1)
        return log

    assert asyncio.run(main()) == ["a down", "b", "b"]


def test_kv_aware_places_by_room_and_capacity() -> None:
    async def main(capacities: list[int], calls: list[int]) -> tuple[list[str], list[str]]:
        log: list[str] = []
        gate = asyncio.Event()
        scheduler = Scheduler(
            [Recorder("a", log, gate), Recorder("b", log, gate)],
            "kv_aware",
            capacity_tokens=capacities,
        )

        async def call(tokens: int) -> None:
            async with scheduler.lease() as engine:
                await engine.generate([1] * (tokens - 10), SamplingParams(10))

        tasks = []
        for tokens in calls:
            tasks.append(asyncio.create_task(call(tokens)))
            await asyncio.sleep(0.05)
        admitted = list(log)
        gate.set()
        await asyncio.gather(*tasks)
        return admitted, log

    # a first call goes to the engine with the most room
    assert asyncio.run(main([100, 200], [10])) == (["b"], ["b"])
    # 150 fits b only; 50 is exactly b's room left; 120 fits b only, which is full: it waits
    # for b rather than run on idle a (it is not larger than every engine)
    assert asyncio.run(main([40, 200], [150, 50, 120])) == (["b", "b"], ["b", "b", "b"])
    # as large as the largest engine: it waits for that one too
    assert asyncio.run(main([40, 200], [150, 200])) == (["b"], ["b", "b"])
