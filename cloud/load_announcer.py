"""A cloud replica on the fleet plane: its load, retained on `clouds/{replica_id}/load` (proto/mqtt.md).

Published every `interval_s` and on every (re)connect; the Last Will (status `offline`) tells edges
and operators when the process dies, and a clean stop publishes `offline` itself. Edges read the
announcements to seed their cost model (and, with several replicas, to choose one); the broker
being away never slows a verify: a publish without a connection is dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections import deque
from typing import Callable

import aiomqtt

from common.fleet_plane import topics
from common.fleet_plane.connection import BrokerSettings, FleetConnection
from common.fleet_plane.messages import CloudLoad, encode

log = logging.getLogger(__name__)

LoadReader = Callable[[str], CloudLoad]  # status ("online", "draining", "offline") -> this replica's load now


class LoadTracker:
    """Recent target forwards (batch size, milliseconds), for the announcement's means and median."""

    def __init__(self, window: int = 256) -> None:
        self.batch_sizes: deque[int] = deque(maxlen=window)
        self.forward_ms: deque[float] = deque(maxlen=window)

    def observe(self, batch_size: int, forward_s: float) -> None:
        self.batch_sizes.append(batch_size)
        self.forward_ms.append(forward_s * 1e3)

    def batch_size_mean(self) -> float:
        return statistics.fmean(self.batch_sizes) if self.batch_sizes else 0.0

    def verify_ms_p50(self) -> float | None:
        return statistics.median(self.forward_ms) if self.forward_ms else None


def load_reader(replica_id: str, model_id: str, vocab_fingerprint: str, endpoint: str, tracker: LoadTracker,
                open_sessions: Callable[[], int], queue_depth: Callable[[], int],
                kv_bytes: Callable[[], tuple[int, int]],
                prefixes: Callable[[], list[str]] = lambda: []) -> LoadReader:
    """A `LoadReader` over the live service: `kv_bytes()` gives (used, budget), `prefixes()` the digests of the
    prompt prefixes the prefix cache holds (cloud/prefix_cache.py `announced`)."""
    def read(status: str) -> CloudLoad:
        used, budget = kv_bytes()
        return CloudLoad(replica_id, status, model_id, vocab_fingerprint, endpoint, open_sessions(), queue_depth(),
                         tracker.batch_size_mean(), tracker.verify_ms_p50(), used, budget, time.time(),
                         prefixes() if status == "online" else [])

    return read


class LoadAnnouncer:
    def __init__(self, broker: BrokerSettings, replica_id: str, read_load: LoadReader, interval_s: float = 2.0) -> None:
        self.replica_id = replica_id
        self.read_load = read_load
        self.interval_s = interval_s
        self.status = "online"
        will = aiomqtt.Will(topics.cloud_load(replica_id), encode(read_load("offline")), qos=1, retain=True)
        self.connection = FleetConnection(broker, f"cloud-{replica_id}", will=will, on_connect=self.announce)
        self._task: asyncio.Task | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> LoadAnnouncer:
        await self._stack.enter_async_context(self.connection)
        self._stack.push_async_callback(self._go_offline)  # while the connection is still up
        self._task = asyncio.create_task(self._periodically(), name="cloud-load-announcer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _go_offline(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.status = "offline"
        await self.announce()

    async def announce(self) -> None:
        await self.connection.publish(topics.cloud_load(self.replica_id), encode(self.read_load(self.status)),
                                      qos=1, retain=True)

    async def draining(self) -> None:
        """Say at once that this replica takes no new sessions."""
        self.status = "draining"
        await self.announce()

    async def _periodically(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.announce()
