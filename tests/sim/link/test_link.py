"""The link emulator: delay, bandwidth, ordering under jitter, determinism, stalls, disconnects, kernel mode."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import statistics
import subprocess
import sys
import time
from typing import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sim.link.netns import netem_available, netem_link
from sim.link.proxy import ChunkEvent, LinkProxy
from sim.link.shaping import DelaySampler, LinkSettings, TokenBucket
from sim.link.units import parse_delay_change, parse_disconnect, parse_mbps, parse_ms, parse_probability

SERVING = health_pb2.HealthCheckResponse.SERVING
# Reconnect at once after the emulated disconnect instead of gRPC's default 1 s backoff.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                  ("grpc.max_reconnect_backoff_ms", 100)]


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())


@contextlib.asynccontextmanager
async def health_server() -> AsyncIterator[tuple[str, int]]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", SERVING)
    try:
        yield "127.0.0.1", port
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def tcp_server(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
                     ) -> AsyncIterator[tuple[str, int]]:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield "127.0.0.1", server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):  # the proxy going away mid-echo is not this test's business
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


async def check(stub: health_pb2_grpc.HealthStub, **kwargs: object) -> float:
    start = time.perf_counter()
    assert (await stub.Check(health_pb2.HealthCheckRequest(), **kwargs)).status == SERVING
    return time.perf_counter() - start


async def echo_round_trip(link: LinkProxy, payload: bytes) -> float:
    host, port = link.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    start = time.perf_counter()
    writer.write(payload)
    assert await reader.readexactly(len(payload)) == payload
    elapsed = time.perf_counter() - start
    writer.close()
    return elapsed


def test_settings_are_validated_and_parsed() -> None:
    for bad in ({"delay_ms": -1}, {"jitter_ms": float("nan")}, {"jitter_distribution": "uniform"},
                {"bandwidth_mbps": 0}, {"loss": 1.5}, {"disconnects": ((1, 0),)}, {"disconnects": ((-1, 2),)}):
        with pytest.raises(ValueError):
            LinkSettings(**bad)
    settings = LinkSettings(delay_ms=parse_ms("0.05s"), bandwidth_mbps=parse_mbps("500kbit"),
                            loss=parse_probability("1%"), disconnects=[parse_disconnect("30:500ms")])
    assert (settings.delay_ms, settings.bandwidth_mbps, settings.loss) == (50.0, 0.5, 0.01)
    assert settings.disconnects == ((30.0, 0.5),) and settings.disconnected(30.2) and not settings.disconnected(30.5)
    assert settings.rto_ms == 200.0 and LinkSettings(delay_ms=80).rto_ms == 320.0
    assert parse_ms("25") == 25.0 and parse_mbps("none") is None
    with pytest.raises(ValueError, match="duration"):
        parse_ms("25 parsecs")


def test_delay_adds_two_one_way_delays_to_a_grpc_round_trip() -> None:
    async def main() -> None:
        async with health_server() as upstream, LinkProxy(LinkSettings(delay_ms=40), upstream) as link:
            async with grpc.aio.insecure_channel("%s:%d" % upstream) as direct, \
                    grpc.aio.insecure_channel(link.address) as proxied:
                times = {}
                for name, channel in (("direct", direct), ("proxied", proxied)):
                    stub = health_pb2_grpc.HealthStub(channel)
                    await check(stub)  # connection set-up: TCP and HTTP/2 handshakes
                    times[name] = statistics.median([await check(stub) for _ in range(10)])
            added_ms = (times["proxied"] - times["direct"]) * 1000
            assert 60 <= added_ms <= 100, times
            assert link.stats.connections == 1 and link.stats.bytes_up > 0 and link.stats.bytes_down > 0
    run(main)


def test_bandwidth_paces_a_bulk_transfer() -> None:
    size, mbps = 1 << 20, 40.0

    async def main() -> None:
        done = asyncio.Event()
        total = 0

        async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal total
            while data := await reader.read(65536):
                total += len(data)
                if total >= size:
                    done.set()
            writer.close()

        async with tcp_server(sink) as upstream, LinkProxy(LinkSettings(bandwidth_mbps=mbps), upstream) as link:
            host, port = link.address.rsplit(":", 1)
            _, writer = await asyncio.open_connection(host, int(port))
            start = time.perf_counter()
            writer.write(bytes(size))
            await asyncio.wait_for(done.wait(), 5)
            elapsed = time.perf_counter() - start
            writer.close()
        expected = size * 8 / (mbps * 1e6)
        assert 0.75 * expected <= elapsed <= 1.25 * expected, (elapsed, expected)
        assert link.stats.bytes_up == size
    run(main)


def test_token_bucket_lets_a_burst_through_then_paces() -> None:
    bucket = TokenBucket(rate_bytes_per_s=1000, burst_bytes=100)
    assert bucket.take(0.0, 100) == 0.0  # the burst
    assert bucket.take(0.0, 50) == pytest.approx(0.05)
    assert bucket.take(0.05, 50) == pytest.approx(0.05)  # bucket empty at 0.05: 50 bytes take 50 ms
    assert bucket.take(10.0, 100) == 0.0  # refilled, but never beyond the burst
    assert bucket.take(10.0, 1) == pytest.approx(0.001)


def test_jitter_never_reorders_bytes() -> None:
    events: list[ChunkEvent] = []

    async def main() -> None:
        settings = LinkSettings(delay_ms=2, jitter_ms=10, seed=3)
        async with tcp_server(echo) as upstream, LinkProxy(settings, upstream, on_chunk=events.append) as link:
            host, port = link.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            sent = b"".join(i.to_bytes(4, "big") for i in range(20000))
            for offset in range(0, len(sent), 800):  # many spaced writes: many chunks, each with its own jitter
                writer.write(sent[offset:offset + 800])
                await asyncio.sleep(0.001)
            assert await asyncio.wait_for(reader.readexactly(len(sent)), 10) == sent
            writer.close()

    run(main)
    for direction in ("up", "down"):
        chunks = [e for e in events if e.direction == direction]
        assert all(a.deliver_at_s <= b.deliver_at_s for a, b in zip(chunks, chunks[1:]))
    # The spaced writes arrive as separate chunks, and jitter alone would have let many overtake:
    # their own due time is before their predecessor's delivery.
    up = [e for e in events if e.direction == "up"]
    overtaking = sum(b.arrival_s + b.delay.total_ms / 1000 < a.deliver_at_s for a, b in zip(up, up[1:]))
    assert len(up) >= 50 and overtaking >= 10, (len(up), overtaking)


def test_the_same_seed_gives_the_same_delays() -> None:
    def draws(settings: LinkSettings, connection: int = 0, direction: str = "up") -> list[float]:
        sampler = DelaySampler.for_direction(settings, connection, direction)
        return [sampler.sample().total_ms for _ in range(200)]

    settings = LinkSettings(delay_ms=10, jitter_ms=5, loss=0.1, seed=7)
    assert draws(settings) == draws(LinkSettings(delay_ms=10, jitter_ms=5, loss=0.1, seed=7))
    assert draws(settings) != draws(LinkSettings(delay_ms=10, jitter_ms=5, loss=0.1, seed=8))
    assert draws(settings) != draws(settings, direction="down") != draws(settings, connection=1)
    assert min(draws(settings)) >= 10 and any(d >= 10 + settings.rto_ms for d in draws(settings))
    # Changing the loss does not shift the jitter sequence.
    jitter = [d for d in draws(LinkSettings(delay_ms=10, jitter_ms=5, seed=7))]
    assert all(d == pytest.approx(j) or d == pytest.approx(j + settings.rto_ms) for d, j in zip(draws(settings), jitter))
    # The spreads: a half-normal with mean 0.8 sigma, a Lomax with standard deviation jitter_ms.
    for distribution, mean in (("normal", 0.798), ("pareto", 0.577)):
        sampler = DelaySampler.for_direction(LinkSettings(jitter_ms=10, jitter_distribution=distribution), 0, "up")
        values = [sampler.sample().jitter_ms for _ in range(20000)]
        assert min(values) >= 0 and statistics.fmean(values) == pytest.approx(10 * mean, rel=0.08)

    # Two proxies with one seed: the same per-chunk delays (one message per chunk: each waits for its echo).
    async def delays(seed: int) -> list[tuple[str, float]]:
        events: list[ChunkEvent] = []
        settings = LinkSettings(delay_ms=1, jitter_ms=3, seed=seed)
        async with tcp_server(echo) as upstream, LinkProxy(settings, upstream, on_chunk=events.append) as link:
            host, port = link.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            for i in range(8):
                writer.write(b"message %d" % i)
                await reader.readexactly(len(b"message %d" % i))
            writer.close()
        return [(e.direction, e.delay.total_ms) for e in events]

    first, second, other = (asyncio.run(delays(seed)) for seed in (5, 5, 6))
    assert first == second and first != other and len(first) == 16


def test_loss_stalls_show_in_stats_and_timing() -> None:
    async def main() -> None:
        settings = LinkSettings(delay_ms=5, loss=1.0)
        async with tcp_server(echo) as upstream, LinkProxy(settings, upstream) as link:
            elapsed = await echo_round_trip(link, b"ping")
        # Each way: 5 ms delay plus a 200 ms retransmission timeout.
        assert 0.40 <= elapsed <= 0.50, elapsed
        assert link.stats.stalls == 2
    run(main)


def test_a_disconnect_resets_open_streams_then_calls_succeed_again() -> None:
    async def main() -> None:
        settings = LinkSettings(delay_ms=1, disconnects=((0.5, 0.4),))
        async with health_server() as upstream, LinkProxy(settings, upstream) as link, \
                grpc.aio.insecure_channel(link.address, options=FAST_RECONNECT) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await check(stub)
            watch = stub.Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as reset:
                await asyncio.wait_for(watch.read(), 2)  # the stream stays open until the reset
            assert reset.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # inside the window
                await check(stub, timeout=0.2)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            await asyncio.sleep(0.5)  # past the window
            await check(stub, timeout=2, wait_for_ready=True)
            assert (link.stats.disconnects, link.stats.resets) == (1, 1) and link.stats.refused >= 1
            assert link.stats.connections == 2
    run(main)


def test_the_cli_starts_and_stops_on_ctrl_c() -> None:
    # A child inherits an ignored SIGINT, and then Python installs no KeyboardInterrupt handler: start it as a
    # shell would, with SIGINT at its default, whatever an earlier test left in this process.
    process = subprocess.Popen([sys.executable, "-m", "common.cli", "link", "--listen", "127.0.0.1:0", "--upstream",
                                "127.0.0.1:9", "--delay-ms", "25ms", "--loss", "1%", "--disconnect", "5:1"],
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    line = process.stderr.readline()
    assert "listening on 127.0.0.1:" in line or "link 127.0.0.1:" in line, line
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    bad = subprocess.run([sys.executable, "-m", "common.cli", "link", "--upstream", "x:1", "--loss", "2"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "loss" in bad.stderr


def test_kernel_mode_with_netem() -> None:
    ok, reason = netem_available()
    if not ok:
        pytest.skip(f"netem kernel mode: {reason}")
    listen = "import socket; s = socket.create_server(('0.0.0.0', 7001)); s.accept()[0].recv(1)"
    with netem_link(LinkSettings(delay_ms=20)) as link:
        connect = ("import socket, time; t = time.perf_counter(); "
                   f"socket.create_connection(('{link.addresses[1]}', 7001), timeout=5).close(); "
                   "print(time.perf_counter() - t)")
        server = link.popen("b", sys.executable, "-c", listen)
        try:
            time.sleep(0.5)
            result = link.run("a", sys.executable, "-c", connect, capture_output=True, text=True, check=True)
        finally:
            server.kill()
            server.wait()
    assert 0.035 <= float(result.stdout) <= 0.1  # a TCP handshake is one round trip: 2 * 20 ms


def test_the_delay_changes_mid_run_on_schedule_and_by_hand() -> None:
    """Placement must follow a changing RTT: the link's delay changes at a scheduled time, or when a test says."""
    assert parse_delay_change("0.3:60ms") == (0.3, 60.0)
    settings = LinkSettings(delay_ms=5, delay_changes=[parse_delay_change("0.4:60")])
    assert settings.delay_at(0.39) == 5 and settings.delay_at(0.4) == 60
    with pytest.raises(ValueError):
        LinkSettings(delay_changes=((1, -5),))

    async def main() -> None:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        upstream = server.sockets[0].getsockname()[:2]
        async with server, LinkProxy(settings, upstream) as link:
            before = await echo_round_trip(link, b"x")
            await asyncio.sleep(max(0.0, 0.45 - link._elapsed()))
            after = await echo_round_trip(link, b"x")
            link.change_delay(20)
            by_hand = await echo_round_trip(link, b"x")
        assert before < 0.05 and 0.11 <= after < 0.3 and 0.035 <= by_hand < 0.1, (before, after, by_hand)
    run(main)
