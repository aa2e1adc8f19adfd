"""Spreading trajectories over N engines.

A trajectory takes a lease for its whole life (`async with scheduler.lease(prompt, budget)`)
and generates through the leased engine. Policies (`rollout.scheduler`):
- `static`: trajectory k goes to engine k mod N, whatever the load (the report's starting
  point, where long trajectories pile up on some engines while others idle);
- `least_outstanding`: every generate call goes to the engine with the fewest calls in flight
  (verl's balancing); no stickiness, so no prefix-cache reuse across turns;
- `kv_aware` (the report's): a trajectory is admitted to the engine with the most free KV
  capacity and stays there across turns for the prefix cache; when no engine has room it
  waits. Free capacity is read live from the engine when it reports `kv_tokens_used`
  (`OpenAIEngine` reads it from the server's /metrics, `refresh_kv`; then a
  trajectory needs room for its prompt plus `headroom_tokens`), else it is the capacity minus
  the reservations (prompt plus response budget) of the trajectories already admitted. A
  trajectory larger than any engine is admitted to an idle engine rather than waiting forever.
Waiting on a tool call never blocks an engine: generation is async and the engine keeps
serving the other trajectories.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from codeloop.rollout.engine import Engine, Generation, SamplingParams

POLICIES = ("static", "least_outstanding", "kv_aware")


@dataclass
class EngineSlot:
    engine: Engine
    capacity_tokens: int
    reserved_tokens: int = 0
    outstanding: int = 0  # generate calls in flight
    leases: int = 0  # live trajectories
    calls: int = 0  # generate calls served in all

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.reserved_tokens


class _Leased:
    """The engine a trajectory sees: routes its calls as the policy says, counts them."""

    def __init__(self, scheduler: Scheduler, slot: EngineSlot | None) -> None:
        self.scheduler, self.slot = scheduler, slot

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        slot = self.slot or min(self.scheduler.slots, key=lambda s: s.outstanding)
        slot.outstanding += 1
        slot.calls += 1
        try:
            return await slot.engine.generate(prompt_ids, params)
        finally:
            slot.outstanding -= 1


class Scheduler:
    def __init__(self, engines: Sequence[Engine], policy: str = "kv_aware",
                 capacity_tokens: int | Sequence[int] = 1 << 20, headroom_tokens: int = 1024,
                 poll_s: float = 0.005) -> None:  # fmt: skip
        if policy not in POLICIES:
            raise ValueError(f"rollout.scheduler: unknown policy {policy!r}; expected {POLICIES}")
        if not engines:
            raise ValueError("Scheduler needs at least one engine")
        capacities = ([capacity_tokens] * len(engines) if isinstance(capacity_tokens, int)
                      else list(capacity_tokens))  # fmt: skip
        self.slots = [EngineSlot(e, c) for e, c in zip(engines, capacities, strict=True)]
        self.policy = policy
        self.headroom_tokens, self.poll_s = headroom_tokens, poll_s
        self._next = 0
        self._freed = asyncio.Condition()

    @asynccontextmanager
    async def lease(self, prompt_tokens: int, budget_tokens: int) -> AsyncIterator[Engine]:
        """An engine for one trajectory, held until the block ends."""
        reserve_tokens = prompt_tokens + budget_tokens
        slot = await self._admit(prompt_tokens, reserve_tokens)
        try:
            yield _Leased(self, None if self.policy == "least_outstanding" else slot)
        finally:
            async with self._freed:
                slot.leases -= 1
                slot.reserved_tokens -= reserve_tokens
                self._freed.notify_all()

    async def _admit(self, prompt_tokens: int, reserve_tokens: int) -> EngineSlot:
        async with self._freed:
            slot: EngineSlot | None
            if self.policy == "kv_aware":
                await self._refresh_kv()
                while (slot := self._roomiest(prompt_tokens, reserve_tokens)) is None:
                    try:  # woken by a lease ending, or polled: live usage changes on its own
                        await asyncio.wait_for(self._freed.wait(), self.poll_s)
                    except asyncio.TimeoutError:
                        pass
                    await self._refresh_kv()
            elif self.policy == "static":
                slot, self._next = self.slots[self._next % len(self.slots)], self._next + 1
            else:
                slot = min(self.slots, key=lambda s: s.leases)
            slot.leases += 1
            slot.reserved_tokens += reserve_tokens
            return slot

    async def _refresh_kv(self) -> None:
        """Ask engines that read their KV use from a server to do so (`OpenAIEngine`)."""
        refreshes = [s.engine.refresh_kv() for s in self.slots if hasattr(s.engine, "refresh_kv")]
        if refreshes:
            await asyncio.gather(*refreshes, return_exceptions=True)

    def _free(self, slot: EngineSlot) -> int:
        used = getattr(slot.engine, "kv_tokens_used", None)
        return slot.free_tokens if used is None else slot.capacity_tokens - int(used)

    def _roomiest(self, prompt_tokens: int, reserve_tokens: int) -> EngineSlot | None:
        best = max(self.slots, key=self._free)
        live = getattr(best.engine, "kv_tokens_used", None) is not None
        if self._free(best) >= (prompt_tokens + self.headroom_tokens if live else reserve_tokens):
            return best
        idle = [s for s in self.slots if s.leases == 0]
        return (
            idle[0]
            if idle and reserve_tokens > max(s.capacity_tokens for s in self.slots)
            else None
        )
