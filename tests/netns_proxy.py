"""A link with faults, in user space: an asyncio TCP proxy on one node's path to the server (no netem needed).

``Link(listen, upstream)`` accepts on ``listen`` and forwards each connection to ``upstream`` byte for byte
(TLS passes through untouched), each direction delayed by half the round-trip time plus jitter (order kept, as
TCP keeps it), throttled to ``rate`` bytes per second, held while the link is stalled, and, while it is cut,
every connection is dropped and new ones are refused (the listening socket is closed). The proxy runs in a
thread of its own with its own event loop, born in the network namespace of the thread that calls
``start``: its sockets live there. ``seen`` counts the bytes forwarded each way (``up``: node to server).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from dataclasses import dataclass


@dataclass
class Faults:
    """What the link does to traffic: ``rtt`` and ``jitter`` in seconds, ``rate`` in bytes/s (0: no cap)."""

    rtt: float = 0.0
    jitter: float = 0.0
    rate: float = 0.0
    seed: int = 0


class Link:
    """One node's path to the server (see the module's docstring)."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], faults: Faults | None = None):
        self.listen, self.upstream = listen, upstream
        self.faults = faults or Faults()
        self.rng = random.Random(self.faults.seed)
        self.seen = {"up": 0, "down": 0}
        self.connections = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: asyncio.base_events.Server | None = None
        self.open: set[asyncio.StreamWriter] = set()
        self.flowing = asyncio.Event()  # cleared while the link is stalled

    def _call(self, coro, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> Link:
        self.thread.start()
        self.loop.call_soon_threadsafe(self.flowing.set)
        self._call(self._listen())
        return self

    async def _listen(self) -> None:
        self.server = await asyncio.start_server(self._serve, *self.listen, reuse_address=True)

    async def _serve(self, reader, writer) -> None:
        self.connections += 1
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(*self.upstream), 10)
        except (OSError, asyncio.TimeoutError):
            writer.close()
            return
        self.open.update((writer, up_w))
        await asyncio.gather(self._pump(reader, up_w, "up"), self._pump(up_r, writer, "down"))
        self.open.difference_update((writer, up_w))

    def _delay(self) -> float:
        f = self.faults
        return max(0.0, f.rtt / 2 + self.rng.uniform(-f.jitter, f.jitter) / 2)

    async def _pump(self, reader, writer, way: str) -> None:
        """Forward one direction: each chunk released at arrival + delay (never before the one ahead of it)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            last = 0.0
            try:
                while data := await reader.read(65536):
                    last = max(last, time.monotonic() + self._delay())
                    queue.put_nowait((last, data))
            except (OSError, asyncio.IncompleteReadError):
                pass
            queue.put_nowait((0.0, b""))

        reading = asyncio.ensure_future(read())
        try:
            while True:
                when, data = await queue.get()
                if not data:
                    break
                await asyncio.sleep(max(0.0, when - time.monotonic()))
                await self.flowing.wait()
                if self.faults.rate:
                    await asyncio.sleep(len(data) / self.faults.rate)
                self.seen[way] += len(data)  # counted before it is sent: a reader never sees it uncounted
                writer.write(data)
                await writer.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            reading.cancel()
            with contextlib.suppress(OSError, RuntimeError):
                writer.close()

    # -- faults, called from any thread -----------------------------------------------------------------
    def stall(self, seconds: float) -> None:
        """Hold every byte on the link for ``seconds`` (connections stay open), then let it all through."""

        def go() -> None:
            self.flowing.clear()
            self.loop.call_later(seconds, self.flowing.set)

        self.loop.call_soon_threadsafe(go)

    async def _cut(self) -> None:
        self.server.close()
        for w in list(self.open):
            w.transport.abort()
        self.open.clear()
        await self.server.wait_closed()

    def cut(self) -> None:
        """Drop every connection and refuse new ones until ``restore``."""
        self._call(self._cut())

    def restore(self) -> None:
        """Accept connections again (on the same address)."""
        self._call(self._listen())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call(self._cut())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
