"""An edge node: the draft runtime, the verifier and the cloud connection, set up once per process."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from common.companion import companion_for
from common.models import DTYPES, LoadedModel, load_model, vocab_fingerprint
from edge.cloud_client import CloudClient, CloudEndpoint, CloudUnavailable
from edge.decoder import EdgeDecoder
from edge.draft_runtime import draft_lm_factory
from edge.verifier_runtime import load_verifier

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


class EdgeNode:
    """`async with EdgeNode(settings) as node:` then `node.decoder.generate(...)` per request."""

    def __init__(self, settings: EdgeNodeSettings, draft: LoadedModel | None = None) -> None:
        self.settings = settings
        self.draft = draft or load_model(settings.draft, DTYPES[settings.dtype])
        self.cloud: CloudClient | None = None
        self.target_id: str | None = None
        self.decoder: EdgeDecoder | None = None

    async def __aenter__(self) -> "EdgeNode":
        if self.settings.cloud:
            endpoint = CloudEndpoint(self.settings.cloud, tls_ca=self.settings.cloud_ca,
                                     tls_server_name=self.settings.cloud_tls_server_name, token=self.settings.cloud_token,
                                     deadline_s=self.settings.cloud_deadline_s)
            self.cloud = await CloudClient(endpoint).__aenter__()
            await self.check_cloud()
        verifier = load_verifier(self.settings.verifier, self.draft.tokenizer, self.settings.draft, self.target_id,
                                 self.settings.companion)
        # The companion runs on torch beside the draft: a forward per drafted token (see common/companion.py).
        make_companion = companion_for(verifier, self.settings.companion, self.draft, DTYPES[self.settings.dtype],
                                       (self.draft,))
        new_draft_lm = draft_lm_factory(self.draft, self.settings.draft_runtime, self.settings.threads,
                                        self.settings.draft_weights)
        self.decoder = EdgeDecoder(self.draft, partial(new_draft_lm, verifier.needs_hidden), verifier, self.cloud,
                                   make_companion=make_companion, max_context=self.settings.max_model_len)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.cloud is not None:
            await self.cloud.__aexit__(*exc)

    async def check_cloud(self) -> bool:
        """Refuse a cloud with another vocabulary; a cloud that is down only degrades us. True if reachable.

        Reading ServiceInfo also refreshes the cloud's limits, which the decoder shapes its frames to.
        """
        try:
            info = await self.cloud.info()
        except CloudUnavailable as err:
            log.warning("cloud %s is not reachable yet (%s); decoding degrades to the draft until it is",
                        self.settings.cloud, err)
            return False
        if info.vocab_fingerprint != vocab_fingerprint(self.draft.tokenizer):
            raise CloudMismatch(f"cloud {self.settings.cloud} serves {info.model_id}, whose vocabulary differs from "
                                f"draft {self.settings.draft}'s: pair the draft with a target that shares its tokenizer")
        self.target_id = info.model_id
        return True
