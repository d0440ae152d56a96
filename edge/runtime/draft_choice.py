"""Which draft runtime, with which weights: the choices the command line offers, read without loading torch.

`--draft-runtime` picks the runtime (edge/runtime/draft.py builds it); `--draft-weights` picks the ONNX export's
weight format and nothing else. llama.cpp runs its GGUF's own quantisation, so a weight format given with it is
refused rather than approximated; torch runs the draft in `--dtype` and leaves `--draft-weights` unread.
"""

from __future__ import annotations

from common.errors import UsageError

RUNTIMES = ("onnx", "torch", "llama.cpp")
DEFAULT_RUNTIME = "onnx"
EDGE_WEIGHTS = "int8"  # the edge's ONNX weights when --draft-weights is not given (about 2x float32's speed on CPU)


class DraftWeightsNotApplicable(UsageError, ValueError):
    """A `--draft-weights` given with a runtime whose weights are not ours to choose (llama.cpp: the GGUF's own)."""


def runtime_weights(runtime: str, weights: str | None, onnx_default: str = EDGE_WEIGHTS) -> str | None:
    """The weight format `runtime` runs: `weights` as given, `onnx_default` for ONNX when none is; llama.cpp takes
    none (`DraftWeightsNotApplicable` when one is given)."""
    if runtime == "llama.cpp":
        if weights is not None:
            raise DraftWeightsNotApplicable(
                f"--draft-weights {weights} does not apply to --draft-runtime llama.cpp: it runs the draft's GGUF "
                "with the GGUF's own quantisation; leave --draft-weights out (or pick --draft-runtime onnx)")
        return None
    if runtime == "onnx":
        return weights or onnx_default
    return weights


def runtime_label(runtime: str, weights: str | None) -> str:
    """How a run names its draft's runtime (recorded beside hidden states, which depend on it): "onnx-int8",
    "torch", "llama.cpp"."""
    resolved = runtime_weights(runtime, weights)
    return f"{runtime}-{resolved}" if runtime == "onnx" else runtime
