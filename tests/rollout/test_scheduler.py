import asyncio

import pytest

from codeloop.rollout.engine import Generation, SamplingParams
from codeloop.rollout.scheduler import Scheduler

PARAMS = SamplingParams(1)


class Recorder:
    def __init__(self, name: str, log: list[str], gate: asyncio.Event | None = None) -> None:
        self.name, self.log, self.gate = name, log, gate

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.log.append(self.name)
        if self.gate is not None:
            await self.gate.wait()
        return Generation([1], [-0.1], "stop")


def test_static_splits_trajectories_round_robin() -> None:
    async def main() -> list[str]:
        log: list[str] = []
        scheduler = Scheduler(
            [Recorder("a", log), Recorder("b", log), Recorder("c", log)], "static"
        )
        for _ in range(6):
            async with scheduler.lease(5, 5) as engine:
                await engine.generate([1], PARAMS)
                await engine.generate([1], PARAMS)  # a second turn stays on the same engine
        return log

    assert asyncio.run(main()) == ["a", "a", "b", "b", "c", "c"] * 2


def test_kv_aware_admits_by_free_capacity_and_waits_for_room() -> None:
    async def main() -> list[str]:
        log: list[str] = []
        events: list[str] = []
        scheduler = Scheduler(
            [Recorder("a", log), Recorder("b", log)], "kv_aware", capacity_tokens=100
        )

        async def trajectory(name: str, tokens: int, hold: asyncio.Event) -> None:
            async with scheduler.lease(tokens, 0) as engine:
                events.append(f"{name} admitted")
                await engine.generate([1], PARAMS)
                await hold.wait()
            events.append(f"{name} done")

        first, second, third = asyncio.Event(), asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(trajectory("t1", 60, first)),
                 asyncio.create_task(trajectory("t2", 60, second)),
                 asyncio.create_task(trajectory("t3", 60, third))]  # fmt: skip
        await asyncio.sleep(0.05)
        assert events == ["t1 admitted", "t2 admitted"]  # 40 tokens left on each: t3 waits
        assert [s.reserved_tokens for s in scheduler.slots] == [60, 60]
        second.set()
        await asyncio.sleep(0.05)
        assert events[2:] == ["t2 done", "t3 admitted"]
        first.set()
        third.set()
        await asyncio.gather(*tasks)
        return log

    assert asyncio.run(main()) == ["a", "b", "b"]  # t3 took t2's engine, the one with room


def test_kv_aware_prefers_the_emptiest_engine() -> None:
    async def main() -> list[str]:
        log: list[str] = []
        scheduler = Scheduler([Recorder("a", log), Recorder("b", log)], "kv_aware",
                              capacity_tokens=[100, 300])  # fmt: skip
        async with (
            scheduler.lease(25, 25) as one,
            scheduler.lease(25, 25) as two,
            scheduler.lease(25, 25) as three,
        ):
            for engine in (one, two, three):
                await engine.generate([1], PARAMS)
        return log

    assert asyncio.run(main()) == ["b", "b", "b"]  # 250 free on b after two leases > 100 on a


def test_an_oversized_trajectory_runs_on_an_idle_engine() -> None:
    async def main() -> str:
        log: list[str] = []
        scheduler = Scheduler([Recorder("a", log)], "kv_aware", capacity_tokens=100)
        async with scheduler.lease(500, 500) as engine:
            await asyncio.wait_for(engine.generate([1], PARAMS), 1)
        return log[0]

    assert asyncio.run(main()) == "a"


def test_least_outstanding_routes_each_call_to_the_least_busy_engine() -> None:
    async def main() -> list[str]:
        log: list[str] = []
        gate = asyncio.Event()
        scheduler = Scheduler(
            [Recorder("a", log, gate), Recorder("b", log, gate)], "least_outstanding"
        )
        async with scheduler.lease(5, 5) as engine:
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


def test_bench_scheduler_runs_every_policy(tmp_path: object) -> None:
    import json
    from pathlib import Path

    from codeloop.rollout import bench_scheduler

    out = Path(str(tmp_path)) / "s.json"
    args = ["--trajectories", "24", "--engines", "2", "--seeds", "1", "--step-ms", "0.2",
            "--out", str(out)]  # fmt: skip
    assert bench_scheduler.main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["static", "least_outstanding", "kv_aware"]
    assert all(r["makespan_s"] > 0 and r["prefill_tokens"] >= 24 * 300 for r in rows)
