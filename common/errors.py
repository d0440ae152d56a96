"""The root of every sprinter exception, and the errors both sides share.

`except SprinterError` catches whatever this project raises on purpose. Each class also keeps the builtin
base its callers catch (`ValueError`, `RuntimeError`, ...). A class lives in the module of its concept;
only one raised on several sides lives here. tests/house/test_layout.py checks that every exception class in
common/, edge/, cloud/ and sim/ reaches `SprinterError` and that no two share a name.

The family, by side (class, builtin base kept, where raised: what the caller does):

- `PairMismatch` (ValueError), here; raised by common/model/loading.py, common/spec/companion.py,
  edge/runtime/verifier.py, edge/node.py: draft and target (or a companion, or a verifier's training
  pair, or the cloud's target) do not go together. Refuse the pairing; the message says what to pair.
- `UsageError`, here: a value from the command line this project cannot act on. `sprinter` prints its
  message as one line and exits 2, as argparse does. `UnknownModel` (OSError), common/model/loading.py: a model
  spec that is no preset, no directory, and no Hugging Face id that loads from here. `LlamaCppUnavailable`
  (RuntimeError), common/model/llama_cpp_runtime.py: llama.cpp asked for (either side) without llama-cpp-python.
  `DraftWeightsNotApplicable` (ValueError), edge/runtime/draft_choice.py: `--draft-weights` with a draft runtime
  that runs its own (llama.cpp).
- `DeviceError` (ValueError), common/model/devices.py: a `--device` this machine lacks. Exit 2 with the message.
- `MissingPresetError` (RuntimeError), common/model/presets.py: a preset's package or file is missing or
  corrupt. Install what the message says.
- `BadMessage` (ValueError), common/fleet_plane/messages.py: a fleet-plane payload no reader can
  trust. Drop it; a fleet config that carries one is refused.
- `CloudLinkError`, edge/cloud_link/client.py: the edge's link to the cloud failed, with the gRPC status.
  Its subclasses say what to do: `CloudUnavailable` (out of reach after the retries: decode from the
  draft alone), `DeadlinePassed` (a CloudUnavailable: the request's own deadline passed), `CloudRefused`
  (no retry fixes it: end the generation, show the refusal).
- `RetryableFailure`, edge/cloud_link/failures.py: one attempt of a cloud session failed, for a `Cause`
  whose action the table there gives. The session retries; it never leaves the session.
- `DraftExportError` (RuntimeError), edge/onnx_export/export.py: the draft cannot be exported to ONNX,
  or the export disagrees with torch. The draft cannot run on ONNX Runtime; the message says why.
- `CloudError`, cloud/errors.py: a frame or call the cloud refuses. It becomes the call's gRPC status
  or the stream's Error frame; the stream and every other session stay usable.
- `KVPoolExhausted` (RuntimeError), cloud/kv_pool.py: the KV pool cannot hold a forward. The forward
  fails, nothing written.
- `KVBudgetExceeded` (AssertionError), cloud/sessions.py: strict KV accounting found the budget broken.
  A bug: tests and strict runs raise it.
"""

from __future__ import annotations


class SprinterError(Exception):
    """Whatever sprinter raises on purpose (the module's docstring lists the family)."""


class PairMismatch(SprinterError, ValueError):
    """Two things that must work together do not: a draft and a target (or a companion) with different
    vocabularies, a verifier trained for another pair, a cloud serving a target of another vocabulary."""


class UsageError(SprinterError):
    """A value the user gave that cannot work (a model that does not exist, ...): one line, exit code 2."""
