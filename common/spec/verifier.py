"""The SPRINTER verifier interface: judge each drafted token before anyone pays for the target.

A verifier sees what the draft computed anyway (its logits and last hidden state at the position
that produced the token) and returns a score, the predicted probability that the target accepts
the token (and, when a companion model runs beside the draft, its overlap signals: common/spec/companion.py).
Tokens scoring below the threshold are flagged. The learned verifier (ONNX, on the edge)
implements the same protocol; `ConfidenceVerifier` is the baseline that needs no training.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftStep:
    token: int
    logits: torch.Tensor  # [V] the draft's raw logits (before temperature and truncation)
    hidden: torch.Tensor | None  # [H] the draft's last hidden state at this position
    companion: tuple[float, float] | None = None  # (S, A) of common/spec/companion.py, when a companion runs
    # (token_prob, entropy) of the token drafted just before this one in its block, when the verifier reads it
    previous: tuple[float, float] | None = None
    position: int | None = None  # its index in the pending block (0: the block's first token), when the drafter knows it


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


def draft_margin(step: DraftStep) -> float:
    """The top-2 margin of the draft's softmax at T=1: how clearly it preferred its first choice."""
    top = torch.softmax(step.logits.float(), dim=-1).topk(2).values
    return float(top[0] - top[1])


def learns_from_verdicts(verifier: Verifier | None) -> bool:
    """True when the verifier refits from the verdicts it hears (margin-logistic): only a lossless mode has them all."""
    return bool(getattr(verifier, "learns_from_verdicts", False))


def teach_verdict(verifier: Verifier | None, steps: list[DraftStep], n_accepted: int) -> None:
    """Tell a verifier that learns online (`observe_verdict`, optional on a verifier) how a block it scored fared."""
    learn = getattr(verifier, "observe_verdict", None)
    if learn is not None and steps:
        learn(steps, n_accepted)


def reads_history(verifier: Verifier | None) -> bool:
    """True when the verifier reads the previous drafted token's features (`DraftStep.previous`)."""
    return bool(getattr(verifier, "needs_history", False))


def verifier_for(verifier: Verifier | None, temperature: float) -> Verifier | None:
    """The verifier that scores tokens drafted at `temperature`.

    A verifier with `for_temperature` (one per regime: edge/runtime/verifier.py TemperatureMatched) picks;
    one with `trained_temperature` trained for the other regime (greedy labels at T > 0, or the reverse)
    still scores, with a warning once per regime: its scores are then not acceptance probabilities, so
    its threshold and the call policy misjudge.
    """
    pick = getattr(verifier, "for_temperature", None)
    if pick is not None:
        return pick(temperature)
    trained = getattr(verifier, "trained_temperature", None)
    if trained is not None and (trained > 0) != (temperature > 0):
        regime = "sampling" if temperature > 0 else "greedy"
        warned: set[str] = verifier.warned_regimes  # type: ignore[union-attr]
        if regime not in warned:
            warned.add(regime)
            log.warning("the verifier was trained on %s data (T=%g) but scores %s decoding (T=%g): its scores are not "
                        "acceptance probabilities here; train one for this regime (sprinter verifier train "
                        "--temperature)", "sampled" if trained > 0 else "greedy", trained, regime, temperature)
    return verifier


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
    raise ValueError(f"unknown verifier {spec!r}; expected 'confidence:THRESHOLD' (the edge also loads 'auto', "
                     "'margin-logistic[:THRESHOLD]' and a learned verifier's .json: edge/runtime/verifier.py)")
