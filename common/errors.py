"""The root of every sprinter exception, and the errors both sides share.

`except SprinterError` catches whatever this project raises on purpose. Each class also keeps the builtin
base its callers catch (`ValueError`, `RuntimeError`, ...). A class lives in the module of its concept;
only one raised on several sides lives here. tests/test_layout.py checks that every exception class in
common/, edge/, cloud/ and sim/ reaches `SprinterError` and that no two share a name.

| class | raised by | what the caller does |
| --- | --- | --- |
| `PairMismatch` (ValueError) | common/models.py, common/companion.py, edge/runtime/verifier.py, edge/node.py | refuse the pairing: draft and target (or companion, or a verifier's training pair) differ |
| `DeviceError` (ValueError) | common/devices.py | a `--device` this machine lacks: exit 2 with the message |
| `MissingPresetError` (RuntimeError) | common/presets.py | a preset's package or file is missing or corrupt: install what the message says |
| `BadMessage` (ValueError) | common/fleet_plane/messages.py | a fleet-plane payload no reader can trust: drop it, answer "refused" |
| `CloudLinkError` | edge/cloud_link/client.py | the edge's link to the cloud failed; its subclasses say how: |
| `CloudUnavailable` | edge/cloud_link/ | out of reach after the retries: decode from the draft alone |
| `DeadlinePassed` (a CloudUnavailable) | edge/cloud_link/ | the request's own deadline passed: the rest from the draft |
| `CloudRefused` | edge/cloud_link/ | a refusal no retry fixes: end the generation, show the refusal |
| `RetryableFailure` | edge/cloud_link/session.py | one attempt failed (its `Cause`, edge/cloud_link/failures.py): the session retries; never escapes it |
| `DraftExportError` (RuntimeError) | edge/onnx_export/export.py | the draft cannot be exported to ONNX, or the export disagrees with torch |
| `CloudError` | cloud/ | a frame or call the cloud refuses: becomes the gRPC status / Error frame |
| `KVPoolExhausted` (RuntimeError) | cloud/kv_pool.py | the KV pool cannot hold a forward: it fails, nothing written |
| `KVBudgetExceeded` (AssertionError) | cloud/sessions.py | strict KV accounting found the budget broken: a bug |
"""

from __future__ import annotations


class SprinterError(Exception):
    """Whatever sprinter raises on purpose (see the module's table for the family)."""


class PairMismatch(SprinterError, ValueError):
    """Two things that must work together do not: a draft and a target (or a companion) with different
    vocabularies, a verifier trained for another pair, a cloud serving a target of another vocabulary."""
