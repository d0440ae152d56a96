"""Prometheus metrics of the cloud service, on their own registry, served by a tiny asyncio endpoint."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from cloud.engine import ForwardStats
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger(__name__)


@dataclass
class CloudMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.sessions_open = Gauge("sprinter_cloud_sessions_open", "Sessions holding a KV cache", registry=r)
        self.kv_cache_bytes = Gauge("sprinter_cloud_kv_cache_bytes", "KV cache held by all sessions", registry=r)
        self.sessions_evicted = Counter("sprinter_cloud_sessions_evicted", "Sessions evicted (KV budget or limit)", registry=r)
        self.verify_calls = Counter("sprinter_cloud_verify_calls", "Verify frames answered with a verdict", ["method"], registry=r)
        self.tokens_verified = Counter("sprinter_cloud_tokens_verified", "Draft tokens verified", registry=r)
        self.tokens_accepted = Counter("sprinter_cloud_tokens_accepted", "Draft tokens accepted", registry=r)
        self.tokens_generated = Counter("sprinter_cloud_tokens_generated", "Tokens generated in target mode", registry=r)
        self.cloud_batch_size = Histogram("sprinter_cloud_batch_size", "Requests per target forward", registry=r,
                                          buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32))
        self.forward_tokens = Histogram("sprinter_cloud_forward_tokens", "Tokens per packed target forward", registry=r,
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        # Resident KV (cloud/resident_kv.py): pages allocated to sessions, and past entries ever copied (growth only:
        # a forward reads and writes in place, so copied bytes per verify stay near 0).
        self.kv_pages_used = Gauge("sprinter_cloud_kv_pages_used", "KV pages allocated to sessions", registry=r)
        self.kv_pages_free = Gauge("sprinter_cloud_kv_pages_free", "KV pages left in the budget", registry=r)
        self.kv_over_budget = Counter("sprinter_cloud_kv_over_budget", "Checks that found the KV in use over the "
                                      "budget (a broken invariant: must stay 0)", registry=r)
        self.kv_copied_bytes = Counter("sprinter_cloud_kv_copied_bytes", "Past KV bytes copied (cache growth)",
                                       registry=r)
        self.target_forward_seconds = Histogram("sprinter_cloud_target_forward_seconds", "Target forward latency",
                                                registry=r, buckets=(.01, .025, .05, .1, .2, .4, .8, 1.6, 3.2, 6.4))
        # A candidate (VerifyBlock.after) is verified when it matches the verdict it was drafted for, else dropped
        # before any check or forward: dropped candidates cost uplink bytes, never compute.
        self.candidates = Counter("sprinter_cloud_candidates", "Candidate blocks by outcome (verified, dropped)",
                                  ["outcome"], registry=r)
        # An engine with its own prefix cache (vllm): context tokens it served from the cache, context tokens it had
        # seen but computed again (evicted, or a partial cache block), and verifies re-run with the cache skipped
        # because it covered a row the rule reads (cloud/vllm_engine.py).
        self.engine_cached_tokens = Counter("sprinter_cloud_engine_cached_tokens",
                                            "Context tokens served from the engine's prefix cache", registry=r)
        self.engine_recomputed_tokens = Counter("sprinter_cloud_engine_recomputed_tokens",
                                                "Context tokens the engine had cached before and computed again",
                                                registry=r)
        self.engine_cache_bypasses = Counter("sprinter_cloud_engine_cache_bypasses",
                                             "Verifies re-run with the prefix cache skipped", registry=r)
        self.residual_queries = Counter("sprinter_cloud_residual_queries", "Residual queries sent (candidates, full) "
                                        "and verifies abandoned while one was out (abandoned)", ["kind"], registry=r)
        self.errors = Counter("sprinter_cloud_errors", "Refused frames and calls", ["code"], registry=r)

    def observe_batch(self, forward: ForwardStats) -> None:
        self.cloud_batch_size.observe(forward.requests)
        self.forward_tokens.observe(forward.tokens)
        self.target_forward_seconds.observe(forward.seconds)
        self.kv_copied_bytes.inc(forward.copied_bytes)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


async def serve_metrics(metrics: CloudMetrics, host: str, port: int, read_timeout_s: float = 5.0) -> asyncio.Server:
    """GET /metrics (any path, in fact) answers the Prometheus text format.

    A client must send its request headers (at most 64 KiB) within `read_timeout_s`, or it is hung
    up on: a connection that never finishes its request would otherwise be held forever.
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), read_timeout_s)
            body = metrics.exposition()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + CONTENT_TYPE_LATEST.encode() +
                         b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port)
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server
