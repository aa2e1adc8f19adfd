"""Spreading trajectories over N engines.

A trajectory takes a lease for its whole life (`async with scheduler.lease() as engine`) and
generates through the leased engine, which routes each call as the policy
(`rollout.scheduler`) says:
- `static`: trajectory k goes to one engine for its whole life, whatever the load: with
  `batch_size` the batch is cut into N contiguous chunks (as verl splits a batch over its
  rollout workers, so a prompt's samples share an engine), else round-robin. The report's
  starting point, where long trajectories pile up on some engines while others idle.
- `least_outstanding`: every call goes to the engine with the fewest calls in flight (verl's
  balancing); no stickiness, so no prefix-cache reuse across turns.
- `kv_aware` (the report's): a call is admitted only where its KV cache fits. It reserves its
  most, the context plus `max_tokens`, so an engine never holds more than its capacity and
  never preempts a running request; the reservation ends with the call, so a trajectory in its
  tool call holds nothing. A call stays on its trajectory's engine when that has room (its
  prefix is cached there); it moves only to an engine with room for it and `move_share` of
  its capacity besides (a move prefills the whole context again), else it waits for its own.
  A first call goes to the engine with the most room. Waiting calls are admitted longest
  context first (a trajectory that has run long is likely to run longer, and finishing it
  early shortens the tail), then in lease order, as running calls end. When an engine
  reports its live use (`kv_tokens_used`; `OpenAIEngine.refresh_kv` reads it from the
  server's /metrics, polled every `poll_s` while calls wait), its room is the smaller of what
  the reservations and the engine say. A call larger than every engine runs alone on an idle
  one rather than waiting forever.
Waiting on a tool call never blocks an engine: generation is async and the engine keeps
serving the other trajectories.

An engine that cannot serve (`EngineUnavailable`: a server down, cut off, restarting, or holding
other weights) is left out for `COOL_DOWN_S` and the call is sent again, to another engine when
one is up, else to the first to come back; a call keeps being retried for `retry_s`
(`rollout.server_retry_s`) before it fails. A retried call keeps its seed, so on the same
weights it samples what the first try would have.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from codeloop.config import RolloutConfig
from codeloop.engine.protocol import (
    Engine,
    EngineUnavailable,
    Generation,
    KVPolled,
    KVReporting,
    SamplingParams,
)

POLICIES = ("static", "least_outstanding", "kv_aware")
COOL_DOWN_S = 1.0  # an engine that could not serve is left out this long before a new try
log = logging.getLogger(__name__)


@dataclass
class EngineSlot:
    engine: Engine
    capacity_tokens: int
    reserved_tokens: int = 0  # kv_aware: context + max_tokens of the calls admitted
    outstanding: int = 0  # generate calls in flight
    down_until: float = 0.0  # loop time before which it is left out (it could not serve)
    failing_since: float | None = None  # loop time its calls began to fail (None: they do not)
    fault: str = ""  # why its last call could not be served


class _Leased:
    """The engine a trajectory sees: routes its calls as the policy says."""

    def __init__(self, scheduler: Scheduler, home: EngineSlot | None, order: int) -> None:
        self.scheduler, self.home, self.order = scheduler, home, order

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Generate on the engine the policy picks; again elsewhere or later while engines
        cannot serve (for `retry_s` at most)."""
        scheduler, give_up = self.scheduler, None
        while True:
            scheduler._check_any_hope()
            slot, reserve = await scheduler._take(self, prompt_ids, params.max_tokens)
            slot.outstanding += 1
            try:
                generation = await slot.engine.generate(prompt_ids, params)
                slot.failing_since = None
                return generation
            except EngineUnavailable as err:
                scheduler._leave_out(slot, err)
                assert slot.failing_since is not None
                give_up = give_up or slot.failing_since + scheduler.retry_s
                if scheduler._now() >= give_up:
                    raise
            finally:
                slot.outstanding -= 1
                if reserve:
                    slot.reserved_tokens -= reserve
                    scheduler._dispatch()


class Scheduler:
    def __init__(
        self,
        engines: Sequence[Engine],
        policy: str = "kv_aware",
        capacity_tokens: int | Sequence[int] = 1 << 20,
        batch_size: int = 0,
        *,
        move_share: float = 0.25,
        poll_s: float = 0.05,
        retry_s: float = 120.0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"rollout.scheduler: unknown policy {policy!r}; expected {POLICIES}")
        if not engines:
            raise ValueError("Scheduler needs at least one engine")
        capacities = (
            [capacity_tokens] * len(engines)
            if isinstance(capacity_tokens, int)
            else list(capacity_tokens)
        )
        self.slots = [EngineSlot(e, c) for e, c in zip(engines, capacities, strict=True)]
        self.policy, self.batch_size, self.poll_s = policy, batch_size, poll_s
        self.move_share, self.retry_s = move_share, retry_s
        self._order, self._arrivals = itertools.count(), itertools.count()
        self._waiting: list[tuple[int, int, int, int, _Leased, asyncio.Future[EngineSlot]]] = []
        self._poller: asyncio.Task[None] | None = None

    @classmethod
    def for_rollout(
        cls, engines: Sequence[Engine], cfg: RolloutConfig, batch_size: int = 0, sharing: int = 1
    ) -> Scheduler:
        """The scheduler `cfg` names (`rollout.scheduler`, `rollout.kv_capacity_tokens`; a
        capacity of 0 is each engine's own `kv_capacity_tokens`, no limit where it has none),
        with 1/`sharing` of each engine's capacity (schedulers that share engines)."""
        own = [e.kv_capacity_tokens if isinstance(e, KVReporting) else 0 for e in engines]
        capacities = [
            (cfg.kv_capacity_tokens or capacity) // sharing or 1 << 40 for capacity in own
        ]
        return cls(engines, cfg.scheduler, capacities, batch_size, retry_s=cfg.server_retry_s)

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[Engine]:
        """An engine for one trajectory, held until the block ends."""
        k = next(self._order)
        home = None
        if self.policy == "static":
            n = len(self.slots)
            index = (k % self.batch_size) * n // self.batch_size if self.batch_size else k % n
            home = self.slots[index]
        yield _Leased(self, home, k)

    async def _take(
        self, leased: _Leased, prompt_ids: list[int], max_tokens: int
    ) -> tuple[EngineSlot, int]:
        """The slot a call goes to, and the KV tokens it reserved there (kv_aware)."""
        if self.policy == "kv_aware":
            reserve = len(prompt_ids) + max_tokens
            return await self._acquire(leased, prompt_ids, reserve), reserve
        while not (up := [s for s in self.slots if self._up(s)]):
            await asyncio.sleep(min(s.down_until for s in self.slots) - self._now())
        if leased.home in up:
            return leased.home, 0
        return min(up, key=lambda s: s.outstanding), 0

    def _up(self, slot: EngineSlot) -> bool:
        return slot.down_until <= self._now()

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def _leave_out(self, slot: EngineSlot, err: Exception) -> None:
        """`slot` could not serve: leave it out for a cool-down, then let waiting calls try it."""
        if slot.failing_since is None:  # the first failure of an outage says so
            log.warning("%s; its calls go elsewhere or wait for it", err)
            slot.failing_since = self._now()
        slot.down_until, slot.fault = self._now() + COOL_DOWN_S, str(err)
        asyncio.get_running_loop().call_later(COOL_DOWN_S, self._dispatch)

    def _check_any_hope(self) -> None:
        """Fail a call at once while every engine cools down after failing for `retry_s`: a
        server gone for good costs each later call nothing (one try a cool-down still probes)."""
        now = self._now()
        if all(
            s.failing_since is not None
            and s.failing_since + self.retry_s <= now
            and not self._up(s)
            for s in self.slots
        ):
            faults = "; ".join(dict.fromkeys(s.fault for s in self.slots))
            raise EngineUnavailable(f"no engine could serve for {self.retry_s:.0f} s: {faults}")

    # -- kv_aware ----------------------------------------------------------------------------

    async def _acquire(self, leased: _Leased, prompt_ids: list[int], tokens: int) -> EngineSlot:
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(
            self._waiting,
            (-len(prompt_ids), leased.order, next(self._arrivals), tokens, leased, future),
        )
        self._dispatch()
        if not future.done() and self._poller is None and self._live_engines():
            self._poller = asyncio.create_task(self._poll())
        try:
            slot: EngineSlot = await future
            return slot
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # admitted as it was cancelled
                future.result().reserved_tokens -= tokens
                self._dispatch()
            raise

    def _dispatch(self) -> None:
        """Admit waiting calls in order (longest context first, then lease order) while the
        next one fits."""
        while self._waiting:
            *_, tokens, leased, future = self._waiting[0]
            if future.done():  # cancelled while waiting
                heapq.heappop(self._waiting)
                continue
            slot = self._place(leased.home, tokens)
            if slot is None:
                return
            heapq.heappop(self._waiting)
            slot.reserved_tokens += tokens
            leased.home = slot
            future.set_result(slot)

    def _place(self, home: EngineSlot | None, tokens: int) -> EngineSlot | None:
        up = [s for s in self.slots if self._up(s)]
        if home not in up:
            home = None  # its engine cannot serve: the call moves
        fits = [s for s in up if self._free(s) >= tokens]
        if home in fits:
            return home
        roomiest = max(fits, key=self._free, default=None)
        if roomiest is not None and (
            home is None
            or self._free(roomiest) >= tokens + self.move_share * roomiest.capacity_tokens
        ):
            return roomiest
        if tokens > max(s.capacity_tokens for s in self.slots):
            idle = [s for s in up if s.reserved_tokens == 0]
            return home if home in idle else (idle[0] if idle else None)
        return None

    def _free(self, slot: EngineSlot) -> int:
        free = slot.capacity_tokens - slot.reserved_tokens
        used = slot.engine.kv_tokens_used if isinstance(slot.engine, KVReporting) else None
        return free if used is None else min(free, slot.capacity_tokens - int(used))

    def _live_engines(self) -> list[KVPolled]:
        return [s.engine for s in self.slots if isinstance(s.engine, KVPolled)]

    async def _poll(self) -> None:
        """While calls wait, re-read the engines' live KV use: it changes on its own."""
        try:
            while self._waiting:
                await asyncio.sleep(self.poll_s)
                refreshes = [engine.refresh_kv() for engine in self._live_engines()]
                await asyncio.gather(*refreshes, return_exceptions=True)
                self._dispatch()
        finally:
            self._poller = None
