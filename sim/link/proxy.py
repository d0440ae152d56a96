"""A network link emulator: an asyncio TCP proxy that adds delay, jitter, a bandwidth cap,
retransmission stalls and scheduled disconnects between an edge and the cloud.

    async with LinkProxy(LinkSettings(delay_ms=25), upstream=("127.0.0.1", 50051)) as link:
        channel = grpc.aio.insecure_channel(link.address)

What each chunk goes through is in sim.link.shaping. Run it standalone:
`sprinter link --upstream 127.0.0.1:50051 --delay-ms 25 ...` (sim.link.command).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sim.link.shaping import ChunkDelay, DelaySampler, Direction, LinkSettings, TokenBucket

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
# Per direction: beyond this the proxy stops reading, so a fast sender feels the slow link through
# TCP flow control instead of the proxy buffering without bound.
MAX_BUFFERED_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class ChunkEvent:
    """What the proxy scheduled for one chunk (times on the event loop's clock)."""

    connection: int
    direction: Direction
    size: int
    arrival_s: float
    delay: ChunkDelay
    serialisation_s: float
    deliver_at_s: float


@dataclass
class LinkStats:
    bytes_up: int = 0
    bytes_down: int = 0
    connections: int = 0  # accepted and forwarded
    refused: int = 0  # arrived during a disconnect window
    stalls: int = 0
    disconnects: int = 0  # disconnect windows that began
    resets: int = 0  # open connections reset by them


def _drop(writer: asyncio.StreamWriter | None, reset: bool) -> None:
    """Close at once, dropping unsent data; with `reset`, by an RST as a middlebox does (SO_LINGER 0
    turns close into a reset), else by the kernel's usual FIN."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if reset and sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Connection:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    task: asyncio.Task | None = None

    def drop(self, reset: bool) -> None:
        _drop(self.client, reset)
        _drop(self.upstream, reset)
        if self.task is not None:
            self.task.cancel()


@dataclass(eq=False)
class _Pipe:
    """Chunks of one direction waiting for their delivery time, bounded in bytes."""

    chunks: deque[tuple[float, bytes | None]] = field(default_factory=deque)  # None: EOF
    buffered: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    room: asyncio.Event = field(default_factory=asyncio.Event)

    async def put(self, deliver_at: float, chunk: bytes | None) -> None:
        while self.buffered >= MAX_BUFFERED_BYTES:
            self.room.clear()
            await self.room.wait()
        self.chunks.append((deliver_at, chunk))
        self.buffered += len(chunk or b"")
        self.ready.set()

    async def get(self) -> tuple[float, bytes | None]:
        while not self.chunks:
            self.ready.clear()
            await self.ready.wait()
        deliver_at, chunk = self.chunks.popleft()
        self.buffered -= len(chunk or b"")
        self.room.set()
        return deliver_at, chunk


class LinkProxy:
    """A TCP proxy on `listen` that forwards to `upstream` through an emulated link.

    `on_chunk`, if given, sees every scheduled chunk (for tests and traces).
    """

    def __init__(self, settings: LinkSettings, upstream: tuple[str, int],
                 listen: tuple[str, int] = ("127.0.0.1", 0),
                 on_chunk: Callable[[ChunkEvent], None] | None = None) -> None:
        self.settings = settings
        self._delay_override: float | None = None  # change_delay's
        self.upstream = upstream
        self.listen = listen
        self.on_chunk = on_chunk
        self.stats = LinkStats()
        self._connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._scheduler: asyncio.Task | None = None
        self._started = 0.0

    @property
    def address(self) -> str:
        """Where to connect, "host:port"."""
        if self._server is None:
            raise RuntimeError("the link is not running: use `async with LinkProxy(...) as link`")
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def __aenter__(self) -> LinkProxy:
        loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._accept, *self.listen)
        self._started = loop.time()
        if self.settings.disconnects:
            self._scheduler = asyncio.create_task(self._run_disconnects(), name="link-disconnects")
        log.info("link %s -> %s:%d: %s", self.address, *self.upstream, self.settings)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        if self._scheduler is not None:
            self._scheduler.cancel()
        tasks = [t for t in [self._scheduler, *(c.task for c in self._connections)] if t is not None]
        for connection in list(self._connections):
            connection.drop(reset=False)
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None
        log.info("link closed: %s", self.stats)

    def _elapsed(self) -> float:
        return asyncio.get_running_loop().time() - self._started

    def change_delay(self, delay_ms: float) -> None:
        """From now on the one-way delay is `delay_ms` (over any scheduled change): a test's or a bench's hand."""
        if not delay_ms >= 0:
            raise ValueError(f"a delay is >= 0 ms, got {delay_ms!r}")
        self._delay_override = delay_ms

    def delay_ms_now(self) -> float:
        """The one-way delay a chunk arriving now gets: a change made by hand, else the schedule's."""
        if self._delay_override is not None:
            return self._delay_override
        return self.settings.delay_at(self._elapsed())

    async def _run_disconnects(self) -> None:
        for at, duration in sorted(self.settings.disconnects):
            await asyncio.sleep(at - self._elapsed())
            self.stats.disconnects += 1
            log.info("disconnect for %.2f s: resetting %d open connections", duration, len(self._connections))
            for connection in list(self._connections):
                self.stats.resets += 1
                connection.drop(reset=True)

    def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if self.settings.disconnected(self._elapsed()):
            # Accept-then-reset rather than closing the listener: the port stays ours, and a client
            # sees the same connection failure as a refused SYN.
            self.stats.refused += 1
            _drop(client_writer, reset=True)
            return
        # The proxy owns the forwarding task (not asyncio's callback wrapper), so it can cancel it on
        # a disconnect without asyncio reporting the cancellation as an error.
        connection = _Connection(client_writer)
        connection.task = asyncio.create_task(self._forward(self.stats.connections, client_reader, connection))
        self.stats.connections += 1
        self._connections.add(connection)
        connection.task.add_done_callback(lambda task: self._forwarded(connection, task))

    def _forwarded(self, connection: _Connection, task: asyncio.Task) -> None:
        self._connections.discard(connection)
        if not task.cancelled() and task.exception() is not None:  # a bug, not the network: say so now
            log.error("connection forwarding failed", exc_info=task.exception())

    async def _forward(self, number: int, client_reader: asyncio.StreamReader, connection: _Connection) -> None:
        try:
            upstream_reader, connection.upstream = await asyncio.open_connection(*self.upstream)
            async with asyncio.TaskGroup() as group:
                group.create_task(self._pump(number, "up", client_reader, connection.upstream))
                group.create_task(self._pump(number, "down", upstream_reader, connection.client))
            connection.client.close()
            connection.upstream.close()
        except* OSError as errors:  # a reset on one side is passed on to the other as a reset
            log.debug("connection %d: %s", number, errors.exceptions[0])
            connection.drop(reset=True)

    async def _pump(self, number: int, direction: Direction, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        sampler = DelaySampler.for_direction(self.settings, number, direction)
        mbps = self.settings.bandwidth_mbps
        bucket = TokenBucket(mbps * 1e6 / 8) if mbps is not None else None
        pipe = _Pipe()
        async with asyncio.TaskGroup() as group:
            group.create_task(self._deliver(pipe, direction, writer))
            last = 0.0
            while chunk := await reader.read(CHUNK_BYTES):
                arrival = loop.time()
                delay = sampler.sample(self.delay_ms_now())
                if delay.stall_ms:
                    self.stats.stalls += 1
                start = max(last, arrival + delay.total_ms / 1000)
                serialisation = bucket.take(start, len(chunk)) if bucket else 0.0
                last = start + serialisation
                if self.on_chunk is not None:
                    self.on_chunk(ChunkEvent(number, direction, len(chunk), arrival, delay, serialisation, last))
                await pipe.put(last, chunk)
            # The FIN travels the link too: after the data, one delay later.
            await pipe.put(max(last, loop.time() + self.delay_ms_now() / 1000), None)

    async def _deliver(self, pipe: _Pipe, direction: Direction, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            deliver_at, chunk = await pipe.get()
            if (wait := deliver_at - loop.time()) > 0:
                await asyncio.sleep(wait)
            if chunk is None:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(chunk)
            if direction == "up":
                self.stats.bytes_up += len(chunk)
            else:
                self.stats.bytes_down += len(chunk)
            await writer.drain()
