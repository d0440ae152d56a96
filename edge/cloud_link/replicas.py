"""The cloud replicas an edge verifies on: where a new session goes, and how each replica is faring.

Replicas come from `--cloud` (comma-separated HOST:PORT entries; a name that resolves to several addresses, such as
a Kubernetes headless Service, is one replica per address, resolved again every `resolve_every_s`) or, with `--mqtt`
and no `--cloud`, from the clouds' load announcements (`observe`; with `--cloud` announcements only update what the
edge knows of its own replicas: an announced address could bypass the proxy or tunnel the edge was told to use). A
replica is used only once it has answered GetInfo with this draft's vocabulary; one that serves another is refused,
logged, and never used. GetInfo also brings its cost table (`costs`: what `--mode auto` weighs).

Choosing: rendezvous hashing on the session's key over the usable replicas (each scores sha256(key, address), the
highest wins), so adding a replica moves only the new sessions it now wins and a live session moves only when its
replica fails it. Bounded load: a replica already over LOAD_FACTOR x the mean load (its announced open sessions
while fresh, else this edge's own sessions there) is passed over for the next in the session's order.

Health: a replica that fails a call rests for an exponential backoff with jitter; one that says it is draining (in
an error frame or its announcement) gets no new sessions for DRAIN_REST_S, after which it is tried again (a replica
restarted on the same address comes back); an `online` announcement ends a rest at once. One whose health says
NOT_SERVING (`loading`) is asked again every LOADING_REST_S, and waited for. Sessions stay until it fails them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

import grpc

from common.addresses import join_host_port, split_host_port
from common.admission import Admission, QueuePlace
from common.fleet_plane.messages import CloudLoad
from common.sampling.distributions import SamplingParams
from common.spec.round_cost import CloudCosts
from common.wire import cloud_costs
from edge.cloud_link.prefix_key import holders_first, prefix_key, rendezvous_order
from edge.cloud_link.client import (CloudClient, CloudEndpoint, CloudLimits, CloudLoading, CloudRefused, CloudUnavailable,
                                    DeadlinePassed, backoff_delay, time_left)
from edge.cloud_link.failures import ACTIONS, Cause, Rest
from edge.cloud_link.session import CloudSession
from sprinter.v1 import decoding_pb2 as pb

log = logging.getLogger(__name__)

LOAD_FACTOR = 1.25
# A replica that refused with RESOURCE_EXHAUSTED, or announced a queue, counts as busy this long (placement): an
# announced queue is one instant's, and a batching cloud under load announces 0 between its forwards as often as not.
BUSY_HOLD_S = 10.0
DRAIN_REST_S = 30.0
LOADING_REST_S = 1.0  # a replica loading its model is asked again this often
ANNOUNCEMENT_FRESH_S = 15.0
PROBE_EVERY_S = 2.0

EndpointFactory = Callable[[str, str | None], CloudEndpoint]  # (address, TLS server name) -> endpoint


@dataclass
class Replica:
    client: CloudClient
    origin: str  # the --cloud entry or announcement it came from
    model_id: str | None = None  # set once GetInfo answered with this draft's vocabulary
    draft_model_id: str | None = None  # the cloud's own draft (cloud-sd), as GetInfo announced it; None: none
    costs: CloudCosts = field(default_factory=CloudCosts)  # its forward times, as GetInfo announced them
    refused: str | None = None  # why it is never used
    rest_until: float = 0.0
    failures: int = 0
    sessions: int = 0  # this edge's sessions on it now
    announced_sessions: int | None = None
    announced_queue_depth: int = 0  # verifications waiting for a batch, as last announced
    announced_batch_mean: float = 0.0
    announced_at: float = 0.0
    announced_prefixes: frozenset[str] = frozenset()  # digests of the prompt prefixes it caches (prefix_key.py)
    busy_until: float = 0.0  # it refused a Generate with RESOURCE_EXHAUSTED or announced a queue: busy until then
    gone: bool = False  # no longer resolved or announced: no new sessions
    loading: bool = False  # answers, but its health says NOT_SERVING (the model loads): waited for, not failed
    generate_slots: asyncio.Semaphore | None = None  # the replica's Generate quota for this edge, queued here

    def slots(self) -> asyncio.Semaphore:
        if self.generate_slots is None:
            self.generate_slots = asyncio.Semaphore(self.client.limits.max_generate or 1 << 16)
        return self.generate_slots

    @property
    def address(self) -> str:
        return self.client.endpoint.address

    def usable(self, now: float) -> bool:
        return self.model_id is not None and self.refused is None and not self.gone and now >= self.rest_until

    def fresh(self, now: float) -> bool:
        return self.announced_sessions is not None and now - self.announced_at < ANNOUNCEMENT_FRESH_S

    def load(self, now: float) -> int:
        return max(self.sessions, self.announced_sessions) if self.fresh(now) else self.sessions

    def drafting_load(self, now: float) -> tuple[float, bool]:
        """(how much its queue stretches a cloud-sd round, >= 1; whether it is busy): a fresh announcement's
        queue (a queue of one batch doubles a round); busy while it is, and for BUSY_HOLD_S after an announced queue
        or a RESOURCE_EXHAUSTED refusal."""
        queue = self.announced_queue_depth if self.fresh(now) else 0
        return 1.0 + queue / max(1.0, self.announced_batch_mean), queue > 0 or now < self.busy_until


class ReplicaSet:
    """`async with ReplicaSet(["a:50051", "b:50051"], endpoint, fingerprint) as clouds:` then sessions on it."""

    def __init__(self, entries: Sequence[str], endpoint: EndpointFactory, vocab_fingerprint: str,
                 resolve_every_s: float = 30.0, adopt_announced: bool = False) -> None:
        self.entries = [e.strip() for e in entries if e.strip()]
        for entry in self.entries:
            split_host_port(entry)
        self.endpoint = endpoint
        self.vocab_fingerprint = vocab_fingerprint
        self.resolve_every_s = resolve_every_s
        self.adopt_announced = adopt_announced  # add replicas only announcements name (else: only track known ones)
        self.replicas: dict[str, Replica] = {}
        self.reopen_causes: Counter[str] = Counter()
        self._tasks: set[asyncio.Task] = set()
        self._maintenance: asyncio.Task | None = None
        self._clients = contextlib.AsyncExitStack()  # every replica's client, open until the set closes

    async def __aenter__(self) -> ReplicaSet:
        try:
            await self.resolve()
            await self.probe_all()
        except BaseException:
            await self._clients.aclose()
            raise
        self._maintenance = asyncio.create_task(self._maintain(), name="cloud-replicas")
        return self

    async def __aexit__(self, *exc: object) -> None:
        # The tasks stop first, by hand: they add clients to the stack as replicas appear, so the stack's
        # last-in-first-out order cannot put them before the clients.
        for task in (self._maintenance, *self._tasks):
            if task is not None:
                task.cancel()
        await self._clients.aclose()

    # --- membership -----------------------------------------------------------------------------

    async def resolve(self) -> None:
        """Every --cloud entry, expanded to the addresses its name has now."""
        resolved: dict[str, tuple[str, str | None]] = {}
        for entry in self.entries:
            host, port = split_host_port(entry)
            for address, server_name in await self._addresses(host, port, entry):
                resolved[address] = (entry, server_name)
        for address, (entry, server_name) in resolved.items():
            if address not in self.replicas:
                await self._add(address, entry, server_name)
            self.replicas[address].gone = False
        for replica in self.replicas.values():
            if replica.origin in self.entries and replica.address not in resolved:
                replica.gone = True  # left the name's records: finish what runs there, send nothing new

    async def _addresses(self, host: str, port: str, entry: str) -> list[tuple[str, str | None]]:
        try:
            ipaddress.ip_address(host)
            return [(entry, None)]
        except ValueError:
            pass
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as err:
            log.warning("cloud %s does not resolve (%s); trying again later", entry, err)
            return [(entry, None)] if entry in self.replicas else []
        addresses = sorted({info[4][0] for info in infos})
        if len(addresses) <= 1:
            return [(entry, None)]  # one address: keep the name (the certificate is checked against it)
        return [(join_host_port(a, port), host) for a in addresses]

    async def _add(self, address: str, origin: str, server_name: str | None) -> Replica:
        client = await self._clients.enter_async_context(CloudClient(self.endpoint(address, server_name)))
        replica = self.replicas[address] = Replica(client, origin)
        log.info("cloud replica %s (from %s)", address, origin)
        return replica

    def observe(self, load: CloudLoad) -> None:
        """A replica's announcement on the fleet plane (it may be one --cloud never named)."""
        replica = self.replicas.get(load.endpoint)
        if replica is None:
            if load.status != "online" or not self.adopt_announced:
                return
            self._spawn(self._add_announced(load))
            return
        replica.announced_sessions, replica.announced_at = load.open_sessions, time.monotonic()
        replica.announced_queue_depth, replica.announced_batch_mean = load.queue_depth, load.batch_size_mean
        replica.announced_prefixes = frozenset(load.prefixes)
        if load.queue_depth > 0:
            replica.busy_until = max(replica.busy_until, replica.announced_at + BUSY_HOLD_S)
        if load.status == "online":
            replica.rest_until, replica.gone = 0.0, False
        elif load.status == "draining":
            replica.rest_until = time.monotonic() + DRAIN_REST_S

    async def _add_announced(self, load: CloudLoad) -> None:
        if load.endpoint in self.replicas:
            return
        replica = await self._add(load.endpoint, f"announcement of {load.replica_id}", None)
        replica.announced_sessions, replica.announced_at = load.open_sessions, time.monotonic()
        await self._probe(replica)

    # --- health ----------------------------------------------------------------------------------

    async def probe_all(self, everything: bool = False, timeout_s: float | None = None) -> list[pb.ServiceInfo]:
        """GetInfo from every replica not yet checked (`everything`: every one not refused), at once; the
        answers of those that serve our vocabulary. One that does not answer (within `timeout_s`) rests."""
        chosen = [r for r in self.replicas.values() if r.refused is None and (everything or r.model_id is None)]
        answers = await asyncio.gather(*(self._probe(r, timeout_s) for r in chosen))
        return [a for a in answers if a is not None]

    async def _probe(self, replica: Replica, timeout_s: float | None = None) -> pb.ServiceInfo | None:
        try:
            info = await replica.client.info(timeout_s)
        except CloudLoading as err:
            replica.loading, replica.rest_until = True, time.monotonic() + LOADING_REST_S  # no backoff: it answers
            log.info("%s", err)
            return None
        except CloudUnavailable as err:
            replica.loading = False
            self._rest(replica)
            log.debug("cloud replica %s unreachable: %s", replica.address, err)
            return None
        replica.loading = False
        if info.vocab_fingerprint != self.vocab_fingerprint:
            replica.refused = f"serves {info.model_id}, whose vocabulary differs from the draft's"
            log.error("cloud replica %s refused: it %s", replica.address, replica.refused)
            return None
        replica.model_id, replica.failures, replica.rest_until = info.model_id, 0, 0.0
        replica.draft_model_id, replica.costs = info.draft_model_id or None, cloud_costs(info)
        return info

    def _rest(self, replica: Replica) -> None:
        replica.failures += 1
        replica.rest_until = time.monotonic() + backoff_delay(replica.failures - 1, 0.5, 15.0)

    async def _maintain(self) -> None:
        last_resolve = time.monotonic()
        while True:
            await asyncio.sleep(PROBE_EVERY_S)
            if time.monotonic() - last_resolve >= self.resolve_every_s:
                last_resolve = time.monotonic()
                await self.resolve()
            now = time.monotonic()
            for replica in list(self.replicas.values()):
                if replica.model_id is None and replica.refused is None and now >= replica.rest_until:
                    await self._probe(replica)

    def _spawn(self, coroutine: object) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- the Replicas protocol of edge/cloud_link/session.py -----------------------------------------------

    @property
    def attempts(self) -> int:
        retries = next(iter(self.replicas.values())).client.endpoint.retries if self.replicas else 2
        return retries + max(1, len(self.replicas))

    def choose(self, key: str, avoid: frozenset[str] = frozenset(), drafting: bool = False) -> CloudClient | None:
        now = time.monotonic()
        usable = [r for r in self.replicas.values() if r.usable(now) and (r.draft_model_id or not drafting)]
        if not usable:
            return None
        ranked = holders_first(key, rendezvous_order(key, usable))  # who holds more of the prompt, then rendezvous
        preferred = [r for r in ranked if r.address not in avoid] or ranked
        cap = LOAD_FACTOR * (sum(r.load(now) for r in usable) + 1) / len(usable)
        return next((r for r in preferred if r.load(now) + 1 <= cap), preferred[0]).client

    async def recover(self) -> None:
        """No replica is usable: probe every one not refused now, rest or not (the caller's own retry
        interval paces this), so that a cloud that came back is used at once."""
        if not self.available():
            await asyncio.gather(*(self._probe(r) for r in self.replicas.values() if r.refused is None))

    def acquire(self, client: CloudClient) -> None:
        self._replica(client).sessions += 1

    def release(self, client: CloudClient) -> None:
        replica = self._replica(client)
        replica.sessions = max(0, replica.sessions - 1)

    def report(self, client: CloudClient, cause: Cause | None) -> None:
        replica = self._replica(client)
        if cause is None:
            replica.failures = 0
            return
        self.reopen_causes[cause.value] += 1
        rest = ACTIONS[cause].rest
        if rest is Rest.BACKOFF:
            self._rest(replica)
            log.warning("cloud replica %s failed a call; resting it for %.1f s", replica.address,
                        replica.rest_until - time.monotonic())
        elif rest is Rest.DRAIN:
            replica.rest_until = time.monotonic() + DRAIN_REST_S

    def _replica(self, client: CloudClient) -> Replica:
        return self.replicas[client.endpoint.address]

    # --- what the decoder uses ------------------------------------------------------------------

    @property
    def limits(self) -> CloudLimits:
        """The tightest of the checked replicas' limits: a session may move to any of them."""
        known = [r.client.limits for r in self.replicas.values() if r.model_id is not None]
        def tightest(values: list[int | None]) -> int | None:
            given = [v for v in values if v]
            return min(given) if given else None
        trees = min((k.max_tree_tokens or 0 for k in known), default=0)  # a replica that takes chains only: none
        return CloudLimits(tightest([k.max_block for k in known]), tightest([k.max_context for k in known]),
                           tightest([k.max_sparse_support for k in known]), max_tree_tokens=trees or None)

    def available(self) -> bool:
        now = time.monotonic()
        return any(r.usable(now) for r in self.replicas.values())

    def loading(self) -> bool:
        """None is usable, but one answers with its model still loading: a wait, not an outage."""
        return not self.available() and any(r.loading and r.refused is None for r in self.replicas.values())

    def drafts(self) -> bool:
        """Some usable replica has a draft of its own: cloud-sd (placement cloud) can run."""
        now = time.monotonic()
        return any(r.usable(now) and r.draft_model_id for r in self.replicas.values())

    def costs(self) -> CloudCosts:
        """A usable replica's cost table (GetInfo): what `--mode auto` weighs before the edge's own measurements."""
        now = time.monotonic()
        return next((r.costs for r in self.replicas.values() if r.usable(now) and r.costs), CloudCosts())

    def drafting_load(self) -> tuple[float, bool]:
        """The least loaded usable drafting replica's (load factor, busy): where a cloud-sd request would go."""
        now = time.monotonic()
        loads = [r.drafting_load(now) for r in self.replicas.values() if r.usable(now) and r.draft_model_id]
        return min(loads, key=lambda load: (load[1], load[0])) if loads else (1.0, False)

    def session(self, sampling: SamplingParams, vocab_fingerprint: str = "", deadline_at: float | None = None,
                output_start: int | None = None, priority: int = 0) -> CloudSession:
        return CloudSession(self, sampling, vocab_fingerprint, deadline_at, output_start, priority)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, max_new_tokens: int,
                       vocab_fingerprint: str = "", deadline_at: float | None = None,
                       output_start: int | None = None, speculate_block: int | None = None,
                       proposer: str | None = None, admission: Admission | None = None,
                       on_ticket: Callable[[QueuePlace], None] = lambda place: None) -> AsyncIterator[pb.GenerateChunk]:
        """Mode target (cloud-sd with `speculate_block`, by `proposer`) on one replica; CloudUnavailable (the replica
        rests) when it fails or none is usable (CloudLoading: one is loading). Waits are bounded by the deadline."""
        drafting = speculate_block is not None  # cloud-sd: only a replica with a draft of its own
        client = self.choose(key := prefix_key(prompt_ids), drafting=drafting)  # where its prefix is cached
        if client is None:
            await self.recover()
            if (client := self.choose(key, drafting=drafting)) is None and self.loading():
                raise CloudLoading(grpc.StatusCode.UNAVAILABLE, "the cloud is still loading its model")
        if client is None:
            raise CloudUnavailable(grpc.StatusCode.UNAVAILABLE, "no cloud replica is usable now")
        self.acquire(client)
        slots = self._replica(client).slots()
        try:  # past the replica's Generate quota a request waits here for a slot, rather than being refused there
            await asyncio.wait_for(slots.acquire(), time_left(deadline_at))
        except asyncio.TimeoutError:
            self.release(client)
            raise DeadlinePassed(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed waiting for a Generate slot") from None
        try:
            async for chunk in client.generate(prompt_ids, sampling, max_new_tokens, vocab_fingerprint, deadline_at,
                                               output_start, speculate_block, proposer, admission, on_ticket):
                yield chunk
        except DeadlinePassed:
            raise  # the request's own limit: says nothing about the replica
        except CloudRefused as err:
            if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy: placement keeps drafting off it for a while
                self._replica(client).busy_until = time.monotonic() + BUSY_HOLD_S
            raise
        except CloudUnavailable:
            self.report(client, Cause.REPLICA_FAILED)
            raise
        finally:
            slots.release()
            self.release(client)

    def describe(self) -> list[dict]:
        now = time.monotonic()
        return [{"address": r.address, "model": r.model_id, "draft": r.draft_model_id, "usable": r.usable(now),
                 "sessions": r.sessions, "loading": r.loading, "refused": r.refused,
                 "draining_or_resting_s": max(0.0, round(r.rest_until - now, 1))}
                for r in sorted(self.replicas.values(), key=lambda r: r.address)]

    @property
    def address(self) -> str | None:
        """The replicas in use now (for logs and telemetry)."""
        now = time.monotonic()
        return ",".join(sorted(r.address for r in self.replicas.values() if r.usable(now))) or None
