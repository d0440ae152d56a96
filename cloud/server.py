"""Assemble and run the cloud service: TargetService, health checking, reflection, TLS, metrics.

Health reports NOT_SERVING while the model loads and SERVING after. On SIGTERM (or SIGINT) the
service stops taking new sessions, lets open streams finish for up to `drain_s`, then stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from cloud import cost_table
from cloud.admission_queue import AdmissionQueue, QueueObserver, QueueSettings
from cloud.auth import EdgeAuthenticator
from cloud.target_host import TargetHost
from cloud.llama_cpp_engine import LlamaCppEngine, default_threads
from cloud.llama_cpp_prefix import LlamaCppPrefixCache
from cloud.cuda_graphs import GraphForwards
from cloud.packed_forward import packed_forward_of
from cloud.batcher import Batcher
from cloud.engine import ForwardStats, TargetEngine
from cloud.frames import ServiceLimits
from cloud.load_announcer import LoadAnnouncer, LoadTracker, load_reader
from cloud.metrics import CloudMetrics, serve_metrics
from cloud.quotas import EdgeQuotas
from cloud.residual import ResidualSettings
from cloud.service import TargetServicer
from cloud.suffix_memories import SuffixMemories
from cloud.sessions import KVInvariant, SessionLimits, SessionStore
from cloud.resident_engine import ResidentEngine
from cloud.kv_pool import KVPool
from cloud.prefix_cache import PrefixCache
from cloud.paged_attention import PAGE_TOKENS_PAGED
from cloud.resident_kv import KVLayout
from cloud.cloud_sd import DraftEngine
from cloud.settings import CloudSettings
from common.fleet_plane.connection import BrokerSettings
from common.model.devices import resolve_device
from common.spec.round_cost import CloudCosts
from common.model.loading import DTYPES, LoadedModel, load_model, vocab_fingerprint
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

__all__ = ["CloudServer", "CloudSettings", "SERVICE_NAME", "run_until_signalled"]
log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TargetService"].full_name
# gRPC's name for the least time between two pings a server takes while it sends no data
# (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS). gRPC ignores a name it does not know, and its default
# is 5 minutes: edges pinging every 20 s would then be cut off (GOAWAY too_many_pings) once the cloud had sent
# nothing on their connection for about a minute, failing the sessions waiting on it.
MIN_PING_INTERVAL_OPTION = "grpc.http2.min_ping_interval_without_data_ms"


def engine_limits(limits: ServiceLimits, max_tree_tokens: int, engine: TargetEngine) -> ServiceLimits:
    """The limits this engine serves: a draft tree (`--max-tree-tokens`) only with its tree attention; without it the
    open's limits say 0 tree tokens, so edges never branch, and a tree frame is refused naming verify.parents."""
    return replace(limits, max_tree_tokens=max_tree_tokens if engine.tree_attention else 0)


class CloudServer:
    """`async with CloudServer(settings) as server:` serves until `server.stop()` or a signal."""

    def __init__(self, settings: CloudSettings, target: LoadedModel | None = None,
                 draft: LoadedModel | None = None) -> None:
        self.settings = settings
        self.preloaded_target = target  # tests hand in models; the CLI loads them after the port is up
        self.preloaded_draft = draft
        self.metrics = CloudMetrics()
        self.health = health_aio.HealthServicer()
        self.servicer = TargetServicer(EdgeAuthenticator.from_file(settings.auth_tokens), self.metrics,
                                       settings.max_streams)
        self.limits = ServiceLimits(max_block=settings.max_block, max_context=settings.max_context,
                                    max_message_bytes=4 << 20, max_generate=settings.edge_max_generate)
        # Beyond --max-streams the servicer refuses with a retry hint; the transport bound is a backstop
        # that leaves room for health checks and GetInfo.
        self.server = grpc.aio.server(options=self._channel_options(),
                                      maximum_concurrent_rpcs=settings.max_streams + 64)
        self.port = 0
        self.load = LoadTracker()
        self._stopping = asyncio.Event()
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def _channel_options(self) -> list[tuple[str, int]]:
        settings = self.settings
        return [
            ("grpc.max_receive_message_length", self.limits.max_message_bytes),
            ("grpc.max_send_message_length", self.limits.max_message_bytes),
            # Dead peers: ping a silent connection every keepalive_s, drop it if the ping is not answered.
            ("grpc.keepalive_time_ms", int(settings.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(settings.keepalive_timeout_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(settings.keepalive_timeout_s * 1000)),  # grpc 1.85 times pings by this
            ("grpc.http2.max_pings_without_data", 0),  # keep pinging a stream that is quiet for long
            ("grpc.max_connection_idle_ms", int(settings.max_connection_idle_s * 1000)),
            # Edges ping every 20 s (edge/cloud_link/client.py), also between calls; faster pingers are cut off.
            ("grpc.keepalive_permit_without_calls", 1),
            (MIN_PING_INTERVAL_OPTION, 10_000),
            ("grpc.http2.max_ping_strikes", 2),
        ]

    async def __aenter__(self) -> "CloudServer":
        pb_grpc.add_TargetServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                             reflection.SERVICE_NAME), self.server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = self._bind()
        await self.server.start()
        if self.settings.metrics_port is not None:
            self._metrics_server = await serve_metrics(self.metrics, self.settings.host, self.settings.metrics_port,
                                                       self.settings.metrics_read_timeout_s)
        self._tasks.append(asyncio.create_task(self._load_and_serve(), name="cloud-main"))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.settings.metrics_port is not None:
            self._metrics_server.close()

    def _bind(self) -> int:
        address = f"{self.settings.host}:{self.settings.port}"
        if self.settings.tls_cert or self.settings.tls_key:
            if not (self.settings.tls_cert and self.settings.tls_key):
                raise ValueError("TLS needs both --tls-cert and --tls-key")
            credentials = grpc.ssl_server_credentials([(Path(self.settings.tls_key).read_bytes(),
                                                        Path(self.settings.tls_cert).read_bytes())])
            return self.server.add_secure_port(address, credentials)
        return self.server.add_insecure_port(address)

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def wait_ready(self) -> None:
        """Until the model is loaded and the service SERVING; raises what stopped it from getting there."""
        ready = asyncio.create_task(self._ready.wait())
        await asyncio.wait([ready, self._tasks[0]], return_when=asyncio.FIRST_COMPLETED)
        if not self._ready.is_set():
            ready.cancel()
            self._tasks[0].result()  # raises the loading failure
            raise RuntimeError("the cloud stopped before it was ready")

    def stop(self) -> None:
        self._stopping.set()

    async def wait_stopped(self) -> None:
        """Until the service has drained and stopped (after `stop()` or a failure while loading)."""
        await self._tasks[0]

    async def _load_and_serve(self) -> None:
        settings = self.settings
        async with self._engine() as engine:
            quotas = EdgeQuotas(settings.edge_max_sessions or settings.max_sessions, settings.edge_kv_budget_bytes,
                                settings.edge_max_generate)
            invariant = KVInvariant(engine.kv_bytes_in_use, lambda used, where: self.metrics.kv_over_budget.inc(),
                                    strict=os.environ.get("SPRINTER_CHECK_INVARIANTS") == "1")
            store = SessionStore(
                SessionLimits(settings.max_sessions, settings.kv_budget_bytes, settings.idle_timeout_s, quotas,
                              settings.evict_grace_s, settings.evict_older_idle_s),
                engine.kv_bytes_per_token, on_evict=lambda _session: self.metrics.sessions_evicted.inc(),
                invariant=invariant, prefix_cache=engine.prefix_cache,
            )
            self.limits = engine_limits(self.limits, settings.max_tree_tokens, engine)
            shape = cost_table.TableLimits(self.limits.max_block, self.limits.max_context, settings.max_sessions,
                                           settings.kv_budget_bytes)
            costs = (await cost_table.measure(engine, shape) if settings.cost_table == "on"
                     else CloudCosts())
            host = TargetHost(engine, self.limits, store, self.metrics,
                                    residual=ResidualSettings(settings.residual_candidates, settings.residual_queries),
                                    proposer=settings.proposer,
                                    suffix_memories=SuffixMemories(cache=settings.suffix_cache == "on"),
                                    queue=self._queue(), costs=costs)
            self.servicer.host = host
            async with self._fleet_presence(host) as announcer:
                await self._set_health(health_pb2.HealthCheckResponse.SERVING)
                self._ready.set()
                log.info("serving %s (engine %s) on %s:%d", engine.info.spec, engine.name, settings.host, self.port)
                sweeper = asyncio.create_task(self._expire_idle(store))
                await self._stopping.wait()
                if announcer is not None:
                    await announcer.draining()
                await self._drain()
                sweeper.cancel()

    def _queue(self) -> AdmissionQueue:
        metrics = self.metrics
        observer = QueueObserver(lambda identity, n: metrics.queue_length.labels(identity).set(n),
                                 lambda identity, s: metrics.queue_wait_seconds.labels(identity).observe(s))
        return AdmissionQueue(QueueSettings(self.settings.queue_max, self.settings.queue_grace_s), observer)

    @asynccontextmanager
    async def _engine(self) -> AsyncIterator[TargetEngine]:
        """The target loaded into the engine `--engine` names, for as long as the service runs."""
        settings = self.settings
        if settings.engine == "vllm":
            from cloud.vllm_engine import VllmEngine, VllmOptions  # vLLM's own environment (`make vllm`)

            log.info("loading target %s into vLLM (%s)", settings.target, settings.dtype)
            options = await asyncio.to_thread(VllmOptions.of, settings)
            engine = await asyncio.to_thread(VllmEngine.start, settings.target, options, self.metrics,
                                             self._observe_batch)
            try:
                yield engine
            finally:
                engine.shutdown()
            return
        if settings.engine == "llama.cpp":
            async with self._llama_cpp_engine() as engine:
                yield engine
            return
        target = self.preloaded_target
        if target is None:
            device = resolve_device(settings.device)
            log.info("loading target %s (%s) on %s", settings.target, settings.dtype, device)
            target = await asyncio.to_thread(load_model, settings.target, DTYPES[settings.dtype], device)
        paged = settings.paged(target.model.device.type)
        # No session grows past the context limit plus one block or tree (a verify's new tokens are written first).
        kv_layout = KVLayout.of(target.model, page_tokens=PAGE_TOKENS_PAGED if paged else 64,
                                max_tokens=settings.max_context + settings.max_verify_tokens + 1)
        settings.check_kv_budget(kv_layout.bytes_per_token)
        # The pool holds the budget, plus a forward's and the Generate calls' page rounding of slack.
        kv_pool = KVPool(kv_layout, settings.kv_budget_bytes, slack_tokens=settings.max_forward_tokens
                         + settings.max_batch * kv_layout.page_tokens) if paged else None
        tiled = settings.tiled(target.model.device.type)
        graphs = GraphForwards(target.model, kv_pool) if settings.graphed(target.model.device.type) else None
        replay = graphs.replay if graphs is not None else None
        async with Batcher(packed_forward_of(target.model, tiled, replay), settings.batch_window_ms / 1e3, settings.max_batch,
                           on_batch=self._observe_batch, demand=lambda: self.servicer.open_streams,
                           max_prefill_chunk=settings.max_prefill_chunk,
                           max_forward_tokens=settings.max_forward_tokens) as batcher, \
                self._draft_engine(target, batcher) as draft:
            prefix_cache = (PrefixCache(kv_layout, kv_pool, settings.share_prefix_cache,
                                        on_evict=self.metrics.prefix_cache_evictions.inc)
                            if settings.prefix_cache else None)
            engine = ResidentEngine(target, batcher, kv_layout, kv_pool, draft, prefix_cache, query_tiles=tiled,
                                    replay=replay)
            log.info("resident engine on %s, %s attention%s%s", kv_layout.device, "paged" if paged else "per-session",
                     ", query tiles per session" if tiled else "", ", CUDA graphs" if graphs is not None else "")
            if paged or kv_layout.device.type != "cpu":  # compiles the paged kernel; initialises the GPU's libraries
                await asyncio.to_thread(engine.warm_up)
            yield engine

    @asynccontextmanager
    async def _llama_cpp_engine(self) -> AsyncIterator[LlamaCppEngine]:
        """The target's GGUF on llama.cpp, its forwards through a batcher of its own; with `--draft`, the draft's GGUF
        in a context of its own, its batcher on the target's forward thread (the two take turns)."""
        settings = self.settings
        async with self._llama_cpp(settings.target) as (engine, batcher):
            if settings.prefix_cache:
                engine.prefix_cache = LlamaCppPrefixCache(engine, settings.share_prefix_cache,
                                                          on_evict=self.metrics.prefix_cache_evictions.inc)
            if settings.draft is None:
                yield engine
                return
            async with self._llama_cpp(settings.draft, batcher.worker) as (draft, _):
                if draft.info.vocab_fingerprint != engine.info.vocab_fingerprint:
                    raise ValueError(f"--draft {settings.draft} does not share the target's tokenizer "
                                     f"({settings.target}): its tokens could not be verified")
                engine.draft = draft
                yield engine

    @asynccontextmanager
    async def _llama_cpp(self, spec: str, worker: Any = None) -> AsyncIterator[tuple[LlamaCppEngine, Batcher]]:
        """One GGUF loaded into a llama.cpp context sized by the service's limits, with a batcher running it."""
        settings = self.settings
        log.info("loading %s into llama.cpp", spec)
        engine = await asyncio.to_thread(
            LlamaCppEngine.load, spec, settings.threads or default_threads(), settings.kv_budget_bytes,
            settings.max_context + settings.max_verify_tokens + 1, 2 * settings.max_sessions,
            settings.max_forward_tokens)
        try:
            settings.check_kv_budget(engine.kv_bytes_per_token)
            observe = self._observe_batch if worker is None else self._observe_draft_batch
            async with Batcher(engine.packed_forward, settings.batch_window_ms / 1e3, settings.max_batch,
                               on_batch=observe, demand=lambda: self.servicer.open_streams,
                               max_prefill_chunk=settings.max_prefill_chunk,
                               max_forward_tokens=settings.max_forward_tokens, worker=worker) as batcher:
                engine.batcher = batcher
                yield engine, batcher
        finally:
            engine.close()

    @asynccontextmanager
    async def _draft_engine(self, target: LoadedModel, target_batcher: Batcher) -> AsyncIterator[DraftEngine | None]:
        """The cloud's own draft with its batcher (`--draft`, mode cloud-sd), on the target's device and its forward
        thread (the two models' forwards take turns); None without."""
        settings = self.settings
        if settings.draft is None:
            yield None
            return
        draft = self.preloaded_draft
        if draft is None:
            log.info("loading the cloud's draft %s (%s) on %s", settings.draft, settings.dtype, target.model.device)
            draft = await asyncio.to_thread(load_model, settings.draft, DTYPES[settings.dtype], target.model.device)
        if vocab_fingerprint(draft.tokenizer) != vocab_fingerprint(target.tokenizer):
            raise ValueError(f"--draft {settings.draft} does not share the target's tokenizer ({settings.target}): "
                             "its tokens could not be verified")
        kv_layout = KVLayout.of(draft.model, max_tokens=settings.max_context + settings.max_block + 1)
        async with Batcher(packed_forward_of(draft.model), max_batch=settings.max_batch,
                           on_batch=self._observe_draft_batch,
                           demand=lambda: self.servicer.open_streams, max_prefill_chunk=settings.max_prefill_chunk,
                           max_forward_tokens=settings.max_forward_tokens, worker=target_batcher.worker) as batcher:
            yield DraftEngine(draft, batcher, kv_layout)

    def _observe_draft_batch(self, forward: ForwardStats) -> None:
        self.metrics.draft_forward_seconds.observe(forward.seconds)

    def _observe_batch(self, forward: ForwardStats) -> None:
        self.metrics.observe_batch(forward)
        self.load.observe(forward.requests, forward.seconds)

    def _fleet_presence(self, host: TargetHost) -> AbstractAsyncContextManager[LoadAnnouncer | None]:
        """This replica's load on the fleet plane, with --mqtt; nothing without it."""
        settings = self.settings
        if not settings.mqtt:
            return nullcontext()
        broker = BrokerSettings.parse(settings.mqtt, ca_file=settings.mqtt_ca, cert_file=settings.mqtt_cert,
                                      key_file=settings.mqtt_key, keepalive_s=settings.mqtt_keepalive)
        replica_id = settings.replica_id or f"cloud-{self.port}"
        store = host.store
        read = load_reader(replica_id, host.engine.info.spec, host.vocab_fingerprint,
                           settings.advertise or f"{settings.host}:{self.port}", self.load, lambda: len(store),
                           lambda: host.engine.queue_depth, lambda: (store.kv_bytes, settings.kv_budget_bytes),
                           lambda: store.prefix_cache.announced() if store.prefix_cache is not None else [])
        return LoadAnnouncer(broker, replica_id, read)

    async def _expire_idle(self, store: SessionStore) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.settings.idle_timeout_s / 4))
            if store.expire_idle():
                self.servicer.host.update_gauges()

    async def _drain(self) -> None:
        log.info("draining: no new sessions; waiting up to %.0f s for %d open streams",
                 self.settings.drain_s, self.servicer.open_streams)
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()
        deadline = asyncio.get_running_loop().time() + self.settings.drain_s
        while self.servicer.open_streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await self.server.stop(grace=1.0)
        log.info("stopped")


async def run_until_signalled(settings: CloudSettings) -> None:
    async with CloudServer(settings) as server:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.stop)
        await server.wait_stopped()
