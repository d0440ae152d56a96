"""The fleet plane's messages (proto/mqtt.md): dataclasses, JSON on the wire, checked on the way in.

`encode(message)` writes the JSON with its `schema` field; `decode(payload, kind)` refuses, with a
`BadMessage` that says why, anything a reader cannot trust: over `MAX_PAYLOAD_BYTES`, not JSON, not
an object, another schema or version, a missing field, a field of the wrong type. Extra fields are
ignored (a newer writer within the same version). `FleetConfig.check()` and
`VerifierArtifact.onnx_bytes()` add what a type cannot say.
"""

from __future__ import annotations

import base64
import hashlib
import json
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any, ClassVar, TypeVar

from common.addresses import split_host_port
from common.spec.call_policy import parse_policy
from common.spec.modes import MODES, PIPELINES
from common.errors import SprinterError
from common.fleet_plane.topics import check_identifier, check_sha256
from common.prefix_digests import DIGEST_HEX, MAX_ANNOUNCED_PREFIXES

MAX_PAYLOAD_BYTES = 1 << 20
STATUSES = ("online", "offline", "draining")
MAX_BLOCK_K = 32


class BadMessage(SprinterError, ValueError):
    """A payload the reader ignores; the message says what was wrong with it, `reason` which kind of wrong."""

    def __init__(self, message: str, reason: str = "fields") -> None:
        super().__init__(message)
        self.reason = reason  # oversized | not-json | not-object | schema | fields (missing, mistyped, bad value)


@dataclass(frozen=True)
class EdgeState:
    SCHEMA: ClassVar[str] = "sprinter.edge.state/1"
    status: str
    edge_id: str
    group: str
    draft: str
    target: str | None
    verifier: dict
    mode: str
    policy: str | None
    version: str
    api: str
    config_version: int
    time: float


@dataclass(frozen=True)
class EdgeTelemetry:
    SCHEMA: ClassVar[str] = "sprinter.edge.telemetry/1"
    edge_id: str
    time: float
    interval_s: float
    tokens_per_s: float
    target_calls_per_token: float
    tokens_per_call: float | None
    active_requests: int
    requests: int
    degraded_requests: int
    cost_model: dict
    cloud: str | None
    dropped_telemetry: int


@dataclass(frozen=True)
class CloudLoad:
    SCHEMA: ClassVar[str] = "sprinter.cloud.load/1"
    replica_id: str
    status: str
    model_id: str
    vocab_fingerprint: str
    endpoint: str
    open_sessions: int
    queue_depth: int
    batch_size_mean: float
    verify_ms_p50: float | None
    kv_bytes_used: int
    kv_bytes_budget: int
    time: float
    # Digests of prompt prefixes this replica caches (common/prefix_digests.py), most recently used first, at most
    # MAX_ANNOUNCED_PREFIXES: never tokens. Absent from older replicas: none.
    prefixes: list = field(default_factory=list)

    def check_prefixes(self) -> None:
        if len(self.prefixes) > MAX_ANNOUNCED_PREFIXES:
            raise BadMessage(f"{self.SCHEMA}: {len(self.prefixes)} prefixes, over the {MAX_ANNOUNCED_PREFIXES} allowed")
        if not all(isinstance(p, str) and len(p) == DIGEST_HEX and _is_hex(p) for p in self.prefixes):
            raise BadMessage(f"{self.SCHEMA}: a prefix is not a digest of {DIGEST_HEX} hex characters")


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True)
class FleetConfig:
    """Desired state of a group of edges, one document per group; fields left None keep each edge's own setting.

    Each apply merges its changes into the group's document (`merged`), so an edge that joins later
    gets everything applied so far, not only the last change.
    """

    SCHEMA: ClassVar[str] = "sprinter.fleet.config/1"
    group: str
    version: int
    mode: str | None = None
    policy: str | None = None
    k: int | None = None
    verifier: dict | None = None
    clouds: list | None = None
    pipeline: str | None = None

    DESIRED: ClassVar[tuple[str, ...]] = ("mode", "policy", "k", "verifier", "clouds", "pipeline")

    def merged(self, changes: dict[str, Any], version: int | None = None) -> FleetConfig:
        """This document with `changes` applied (a None value clears a field: edges go back to their own), as
        `version` (default: the next one). Raises ValueError naming a field that is not part of it."""
        unknown = sorted(set(changes) - set(self.DESIRED))
        if unknown:
            raise ValueError(f"unknown config field(s) {', '.join(unknown)}; a config sets any of "
                             f"{', '.join(self.DESIRED)} (and version)")
        return replace(self, **changes, version=self.version + 1 if version is None else version)

    def check(self) -> None:
        """Raise ValueError naming the first field an edge must refuse."""
        check_identifier(self.group, "group")
        if self.version < 1:
            raise ValueError(f"version must be a positive integer, got {self.version}")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.policy is not None:
            parse_policy(self.policy)
        if self.pipeline is not None and self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline {self.pipeline!r} is not one of {', '.join(PIPELINES)}")
        if self.k is not None and not 1 <= self.k <= MAX_BLOCK_K:
            raise ValueError(f"k must be in [1, {MAX_BLOCK_K}], got {self.k}")
        if self.verifier is not None:
            if set(self.verifier) != {"id", "sha256"} or not isinstance(self.verifier["id"], str):
                raise ValueError("verifier must be {\"id\": NAME, \"sha256\": HEX}")
            check_sha256(str(self.verifier["sha256"]))
        if self.clouds is not None:
            for endpoint in self.clouds:
                split_host_port(str(endpoint))  # ValueError naming the endpoint


@dataclass(frozen=True)
class ConfigApplied:
    SCHEMA: ClassVar[str] = "sprinter.edge.applied/1"
    edge_id: str
    group: str
    version: int
    ok: bool
    reason: str | None
    time: float


def verifier_digest(onnx: bytes, metadata: dict) -> str:
    """A verifier's name on the fleet plane: sha256 of its ONNX bytes, a NUL byte and its metadata as canonical
    JSON (sorted keys, no spaces). Both halves decide what the verifier does (a new threshold is a new verifier)."""
    canonical = json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(onnx + b"\0" + canonical).hexdigest()


@dataclass(frozen=True)
class VerifierArtifact:
    SCHEMA: ClassVar[str] = "sprinter.verifier.artifact/1"
    sha256: str  # verifier_digest(onnx, metadata)
    metadata: dict
    onnx_base64: str = field(repr=False)

    @classmethod
    def from_onnx(cls, onnx: bytes, metadata: dict) -> VerifierArtifact:
        return cls(verifier_digest(onnx, metadata), metadata, base64.b64encode(onnx).decode("ascii"))

    def onnx_bytes(self) -> bytes:
        """The ONNX model, checked (with the metadata) against the digest it was published under."""
        try:
            onnx = base64.b64decode(self.onnx_base64, validate=True)
        except ValueError as err:
            raise BadMessage(f"verifier artifact: onnx_base64 is not base64 ({err})") from err
        digest = verifier_digest(onnx, self.metadata)
        if digest != self.sha256:
            raise BadMessage(f"verifier artifact: the ONNX bytes and metadata hash to {digest[:12]}..., "
                             f"not {self.sha256[:12]}...", "digest")
        return onnx


Message = EdgeState | EdgeTelemetry | CloudLoad | FleetConfig | ConfigApplied | VerifierArtifact
M = TypeVar("M", EdgeState, EdgeTelemetry, CloudLoad, FleetConfig, ConfigApplied, VerifierArtifact)


def encode(message: Message) -> bytes:
    return json.dumps({"schema": message.SCHEMA, **asdict(message)}, separators=(",", ":")).encode()


def decode(payload: bytes | bytearray | str, kind: type[M]) -> M:
    """The message of type `kind` in `payload`, or BadMessage."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise BadMessage(f"{kind.SCHEMA}: payload of {len(payload)} bytes is over the {MAX_PAYLOAD_BYTES} byte limit",
                         "oversized")
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:  # RecursionError: nested too deep
        raise BadMessage(f"{kind.SCHEMA}: not JSON ({type(err).__name__}: {err})", "not-json") from err
    if not isinstance(data, dict):
        raise BadMessage(f"{kind.SCHEMA}: the payload must be a JSON object", "not-object")
    if data.get("schema") != kind.SCHEMA:
        raise BadMessage(f"expected schema {kind.SCHEMA!r}, got {data.get('schema')!r}", "schema")
    hints = typing.get_type_hints(kind)
    values: dict[str, Any] = {}
    for spec in fields(kind):
        if spec.name not in data:
            if spec.default is MISSING and spec.default_factory is MISSING:
                raise BadMessage(f"{kind.SCHEMA}: field {spec.name!r} is missing")
            continue
        value = data[spec.name]
        if not _has_type(value, hints[spec.name]):
            raise BadMessage(f"{kind.SCHEMA}: field {spec.name!r} has the wrong type ({type(value).__name__})")
        values[spec.name] = value
    message = kind(**values)
    if isinstance(message, (EdgeState, CloudLoad)) and message.status not in STATUSES:
        raise BadMessage(f"{kind.SCHEMA}: status {message.status!r} is not one of {', '.join(STATUSES)}")
    if isinstance(message, CloudLoad):
        message.check_prefixes()
    return message


def _has_type(value: object, annotation: object) -> bool:
    """JSON-level type check: int is not bool, a float field takes an int, `X | None` takes null."""
    if isinstance(annotation, types.UnionType):
        return any(_has_type(value, option) for option in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)  # str, bool, dict, list
