"""An edge node: the draft runtime, the verifier and the cloud connection, set up once per process."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

from common.cached_lm import DraftLM
from common.companion import Companion, companion_for
from common.models import DTYPES, LoadedModel, load_model, vocab_fingerprint
from common.verifier import Verifier
from edge.cloud_client import CloudClient, CloudEndpoint, CloudUnavailable
from edge.decoder import EdgeDecoder
from edge.draft_runtime import draft_lm_factory
from edge.verifier_runtime import LearnedVerifier, load_verifier, verifier_identity

log = logging.getLogger(__name__)


class CloudMismatch(RuntimeError):
    """The cloud serves a target whose vocabulary differs from the draft's."""


@dataclass(frozen=True)
class EdgeNodeSettings:
    draft: str = "tiny-random-draft"
    verifier: str = "auto"
    cloud: str | None = None
    cloud_ca: Path | None = None
    cloud_token: str | None = None
    cloud_tls_server_name: str | None = None  # the name to check the cloud's certificate against, if not the host's
    insecure: bool = False  # allow a bearer token over plaintext (a test rig, a tunnel): it travels in clear
    cloud_deadline_s: float = 30.0  # per verify round trip and per Generate chunk
    max_model_len: int | None = None  # cap on prompt + completion tokens, below the draft's and the cloud's own
    draft_runtime: str = "onnx"  # or "torch": the reference and fallback
    draft_weights: str = "int8"  # ONNX: int8 MatMul weights (about 2x faster on CPU; verification keeps lossless modes exact)
    threads: int | None = None
    dtype: str = "bfloat16"  # of the torch runtime; ONNX runs float32
    companion: str | None = None  # Speculative Verification's companion (torch, dtype above), for verifiers that read it

    def __post_init__(self) -> None:
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
                   max_model_len=getattr(args, "max_model_len", None))


@dataclass(frozen=True)
class VerifierSetup:
    """A verifier and what decoding needs beside it, made ready before it is put in force."""

    verifier: Verifier
    make_draft_lm: Callable[[], DraftLM]  # a draft runtime that returns hidden states if the verifier reads them
    make_companion: Callable[[], Companion] | None
    identity: dict  # {"id", "sha256"}: how the fleet plane names it


class EdgeNode:
    """`async with EdgeNode(settings) as node:` then `node.decoder.generate(...)` per request."""

    def __init__(self, settings: EdgeNodeSettings, draft: LoadedModel | None = None) -> None:
        self.settings = settings
        self.draft = draft or load_model(settings.draft, DTYPES[settings.dtype])
        self.cloud: CloudClient | None = None
        self.target_id: str | None = None
        self.decoder: EdgeDecoder | None = None
        self._new_draft_lm: Callable[[bool], DraftLM] | None = None
        self._retired_clouds: list[CloudClient] = []  # replaced by a fleet config; in-flight sessions may still use them

    async def __aenter__(self) -> "EdgeNode":
        if self.settings.cloud:
            self.cloud = await CloudClient(self._endpoint(self.settings.cloud)).__aenter__()
            await self.check_cloud()
        self._new_draft_lm = draft_lm_factory(self.draft, self.settings.draft_runtime, self.settings.threads,
                                              self.settings.draft_weights)
        setup = self.prepare_verifier(self.settings.verifier)
        self.decoder = EdgeDecoder(self.draft, setup.make_draft_lm, setup.verifier, self.cloud,
                                   make_companion=setup.make_companion, max_context=self.settings.max_model_len)
        self.decoder.verifier_identity = setup.identity
        return self

    async def __aexit__(self, *exc: object) -> None:
        for client in (self.cloud, *self._retired_clouds):
            if client is not None:
                await client.__aexit__(*exc)

    @property
    def verifier_identity(self) -> dict | None:
        return self.decoder.verifier_identity if self.decoder is not None else None

    @property
    def cloud_address(self) -> str | None:
        return self.cloud.endpoint.address if self.cloud is not None else None

    def _endpoint(self, address: str) -> CloudEndpoint:
        return CloudEndpoint(address, tls_ca=self.settings.cloud_ca, tls_server_name=self.settings.cloud_tls_server_name,
                             token=self.settings.cloud_token, deadline_s=self.settings.cloud_deadline_s)

    def prepare_verifier(self, spec: str) -> VerifierSetup:
        """Load and check a verifier (`--verifier` syntax) for this node's pair; ValueError if it does not fit.

        Slow (ONNX session, maybe a companion model): call it off the event loop once the node serves.
        """
        verifier = load_verifier(spec, self.draft.tokenizer, self.settings.draft, self.target_id,
                                 self.settings.companion)
        # The companion runs on torch beside the draft: a forward per drafted token (see common/companion.py).
        make_companion = companion_for(verifier, self.settings.companion, self.draft, DTYPES[self.settings.dtype],
                                       (self.draft,))
        return VerifierSetup(verifier, partial(self._new_draft_lm, verifier.needs_hidden), make_companion,
                             verifier_identity(verifier))

    def use_verifier(self, setup: VerifierSetup) -> None:
        """Put a prepared verifier in force for the next generations (running ones keep theirs)."""
        self.decoder.use_verifier(setup.verifier, setup.make_draft_lm, setup.make_companion, setup.identity)

    async def use_clouds(self, addresses: Sequence[str]) -> None:
        """Verify on the first of `addresses` that answers with this draft's vocabulary; ValueError if none does.

        Generations in flight finish on the cloud they started with (its channel closes when the node stops).
        """
        if self.cloud_address in addresses:
            return
        unreachable = []
        for address in addresses:
            client = await CloudClient(self._endpoint(address)).__aenter__()
            try:
                info = await client.info()
            except CloudUnavailable as err:
                unreachable.append(f"{address} ({err.code.name})")
                await client.__aexit__(None, None, None)
                continue
            try:
                if info.vocab_fingerprint != vocab_fingerprint(self.draft.tokenizer):
                    raise ValueError(f"cloud {address} serves {info.model_id}, whose vocabulary differs from the draft's")
                if isinstance(self.decoder.verifier, LearnedVerifier):  # trained for one target: not for another
                    self.decoder.verifier.check_pair(self.draft.tokenizer, self.settings.draft, info.model_id)
            except ValueError:
                await client.__aexit__(None, None, None)
                raise
            if self.cloud is not None:
                self._retired_clouds.append(self.cloud)
            self.cloud, self.decoder.cloud, self.target_id = client, client, info.model_id
            log.info("verifying on cloud %s (%s) from now on", address, info.model_id)
            return
        raise ValueError(f"no cloud of {', '.join(addresses)} is reachable: {'; '.join(unreachable)}")

    async def check_cloud(self) -> bool:
        """Refuse a cloud with another vocabulary; a cloud that is down only degrades us. True if reachable.

        Reading ServiceInfo also refreshes the cloud's limits, which the decoder shapes its frames to.
        """
        try:
            info = await self.cloud.info()
        except CloudUnavailable as err:
            log.warning("cloud %s is not reachable yet (%s); decoding degrades to the draft until it is",
                        self.cloud_address, err)
            return False
        if info.vocab_fingerprint != vocab_fingerprint(self.draft.tokenizer):
            raise CloudMismatch(f"cloud {self.cloud_address} serves {info.model_id}, whose vocabulary differs from "
                                f"draft {self.settings.draft}'s: pair the draft with a target that shares its tokenizer")
        self.target_id = info.model_id
        return True
