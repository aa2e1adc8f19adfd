"""A TCP proxy that puts a bad network between two hosts of a test (this kernel has no `netem`).

`FaultProxy(listen_host, target_host, target_port)` accepts connections and forwards each byte
stream both ways, each chunk after `delay_s` plus a uniform jitter of up to `jitter_s`; with
probability `loss` a chunk is held for a retransmission timeout more (`RETRANSMIT_S`, or twice
the delay if longer), which is what a lost TCP segment costs the two ends (the bytes still
arrive, in order). `stall()` / `resume()` stop and restart forwarding in both directions without
closing anything (a link that carries nothing for a while). Seeded, so a test's faults repeat.
"""

from __future__ import annotations

import asyncio
import random

RETRANSMIT_S = 0.2  # Linux's minimum retransmission timeout


class FaultProxy:
    def __init__(
        self,
        listen_host: str,
        target_host: str,
        target_port: int,
        delay_s: float = 0.0,
        jitter_s: float = 0.0,
        loss: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.listen_host, self.target = listen_host, (target_host, target_port)
        self.delay_s, self.jitter_s, self.loss = delay_s, jitter_s, loss
        self.rng = random.Random(seed)
        self.connections = 0
        self.lost_chunks = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> str:
        """Listen on a free port; returns `host:port`."""
        self._server = await asyncio.start_server(self._accept, self.listen_host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return f"{self.listen_host}:{self.port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def stall(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        both = (self._pipe(reader, upstream_writer), self._pipe(upstream_reader, writer))
        await asyncio.gather(*both, return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                await asyncio.sleep(self._wait_s())
                await self._flowing.wait()
                writer.write(chunk)
                await writer.drain()
        finally:
            writer.close()

    def _wait_s(self) -> float:
        wait = self.delay_s + self.rng.uniform(0.0, self.jitter_s)
        if self.rng.random() < self.loss:
            self.lost_chunks += 1
            wait += max(RETRANSMIT_S, 2 * self.delay_s)
        return wait
