"""The SPRINTER verifier interface: judge each drafted token before anyone pays for the target.

A verifier sees what the draft computed anyway (its logits and last hidden state at the position
that produced the token) and returns a score, the predicted probability that the target accepts
the token (and, when a companion model runs beside the draft, its overlap signals: common/companion.py).
Tokens scoring below the threshold are flagged. The learned verifier (ONNX, on the edge)
implements the same protocol; `ConfidenceVerifier` is the baseline that needs no training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class DraftStep:
    token: int
    logits: torch.Tensor  # [V] the draft's raw logits (before temperature and truncation)
    hidden: torch.Tensor | None  # [H] the draft's last hidden state at this position
    companion: tuple[float, float] | None = None  # (S, A) of common/companion.py, when a companion runs


class Verifier(Protocol):
    threshold: float
    needs_hidden: bool

    def score(self, step: DraftStep) -> float:
        """Predicted probability that the target accepts `step.token`."""
        ...


def needs_companion(verifier: Verifier) -> bool:
    """True when the verifier reads companion features; `needs_companion` is optional on a verifier (False)."""
    return bool(getattr(verifier, "needs_companion", False))


def draft_confidence_features(step: DraftStep) -> tuple[float, float, float]:
    """(probability of the token, max probability, entropy) under the draft's softmax at T=1."""
    p = torch.softmax(step.logits.float(), dim=-1)
    entropy = -(p * torch.log(p.clamp_min(1e-12))).sum()
    return p[step.token].item(), p.max().item(), entropy.item()


@dataclass
class ConfidenceVerifier:
    """Baseline: trust a token when the draft's own probability of it reaches the threshold."""

    threshold: float = 0.5
    needs_hidden: bool = False

    def score(self, step: DraftStep) -> float:
        return draft_confidence_features(step)[0]


def parse_verifier(spec: str) -> Verifier:
    """'confidence:0.5' -> ConfidenceVerifier(0.5). Learned verifiers are loaded by the edge runtime."""
    kind, _, value = spec.partition(":")
    if kind == "confidence":
        threshold = float(value) if value else 0.5
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence threshold must be in [0, 1], got {threshold}")
        return ConfidenceVerifier(threshold)
    raise ValueError(f"unknown verifier {spec!r}; expected 'confidence:THRESHOLD'")
