"""Sessions: each edge generation keeps its context and its target KV cache on the cloud.

The store bounds memory two ways: a KV budget with least-recently-used eviction, and an idle
timeout. An evicted session simply disappears; the edge's next frame gets NOT_FOUND and it reopens
with its full context, so eviction costs a prefill, never correctness.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import grpc
import torch
from transformers import DynamicCache

from cloud.errors import CloudError
from common.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Session:
    session_id: str
    owner: str  # the authenticated edge identity; nobody else may touch this session
    tokens: list[int]  # the context: prompt, then every verified token
    cache: DynamicCache  # holds the KV of tokens[:cached_tokens]
    sampling: SamplingParams
    generator: torch.Generator
    cached_tokens: int = 0
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False  # a verify is in flight: never evicted under it

    @property
    def length(self) -> int:
        return len(self.tokens)

    def touch(self) -> None:
        self.last_used = time.monotonic()


@dataclass
class SessionLimits:
    max_sessions: int = 64
    kv_budget_bytes: int = 2 << 30
    idle_timeout_s: float = 300.0


class SessionStore:
    def __init__(self, limits: SessionLimits, kv_bytes_per_token: int,
                 on_evict: Callable[[Session], None] | None = None) -> None:
        self.limits = limits
        self.kv_bytes_per_token = kv_bytes_per_token
        self.on_evict = on_evict
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def kv_bytes(self) -> int:
        return sum(s.cached_tokens for s in self._sessions.values()) * self.kv_bytes_per_token

    def create(self, owner: str, prompt_ids: list[int], sampling: SamplingParams, cache: DynamicCache) -> Session:
        if len(self._sessions) >= self.limits.max_sessions:
            self._evict_idlest(reason="session limit")
        if len(self._sessions) >= self.limits.max_sessions:
            raise CloudError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"all {self.limits.max_sessions} sessions are busy; retry later")
        session = Session(
            session_id=secrets.token_hex(12), owner=owner, tokens=list(prompt_ids), cache=cache, sampling=sampling,
            generator=torch.Generator().manual_seed(sampling.seed),
        )
        self._sessions[session.session_id] = session
        return session

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

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def enforce_budget(self) -> None:
        """Evict least-recently-used idle sessions until the KV cache fits the budget."""
        while self.kv_bytes > self.limits.kv_budget_bytes and self._evict_idlest(reason="KV budget"):
            pass

    def expire_idle(self) -> int:
        now = time.monotonic()
        stale = [s.session_id for s in self._sessions.values()
                 if not s.busy and now - s.last_used > self.limits.idle_timeout_s]
        for session_id in stale:
            log.info("session %s idle for over %.0f s: closed", session_id, self.limits.idle_timeout_s)
            self.close(session_id)
        return len(stale)

    def _evict_idlest(self, reason: str) -> bool:
        for session in self._sessions.values():  # oldest use first
            if not session.busy:
                log.info("evicting session %s (%s)", session.session_id, reason)
                self.close(session.session_id)
                if self.on_evict:
                    self.on_evict(session)
                return True
        return False
