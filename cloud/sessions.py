"""Sessions: each edge generation keeps its context and its target KV cache on the cloud.

The store bounds memory three ways: a KV budget, a session limit (both with fair-share eviction of
idle sessions, see cloud/quotas.py) and an idle timeout. Admission happens before any compute: a
session or a Generate that cannot fit is refused with RESOURCE_EXHAUSTED, never admitted and then
evicted (to admit work, only one idle for `evict_grace_s`, and only one younger than the work admitted:
otherwise the newcomer waits its turn in line, rather than sessions evicting each other on every round, each
eviction a prefill). An evicted session simply disappears; the edge's next frame gets NOT_FOUND and it reopens
with its full context, so eviction costs a prefill, never correctness.

Seniority (as vLLM's scheduler preempts its newest request): every request gets a stamp in arrival order
(`SessionStore.stamp`), and admitting work may evict only sessions younger than it, or older ones idle for
`evict_older_idle_s` (an edge that went away, or one far behind). A new request is the youngest, so it evicts no
session in use: it waits for room. A reopen of an evicted session names it
(`Admission.evicted_session_id`) and takes its stamp back, so it keeps its turn and cannot be pushed out by
those that came after it; and since a victim is always younger than the work that evicts it, evictions
cannot go round in a circle.

KV is counted in the pages a session holds or has been granted (at least its context) beside the
prefix cache's, the cache's blocks once each however many sessions read them (cloud/prefix_cache.py),
and a Generate's prompt plus its new tokens; an open is charged for its whole prompt before its prefill
runs, and every forward's growth is granted before it runs (`grant_kv`), so the budget is never
exceeded while forwards are in flight. Room is made from the prefix cache's idle blocks first, least
recently used, and only then by evicting sessions.

That is checked, not assumed: `check_kv` compares the KV the engine measures (the bytes of its live
KV tensors, or the pool's pages taken; not this ledger) with the budget after every grant, forward
and eviction. A breach is counted (`sprinter_cloud_kv_over_budget_total`, which must stay 0) and
logged; with `strict` (SPRINTER_CHECK_INVARIANTS=1, for tests and soaks) it raises.
"""

from __future__ import annotations

import logging
import secrets
import time
import itertools
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import grpc
import torch

from cloud.errors import CloudError, exhausted
from cloud.engine import ExternalKV
from cloud.kv_pool import PagedKV
from cloud.prefix_cache import PrefixCache
from cloud.resident_kv import ResidentKV
from cloud.quotas import BUSY_RETRY_MS, GENERATE_RETRY_MS, EdgeQuotas, fair_share_victim
from common.admission import Admission
from common.errors import SprinterError
from common.sampling.logits_processing import LogitsProcessor
from common.sampling.logprobs import TokenLogprob
from common.sampling.distributions import SamplingParams

if TYPE_CHECKING:
    from cloud.residual import PendingResidual

log = logging.getLogger(__name__)
EVICTED_KEPT = 4096  # evicted sessions whose seniority a reopen can claim back (the oldest are forgotten)


@dataclass
class Session:
    session_id: str
    owner: str  # the authenticated edge identity; nobody else may touch this session
    tokens: list[int]  # the context: prompt, then every verified token
    cache: ResidentKV | PagedKV | ExternalKV  # holds the KV of tokens[:cached_tokens] (cloud/engine.py)
    sampling: SamplingParams
    generator: torch.Generator
    cached_tokens: int = 0
    reused_tokens: int = 0  # of the prompt, tokens whose KV came from the prefix cache (usage.cached_tokens)
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False  # a prefill or verify is in flight: never evicted under it
    # (start_position, n_accepted, next_token) of the latest verdict: the one a candidate block may follow (None: none
    # may, as after a tree verdict that kept a side path: candidates are drafted along a tree's primary chain)
    last_verdict: tuple[int, int, int] | None = None
    pending_residual: PendingResidual | None = None  # a verify waiting on the edge's residual answers (busy meanwhile)
    # the request's logit_bias and penalties, counting from the open's output_start; None: none asked for
    processor: LogitsProcessor | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # the open's answer when it asked (echo)
    admission: Admission = field(default_factory=Admission)  # its open's: priority and queue tickets, for its verifies
    queued_s: float = 0.0  # the open's time in the cloud's line
    seniority: int = 0  # its request's arrival stamp (module docstring): only younger sessions are evicted for it

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def held_tokens(self) -> int:
        """KV entries it holds: its allocated or granted pages, or its context if larger."""
        return max(self.length, self.cache.capacity, self.cache.granted)

    @property
    def kv_tokens(self) -> int:
        """KV entries charged to it: those it holds but the prefix cache's pages (charged to the cache)."""
        return self.held_tokens - self.cache.shared_tokens

    def touch(self) -> None:
        self.last_used = time.monotonic()


@dataclass
class SessionLimits:
    max_sessions: int = 64
    kv_budget_bytes: int = 2 << 30
    idle_timeout_s: float = 300.0
    edge: EdgeQuotas | None = None  # None: each edge may use the global limits
    evict_grace_s: float = 0.0  # admission never evicts a session used more recently than this (no thrashing)
    evict_older_idle_s: float = 0.0  # nor one older than the work admitted, unless idle this long (seniority)

    def __post_init__(self) -> None:
        if self.edge is None:
            self.edge = EdgeQuotas(self.max_sessions, self.kv_budget_bytes, max_generate=4)


class KVBudgetExceeded(SprinterError, AssertionError):
    """The KV the engine holds is over the budget (a broken invariant: a bug, never a load condition)."""


@dataclass
class KVInvariant:
    """What `SessionStore.check_kv` measures and what it does about a breach."""

    measure: Callable[[], int | None]  # the engine's KV in use (TargetEngine.kv_bytes_in_use)
    on_breach: Callable[[int, str], None] = lambda used, where: None  # counts it (the metric)
    strict: bool = False  # raise KVBudgetExceeded


class SessionStore:
    def __init__(self, limits: SessionLimits, kv_bytes_per_token: int,
                 on_evict: Callable[[Session], None] | None = None, invariant: KVInvariant | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.limits = limits
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            prefix_cache.room = self._cache_room
        self.edge = limits.edge
        self.kv_bytes_per_token = kv_bytes_per_token
        self.on_evict = on_evict
        self.invariant = invariant
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._generations: dict[int, tuple[str, int]] = {}  # running Generate calls: id -> (owner, KV tokens)
        self._evicted: OrderedDict[str, tuple[str, int]] = OrderedDict()  # session id -> (owner, seniority)
        self._stamps = itertools.count(1)
        self._generation_ids = itertools.count()

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def kv_bytes(self) -> int:
        tokens = sum(s.kv_tokens for s in self._sessions.values()) + sum(n for _, n in self._generations.values())
        return (tokens + self.cached_tokens) * self.kv_bytes_per_token

    @property
    def cached_tokens(self) -> int:
        """The prefix cache's blocks, each once."""
        return self.prefix_cache.tokens if self.prefix_cache is not None else 0

    def _cache_room(self, tokens: int) -> bool:
        """Room in the budget for `tokens` more cached tokens, made from idle cached blocks only."""
        needed = tokens * self.kv_bytes_per_token
        while self.kv_bytes + needed > self.limits.kv_budget_bytes:
            if not self.prefix_cache.evict_one():
                return False
        return True

    def owner_kv_bytes(self, owner: str) -> int:
        tokens = (sum(s.kv_tokens for s in self._sessions.values() if s.owner == owner)
                  + sum(n for o, n in self._generations.values() if o == owner))
        return tokens * self.kv_bytes_per_token

    def owner_sessions(self, owner: str) -> int:
        return sum(1 for s in self._sessions.values() if s.owner == owner)

    def create(self, owner: str, prompt_ids: list[int], sampling: SamplingParams,
               cache: ResidentKV | PagedKV | ExternalKV, seniority: int | None = None) -> Session:
        """Admit a session for `prompt_ids` (making room first, by `seniority`: a fresh stamp if None) or refuse
        it; nothing is computed yet."""
        seniority = self.stamp() if seniority is None else seniority
        self._check_fits(owner, len(prompt_ids), "prompt")
        self._make_session_room(owner, seniority)
        self._make_kv_room(len(prompt_ids) * self.kv_bytes_per_token, seniority)
        session = Session(
            session_id=secrets.token_hex(12), owner=owner, tokens=list(prompt_ids), cache=cache, sampling=sampling,
            generator=torch.Generator().manual_seed(sampling.seed), seniority=seniority,
        )
        self._sessions[session.session_id] = session
        return session

    def admit(self, owner: str, prompt_ids: list[int], sampling: SamplingParams,
              cache: ResidentKV | PagedKV | ExternalKV, seniority: int | None = None) -> Session:
        """`create`, with the prompt's whole pages granted and two more if the budget has them (no growth copy in
        the first verifies), or a refusal: one attempt, so that a busy refusal keeps an open's place in line."""
        session = self.create(owner, prompt_ids, sampling, cache, seniority)
        session.busy = True  # not its own victim
        try:
            self.grant_kv(session, len(prompt_ids), headroom_pages=2)
        except BaseException:
            self.close(session.session_id, remember=False)
            raise
        finally:
            session.busy = False
        return session

    def grant_live(self, session: Session, tokens: int) -> None:
        """Grant a verify's KV to a session still open, busy from then on: idle (evictable) while in line, so that
        sessions all waiting for KV cannot hold the whole budget between them."""
        if session.session_id not in self._sessions:
            raise CloudError(grpc.StatusCode.NOT_FOUND, f"session {session.session_id!r} was evicted while its verify "
                             "waited for KV; reopen it with the full context")
        session.busy = True
        try:
            self.grant_kv(session, tokens)
        except CloudError:
            session.busy = False
            raise

    def stamp(self) -> int:
        """A new request's seniority: younger than every stamp before it."""
        return next(self._stamps)

    def seniority_of_evicted(self, session_id: str, owner: str) -> int | None:
        """The stamp of `owner`'s session that this store evicted (taken back once by its reopen), else None."""
        evicted = self._evicted.get(session_id)
        if evicted is None or evicted[0] != owner:
            return None
        del self._evicted[session_id]
        return evicted[1]

    def start_generation(self, owner: str, kv_tokens: int, seniority: int | None = None) -> int:
        """Hold `kv_tokens` of KV (a Generate's prompt plus new tokens) for one of the edge's Generate slots, or refuse
        (RESOURCE_EXHAUSTED: with a retry hint while the slots or the budget are busy). Its key, for `end_generation`."""
        running = sum(1 for o, _ in self._generations.values() if o == owner)
        if running >= self.edge.max_generate:
            raise exhausted(f"this edge already runs {running} concurrent Generate calls (the limit, "
                            f"--edge-max-generate, is {self.edge.max_generate}); retry when one ends", GENERATE_RETRY_MS)
        self._check_fits(owner, kv_tokens, "Generate (prompt + max_new_tokens)")
        self._make_kv_room(kv_tokens * self.kv_bytes_per_token, self.stamp() if seniority is None else seniority)
        key = next(self._generation_ids)
        self._generations[key] = (owner, kv_tokens)
        return key

    def end_generation(self, key: int) -> None:
        self._generations.pop(key, None)

    @contextmanager
    def generation(self, owner: str, kv_tokens: int) -> Iterator[None]:
        """`start_generation` .. `end_generation` around a block."""
        key = self.start_generation(owner, kv_tokens)
        try:
            yield
        finally:
            self.end_generation(key)

    def get(self, session_id: str, owner: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise CloudError(grpc.StatusCode.NOT_FOUND, f"session {session_id!r} is unknown or was evicted; reopen it with the full context")
        if session.owner != owner:
            raise CloudError(grpc.StatusCode.PERMISSION_DENIED, f"session {session_id!r} belongs to another edge")
        self._sessions.move_to_end(session_id)
        session.touch()
        return session

    def contains(self, session_id: str) -> bool:
        return session_id in self._sessions

    def close(self, session_id: str, remember: bool = True) -> None:
        """Forget the session; with `remember` its whole pages go to the prefix cache first (a conversation's next
        turn starts from them), as far as the budget has room for a copy (per-session layout)."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return
        if remember and self.prefix_cache is not None and not isinstance(session.cache, ExternalKV):
            self.prefix_cache.remember(session.cache, self.prefix_cache.scope(session.owner),
                                       session.tokens[:session.cached_tokens])
        session.cache.release()

    def grant_kv(self, session: Session, tokens: int, headroom_pages: int = 0) -> None:
        """Charge `session` for `tokens` KV entries before the forward that writes them runs, so the budget
        holds while forwards are in flight: room for the pages it needs is made (idle sessions evicted) or the
        call is refused with RESOURCE_EXHAUSTED, nothing computed; the growth rule's spare pages (GROWTH x,
        `headroom_pages`) are granted only as far as the budget has them free. An engine that keeps its own
        KV (kv_bytes_per_token 0) is granted nothing: its cache evicts by itself."""
        cache = session.cache
        if not self.kv_bytes_per_token or tokens <= max(cache.capacity, cache.granted):
            return
        page = cache.layout.page_tokens
        needed = cache.layout.pages(tokens) * page
        roomy = cache.capacity_for(tokens, headroom_pages * page)
        charged = session.held_tokens  # the cache's pages among them are charged to it: room for them is there
        self._make_kv_room((needed - charged) * self.kv_bytes_per_token, session.seniority)
        free_tokens = (self.limits.kv_budget_bytes - self.kv_bytes) // self.kv_bytes_per_token
        cache.granted = max(needed, min(roomy, (charged + free_tokens) // page * page))
        self.check_kv("grant")

    def enforce_budget(self, protect: Session | None = None) -> None:
        """Evict idle cached blocks, then idle sessions (fair share first), until the KV fits the budget; `protect` is
        never evicted."""
        while self.kv_bytes > self.limits.kv_budget_bytes and (self._evict_cached() or
                                                               self._evict(self._kv_share, "KV budget", protect)):
            pass
        self.check_kv("eviction")

    def check_kv(self, where: str) -> None:
        """The budget invariant (module docstring), after a grant, a forward or an eviction."""
        used = self.invariant.measure() if self.invariant is not None else None
        if used is None or used <= self.limits.kv_budget_bytes:
            return
        message = (f"KV in use {used} bytes > budget {self.limits.kv_budget_bytes}, checked at: {where} "
                   f"(the ledger says {self.kv_bytes})")
        log.error("broken invariant: %s", message)
        self.invariant.on_breach(used, where)
        if self.invariant.strict:
            raise KVBudgetExceeded(message)

    def expire_idle(self) -> int:
        now = time.monotonic()
        stale = [s.session_id for s in self._sessions.values()
                 if not s.busy and now - s.last_used > self.limits.idle_timeout_s]
        for session_id in stale:
            log.info("session %s idle for over %.0f s: closed", session_id, self.limits.idle_timeout_s)
            self.close(session_id)
        return len(stale)

    def _check_fits(self, owner: str, n_tokens: int, what: str) -> None:
        needed = n_tokens * self.kv_bytes_per_token
        allowed = min(self.limits.kv_budget_bytes, self.edge.kv_budget_bytes)
        if needed > allowed:
            raise exhausted(f"this {what} needs {needed >> 10} KiB of KV cache, more than this cloud lets one edge hold "
                            f"({allowed >> 10} KiB: --kv-budget-mb / --edge-kv-budget-mb); shorten it")

    def _make_session_room(self, owner: str, seniority: int) -> None:
        if self.owner_sessions(owner) >= self.edge.max_sessions:  # the edge is at its quota: it pays itself
            if not self._evict(lambda _owner: 0.0, "edge session quota", only_owner=owner, admitting=seniority):
                raise exhausted(f"this edge has {self.edge.max_sessions} busy sessions, its quota (--edge-max-sessions); "
                                "close one or retry shortly", BUSY_RETRY_MS)
        if len(self._sessions) >= self.limits.max_sessions and not self._evict(self._session_share, "session limit",
                                                                               admitting=seniority):
            raise exhausted(f"all {self.limits.max_sessions} sessions are busy; retry shortly", BUSY_RETRY_MS)

    def _make_kv_room(self, needed: int, seniority: int) -> None:
        while self.kv_bytes + needed > self.limits.kv_budget_bytes:
            if not self._evict_cached() and not self._evict(self._kv_share, "KV budget", admitting=seniority):
                raise exhausted(f"the KV cache budget is held by sessions that are busy right now "
                                f"({self.kv_bytes >> 10} of {self.limits.kv_budget_bytes >> 10} KiB, "
                                f"{needed >> 10} KiB needed); retry shortly", BUSY_RETRY_MS)

    def _evict_cached(self) -> bool:
        """Drop the least recently used cached block no session holds: before any session is touched."""
        return self.prefix_cache is not None and self.prefix_cache.evict_one()

    def _kv_share(self, owner: str) -> float:
        return self.owner_kv_bytes(owner) / self.edge.kv_budget_bytes

    def _session_share(self, owner: str) -> float:
        return self.owner_sessions(owner) / self.edge.max_sessions

    def _evict(self, share: Callable[[str], float], reason: str, protect: Session | None = None,
               only_owner: str | None = None, admitting: int | None = None) -> bool:
        """Evict one idle session (fair share first, then the youngest request's, or without seniority the least
        recently used); to admit work of seniority `admitting`, only one idle for the grace period, and younger
        than it or idle for `evict_older_idle_s`."""
        now, limits = time.monotonic(), self.limits
        used_before = now - limits.evict_grace_s if admitting is not None else float("inf")
        older_used_before = now - limits.evict_older_idle_s if admitting is not None else float("inf")
        candidates = [s for s in self._sessions.values() if (only_owner is None or s.owner == only_owner)
                      and s.last_used <= used_before
                      and (admitting is None or s.seniority > admitting or s.last_used <= older_used_before)]
        if limits.evict_older_idle_s > 0:  # seniority on: the youngest request first (stable: LRU among equals)
            candidates.sort(key=lambda s: -s.seniority)
        victim = fair_share_victim(candidates, share, protect)
        if victim is None:
            return False
        log.info("evicting session %s of edge %s (%s)", victim.session_id, victim.owner, reason)
        self.close(victim.session_id, remember=False)  # evicted for room: caching it would take the room back
        self._evicted[victim.session_id] = (victim.owner, victim.seniority)  # its reopen keeps its turn
        while len(self._evicted) > EVICTED_KEPT:
            self._evicted.popitem(last=False)
        if self.on_evict:
            self.on_evict(victim)
        return True
