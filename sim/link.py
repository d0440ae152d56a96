"""A network link emulator: an asyncio TCP proxy that adds delay, jitter, a bandwidth cap,
retransmission stalls and scheduled disconnects between an edge and the cloud.

    async with LinkProxy(LinkSettings(delay_ms=25), upstream=("127.0.0.1", 50051)) as link:
        channel = grpc.aio.insecure_channel(link.address)

It works on the byte stream, not on packets, so it models what TCP shows an application: bytes are
late, slow or stalled, never lost or reordered. Each chunk the proxy reads in one direction is
delivered at

    max(previous chunk's delivery, arrival + delay + jitter + stall) + serialisation time

so jitter can bunch chunks up but never reorder them, and a stall holds back everything behind it
(head-of-line blocking). Random draws are seeded per connection and direction, so the same seed
gives the same per-chunk delay sequence (chunk boundaries follow TCP reads and may differ).

Run it standalone: `python -m sim.link --upstream 127.0.0.1:50051 --delay-ms 25 ...` (see `main`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import random
import re
import socket
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

log = logging.getLogger(__name__)

JitterDistribution = Literal["normal", "pareto"]
Direction = Literal["up", "down"]  # up: client -> upstream (edge -> cloud); down: the answers

# A fixed burst rather than one RTT's worth: it does not depend on the delay (one RTT is nothing at
# delay 0), it is about a TCP initial window (10 segments), and it keeps every transfer but the
# smallest messages paced by the rate, as netem's `rate` (no burst at all) paces kernel mode.
BURST_BYTES = 16 * 1024
CHUNK_BYTES = 64 * 1024
# Per direction: beyond this the proxy stops reading, so a fast sender feels the slow link through
# TCP flow control instead of the proxy buffering without bound.
MAX_BUFFERED_BYTES = 4 * 1024 * 1024
MIN_RTO_MS = 200.0  # Linux's TCP_RTO_MIN
# Shape 3: a heavy tail that still has a finite variance, so `jitter_ms` can be its standard deviation.
PARETO_SHAPE = 3.0


@dataclass(frozen=True)
class LinkSettings:
    """One link, the same in both directions.

    `jitter_ms` is extra queueing delay on top of `delay_ms` (never below it):
    - "normal": |N(0, jitter_ms)|, a normal truncated at 0 extra (mean 0.8 * jitter_ms);
    - "pareto": a Lomax (Pareto II) with shape 3 and standard deviation jitter_ms (mean 0.58 *
      jitter_ms): mostly small, now and then several times jitter_ms, like a congested path.
    `bandwidth_mbps` caps each direction with a token bucket (burst BURST_BYTES); None: unlimited.
    `loss` is the probability that a chunk suffers a retransmission stall of `rto_ms`: TCP does not
    lose bytes, it waits for the retransmission timeout.
    `disconnects`: (at_s, duration_s) pairs, seconds since the proxy started: at at_s every open
    connection is reset, and new ones are refused until at_s + duration_s.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    jitter_distribution: JitterDistribution = "normal"
    bandwidth_mbps: float | None = None
    loss: float = 0.0
    disconnects: tuple[tuple[float, float], ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.jitter_distribution not in ("normal", "pareto"):
            raise ValueError(f"jitter_distribution must be 'normal' or 'pareto', got {self.jitter_distribution!r}")
        if self.bandwidth_mbps is not None and not (math.isfinite(self.bandwidth_mbps) and self.bandwidth_mbps > 0):
            raise ValueError(f"bandwidth_mbps must be a finite number > 0 or None (unlimited), got {self.bandwidth_mbps!r}")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"loss is a probability per chunk, in [0, 1], got {self.loss!r}")
        windows = tuple((float(at), float(duration)) for at, duration in self.disconnects)
        for at, duration in windows:
            if not (math.isfinite(at) and at >= 0 and math.isfinite(duration) and duration > 0):
                raise ValueError(f"a disconnect is (at_s >= 0, duration_s > 0), got {(at, duration)!r}")
        object.__setattr__(self, "disconnects", windows)  # lists and ints in, one canonical form out
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @property
    def rto_ms(self) -> float:
        """The stall of one lost chunk: TCP's retransmission timeout, max(200 ms, 2 RTT)."""
        return max(MIN_RTO_MS, 2 * (2 * self.delay_ms))

    def disconnected(self, elapsed_s: float) -> bool:
        return any(at <= elapsed_s < at + duration for at, duration in self.disconnects)


@dataclass(frozen=True)
class ChunkDelay:
    """The one-way latency drawn for one chunk."""

    delay_ms: float
    jitter_ms: float
    stall_ms: float

    @property
    def total_ms(self) -> float:
        return self.delay_ms + self.jitter_ms + self.stall_ms


class DelaySampler:
    """Draws per-chunk latencies for one direction of one connection."""

    def __init__(self, settings: LinkSettings, rng: random.Random) -> None:
        self.settings = settings
        self.rng = rng

    @classmethod
    def for_direction(cls, settings: LinkSettings, connection: int, direction: Direction) -> DelaySampler:
        # A string seed is hashed with SHA-512: stable across runs and Python processes.
        return cls(settings, random.Random(f"{settings.seed}:{connection}:{direction}"))

    def sample(self) -> ChunkDelay:
        s = self.settings
        # Both draws happen whatever the settings, so changing `loss` does not shift the jitter sequence.
        if s.jitter_distribution == "normal":
            jitter = abs(self.rng.gauss(0.0, s.jitter_ms))
        else:
            lomax_std = math.sqrt(PARETO_SHAPE / ((PARETO_SHAPE - 1) ** 2 * (PARETO_SHAPE - 2)))
            jitter = s.jitter_ms / lomax_std * (self.rng.paretovariate(PARETO_SHAPE) - 1.0)
        stalled = self.rng.random() < s.loss
        return ChunkDelay(s.delay_ms, jitter, s.rto_ms if stalled else 0.0)


class TokenBucket:
    """Serialisation time of each chunk at `rate` bytes/s, after a burst that passes at once."""

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int = BURST_BYTES) -> None:
        self.rate = rate_bytes_per_s
        self.burst = burst_bytes
        self._tokens = float(burst_bytes)
        self._last = -math.inf

    def take(self, now: float, size: int) -> float:
        """Seconds the chunk of `size` bytes starting at `now` takes to get through."""
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate) - size
        self._last = now
        if self._tokens >= 0:
            return 0.0
        wait = -self._tokens / self.rate
        self._tokens, self._last = 0.0, now + wait
        return wait


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
                delay = sampler.sample()
                if delay.stall_ms:
                    self.stats.stalls += 1
                start = max(last, arrival + delay.total_ms / 1000)
                serialisation = bucket.take(start, len(chunk)) if bucket else 0.0
                last = start + serialisation
                if self.on_chunk is not None:
                    self.on_chunk(ChunkEvent(number, direction, len(chunk), arrival, delay, serialisation, last))
                await pipe.put(last, chunk)
            # The FIN travels the link too: after the data, one delay later.
            await pipe.put(max(last, loop.time() + self.settings.delay_ms / 1000), None)

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


# --- CLI-ish parsing -------------------------------------------------------------------------------

_TIME_MS = {"": 1.0, "ms": 1.0, "s": 1000.0, "us": 0.001}
_TIME_S = {"": 1.0, "s": 1.0, "ms": 0.001}
_RATE_MBPS = {"": 1.0, "mbit": 1.0, "mbps": 1.0, "kbit": 0.001, "kbps": 0.001, "gbit": 1000.0, "gbps": 1000.0}


def _quantity(text: str, units: dict[str, float], what: str) -> float:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in units:
        raise ValueError(f"cannot read {text!r} as {what} (e.g. {', '.join(repr('5' + u) for u in units if u)})")
    return float(match.group(1)) * units[match.group(2)]


def parse_ms(text: str) -> float:
    """"50ms", "0.05s" or a plain number of milliseconds."""
    return _quantity(text, _TIME_MS, "a duration")


def parse_mbps(text: str) -> float | None:
    """"20mbit", "500kbit", a plain number of Mbit/s, or "none" (unlimited)."""
    return None if text.strip().lower() in ("none", "unlimited", "inf") else _quantity(text, _RATE_MBPS, "a rate")


def parse_probability(text: str) -> float:
    """"1%" or "0.01"."""
    text = text.strip()
    return float(text[:-1]) / 100 if text.endswith("%") else float(text)


def parse_disconnect(text: str) -> tuple[float, float]:
    """"AT:DURATION" in seconds, units allowed: "30:5", "30s:500ms"."""
    at, sep, duration = text.partition(":")
    if not sep:
        raise ValueError(f"a disconnect is AT:DURATION (seconds), got {text!r}")
    return _quantity(at, _TIME_S, "a time"), _quantity(duration, _TIME_S, "a duration")


def parse_address(text: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port"."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"an address is HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _argument(parse: Callable[[str], object]) -> Callable[[str], object]:
    """argparse reports ArgumentTypeError messages verbatim (ValueError becomes 'invalid value')."""
    def wrapped(text: str) -> object:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    wrapped.__name__ = parse.__name__
    return wrapped


async def _run(settings: LinkSettings, upstream: tuple[str, int], listen: tuple[str, int]) -> None:
    async with LinkProxy(settings, upstream, listen) as link:
        log.info("listening on %s; Ctrl-C stops", link.address)
        try:
            await asyncio.Event().wait()
        finally:
            log.info("%s", link.stats)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sim.link", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_argument(parse_address), default=("127.0.0.1", 7000), help="HOST:PORT")
    parser.add_argument("--upstream", type=_argument(parse_address), required=True, help="HOST:PORT")
    parser.add_argument("--delay-ms", type=_argument(parse_ms), default=0.0, help="one way, e.g. 25 or 25ms")
    parser.add_argument("--jitter-ms", type=_argument(parse_ms), default=0.0)
    parser.add_argument("--jitter-distribution", choices=("normal", "pareto"), default="normal")
    parser.add_argument("--bandwidth-mbps", type=_argument(parse_mbps), default=None, help="per direction")
    parser.add_argument("--loss", type=_argument(parse_probability), default=0.0, help="e.g. 0.01 or 1%%")
    parser.add_argument("--disconnect", type=_argument(parse_disconnect), action="append", default=[],
                        metavar="AT:DURATION", help="seconds after start; repeatable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = LinkSettings(delay_ms=args.delay_ms, jitter_ms=args.jitter_ms,
                                jitter_distribution=args.jitter_distribution, bandwidth_mbps=args.bandwidth_mbps,
                                loss=args.loss, disconnects=tuple(args.disconnect), seed=args.seed)
    except ValueError as err:
        parser.error(str(err))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_run(settings, args.upstream, args.listen))


if __name__ == "__main__":
    main()
