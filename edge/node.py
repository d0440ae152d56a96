"""An edge node: the draft runtime, the verifier and the cloud connection, set up once per process."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from common.model.cached_lm import DraftLM
from common.spec.companion import Companion, companion_for
from common.errors import PairMismatch
from common.model.loading import DTYPES, LoadedModel, load_model, vocab_fingerprint
from common.spec.verifier import Verifier
from edge.cloud_link.client import CloudEndpoint
from common.spec.propose.suffix_proposer import suffix_memory
from edge.decoding.decoder import EdgeDecoder
from edge.decoding.placer import Placer
from edge.runtime.draft import draft_lm_factory
from edge.runtime.draft_choice import DEFAULT_RUNTIME, runtime_weights
from edge.runtime.draft_reuse import DraftKVCache
from edge.cloud_link.replicas import ReplicaSet
from edge.runtime.verifier import (LearnedVerifier, TemperatureMatched, load_verifier, shipped_suffix_priors,
                                   verifier_identity)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EdgeNodeSettings:
    draft: str = "tiny-random-draft"
    verifier: str = "auto"
    cloud: str | None = None  # HOST:PORT[,HOST:PORT...]: the cloud's replicas (a name may resolve to several)
    # --mqtt without --cloud: verify on the replicas the fleet plane announces. With --cloud the edge keeps to
    # the addresses it was given (they may be a proxy, a tunnel or a NAT that an announced address bypasses).
    discover_clouds: bool = False
    cloud_ca: Path | None = None
    cloud_token: str | None = None
    cloud_tls_server_name: str | None = None  # the name to check the cloud's certificate against, if not the host's
    insecure: bool = False  # allow a bearer token over plaintext (a test rig, a tunnel): it travels in clear
    cloud_deadline_s: float = 30.0  # per verify round trip and per Generate chunk
    max_model_len: int | None = None  # cap on prompt + completion tokens, below the draft's and the cloud's own
    draft_runtime: str = DEFAULT_RUNTIME  # "onnx", "llama.cpp" (the GGUF as shipped) or "torch" (the reference)
    # ONNX's weight format; None: int8 MatMul weights (EDGE_WEIGHTS: about 2x faster on CPU; verification keeps
    # lossless modes exact). llama.cpp runs its GGUF's own quantisation and refuses one.
    draft_weights: str | None = None
    threads: int | None = None
    dtype: str = "bfloat16"  # of the torch runtime; ONNX runs float32
    uplink_mbps: float = 0.0  # the uplink's bandwidth, for placement auto (edge/decoding/placer.py); 0: unlimited
    companion: str | None = None  # Speculative Verification's companion (torch, dtype above), for verifiers that read it
    suffix_cache: bool = True  # suffix drafting may copy from this edge's earlier outputs (--suffix-cache)
    # The draft's prompt KV kept across requests (0: off). Off unless asked: `edge serve` asks for
    # edge serve's DEFAULT_DRAFT_CACHE_MB; a bench that repeats one prompt would otherwise time the cache, not the prefill.
    draft_cache_mb: int = 0

    def __post_init__(self) -> None:
        runtime_weights(self.draft_runtime, self.draft_weights)  # a weight format llama.cpp cannot take: refused now
        if self.uplink_mbps < 0:
            raise ValueError(f"--uplink-mbps must be >= 0 (0: unlimited), got {self.uplink_mbps:g}")
        if self.cloud_token and self.cloud and not self.cloud_ca and not self.insecure:
            raise ValueError("a cloud token without TLS would travel in clear: give --cloud-ca (TLS), or --insecure "
                             "if the link is already private (a loopback test, a tunnel)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EdgeNodeSettings":
        return cls(draft=args.draft, verifier=args.verifier, cloud=args.cloud, cloud_ca=args.cloud_ca,
                   cloud_token=args.cloud_token or os.environ.get("SPRINTER_CLOUD_TOKEN"),
                   cloud_tls_server_name=args.cloud_tls_server_name, insecure=args.insecure,
                   draft_runtime=args.draft_runtime, draft_weights=args.draft_weights, threads=args.threads,
                   dtype=args.dtype, companion=args.companion, cloud_deadline_s=args.cloud_deadline_s,
                   max_model_len=getattr(args, "max_model_len", None), uplink_mbps=getattr(args, "uplink_mbps", 0.0),
                   discover_clouds=bool(getattr(args, "mqtt", None)) and not args.cloud,
                   suffix_cache=getattr(args, "suffix_cache", "on") == "on",
                   draft_cache_mb=getattr(args, "draft_cache_mb", 0))


@dataclass(frozen=True)
class VerifierSetup:
    """A verifier and what decoding needs beside it, made ready before it is put in force."""

    verifier: Verifier
    make_companion: Callable[[], Companion] | None
    identity: dict  # {"id", "sha256"}: how the fleet plane names it


class EdgeNode:
    """`async with EdgeNode(settings) as node:` then `node.decoder.generate(...)` per request."""

    def __init__(self, settings: EdgeNodeSettings, draft: LoadedModel | None = None) -> None:
        self.settings = settings
        self.draft = draft or load_model(settings.draft, DTYPES[settings.dtype])
        self.cloud: ReplicaSet | None = None
        self.target_id: str | None = None
        self.decoder: EdgeDecoder | None = None
        self._new_draft_lm: Callable[[bool], DraftLM] | None = None
        self.draft_cache = DraftKVCache(settings.draft_cache_mb << 20) if settings.draft_cache_mb else None
        # Every ReplicaSet this node opened: the one in force, and those a fleet config replaced (sessions in
        # flight may still use them). All close when the node stops, the one in force first.
        self._clouds = contextlib.AsyncExitStack()

    async def __aenter__(self) -> "EdgeNode":
        try:
            if self.settings.cloud or self.settings.discover_clouds:
                self.cloud = await self._clouds.enter_async_context(
                    self._replica_set((self.settings.cloud or "").split(",")))
                await self.check_cloud()
            self._new_draft_lm = draft_lm_factory(
                self.draft, self.settings.draft_runtime, self.settings.threads,
                runtime_weights(self.settings.draft_runtime, self.settings.draft_weights), self.draft_cache)
            setup = self.prepare_verifier(self.settings.verifier)
        except BaseException:
            await self._clouds.aclose()
            raise
        self.decoder = EdgeDecoder(self.draft, self._new_draft_lm, setup.verifier, self.cloud,
                                   make_companion=setup.make_companion, max_context=self.settings.max_model_len,
                                   placer=Placer(uplink_mbps=self.settings.uplink_mbps),
                                   suffix_memory=suffix_memory(self.settings.suffix_cache, priors=shipped_suffix_priors(
                                       self.settings.draft, self.target_id)))
        self.decoder.verifier_identity = setup.identity
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._clouds.aclose()

    @property
    def verifier_identity(self) -> dict | None:
        return self.decoder.verifier_identity if self.decoder is not None else None

    @property
    def cloud_address(self) -> str | None:
        return self.cloud.address if self.cloud is not None else None

    def _endpoint(self, address: str, server_name: str | None = None) -> CloudEndpoint:
        return CloudEndpoint(address, tls_ca=self.settings.cloud_ca,
                             tls_server_name=self.settings.cloud_tls_server_name or server_name,
                             token=self.settings.cloud_token, deadline_s=self.settings.cloud_deadline_s)

    def _replica_set(self, entries: Sequence[str]) -> ReplicaSet:
        return ReplicaSet(entries, self._endpoint, vocab_fingerprint(self.draft.tokenizer),
                          adopt_announced=self.settings.discover_clouds)

    def prepare_verifier(self, spec: str) -> VerifierSetup:
        """Load and check a verifier (`--verifier` syntax) for this node's pair; ValueError if it does not fit.

        Slow (ONNX session, maybe a companion model): call it off the event loop once the node serves.
        """
        verifier = load_verifier(spec, self.draft.tokenizer, self.settings.draft, self.target_id,
                                 self.settings.companion)
        # The companion runs on torch beside the draft: a forward per drafted token (see common/spec/companion.py).
        make_companion = companion_for(verifier, self.settings.companion, self.draft, DTYPES[self.settings.dtype],
                                       (self.draft,))
        return VerifierSetup(verifier, make_companion,
                             verifier_identity(verifier))

    def use_verifier(self, setup: VerifierSetup) -> None:
        """Put a prepared verifier in force for the next generations (running ones keep theirs)."""
        self.decoder.use_verifier(setup.verifier, setup.make_companion, setup.identity)

    async def use_clouds(self, addresses: Sequence[str]) -> None:
        """Verify on these replicas from now on; ValueError if none of them answers with this draft's vocabulary.

        Generations in flight finish on the replicas they started with (closed when the node stops).
        """
        if self.cloud is not None and sorted(self.cloud.entries) == sorted(addresses):
            return
        async with contextlib.AsyncExitStack() as candidate:  # closes the replicas again if they are refused
            replicas = await candidate.enter_async_context(self._replica_set(addresses))  # probes them all
            if not replicas.available():
                reasons = [f"{r['address']}: {r['refused'] or 'unreachable'}" for r in replicas.describe()]
                raise ValueError(f"no cloud of {', '.join(addresses)} can verify for this edge ({'; '.join(reasons)})")
            model_id = next(r.model_id for r in replicas.replicas.values() if r.model_id)
            if isinstance(self.decoder.verifier, (LearnedVerifier, TemperatureMatched)):  # trained for one target
                self.decoder.verifier.check_pair(self.draft.tokenizer, self.settings.draft, model_id)
            await self._clouds.enter_async_context(candidate.pop_all())  # accepted: open until the node stops
        self.cloud, self.decoder.cloud, self.target_id = replicas, replicas, model_id
        log.info("verifying on %s (%s) from now on", replicas.address, model_id)

    async def check_cloud(self, timeout_s: float | None = None) -> bool:
        """Refuse a cloud with another vocabulary; a cloud that is down only degrades us. True if reachable.

        Each replica is checked once it answers (GetInfo, which also brings its limits); one with
        another vocabulary is never used, and when every replica named is such a one, the edge refuses to start.
        """
        await self.cloud.probe_all(everything=True, timeout_s=timeout_s)
        replicas = self.cloud.describe()
        if replicas and all(r["refused"] for r in replicas):
            raise PairMismatch(f"cloud {self.settings.cloud}: every replica {replicas[0]['refused']}: pair the "
                                f"draft {self.settings.draft} with a target that shares its tokenizer")
        if not self.cloud.available():
            log.warning("cloud %s is not reachable yet; decoding degrades to the draft until it is",
                        self.settings.cloud or "(from the fleet plane)")
            return False
        self.target_id = next(r["model"] for r in replicas if r["usable"])
        return True
