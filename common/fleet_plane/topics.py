"""Topic names of the fleet plane, v1 (the contract is proto/mqtt.md)."""

from __future__ import annotations

import re

ROOT = "sprinter/v1"
_IDENTIFIER = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_identifier(value: str, what: str) -> str:
    """An edge id, replica id or group: no MQTT wildcard or separator can hide in it."""
    if not _IDENTIFIER.fullmatch(value):
        raise ValueError(f"{what} {value!r} must be 1-64 characters of letters, digits, '_', '.' or '-'")
    return value


def check_sha256(value: str) -> str:
    if not _SHA256.fullmatch(value):
        raise ValueError(f"sha256 {value!r} must be 64 lowercase hex digits")
    return value


def edge_state(edge_id: str) -> str:
    return f"{ROOT}/edges/{check_identifier(edge_id, 'edge id')}/state"


def edge_telemetry(edge_id: str) -> str:
    return f"{ROOT}/edges/{check_identifier(edge_id, 'edge id')}/telemetry"


def edge_applied(edge_id: str) -> str:
    return f"{ROOT}/edges/{check_identifier(edge_id, 'edge id')}/applied"


def cloud_load(replica_id: str) -> str:
    return f"{ROOT}/clouds/{check_identifier(replica_id, 'replica id')}/load"


def fleet_config(group: str) -> str:
    return f"{ROOT}/fleet/{check_identifier(group, 'group')}/config"


def verifier_artifact(sha256: str) -> str:
    return f"{ROOT}/artifacts/verifiers/{check_sha256(sha256)}"


# Filters for readers of many: the operator's status table and `fleet apply`.
ALL_EDGE_STATES = f"{ROOT}/edges/+/state"
ALL_EDGE_TELEMETRY = f"{ROOT}/edges/+/telemetry"
ALL_EDGE_APPLIED = f"{ROOT}/edges/+/applied"
ALL_CLOUD_LOADS = f"{ROOT}/clouds/+/load"


def level(topic: str, index: int) -> str:
    """One level of a topic, e.g. level('sprinter/v1/edges/e1/state', 3) == 'e1'."""
    return topic.split("/")[index]
