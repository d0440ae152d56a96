"""Learned SPRINTER verifiers on ONNX Runtime: an ONNX model plus a JSON metadata file.

The metadata names the model pair the verifier was trained for, its input features, its threshold
and its training metrics. A verifier trained for another pair is refused: its scores would be
meaningless. The ONNX model maps features [n, F] (float32) to acceptance scores [n] in [0, 1].

    {"format": "sprinter-verifier/1", "onnx": "verifier.onnx",
     "pair": {"draft": "qwen2.5-coder-0.5b", "target": "qwen2.5-coder-1.5b", "vocab_fingerprint": "..."},
     "features": ["hidden", "token_prob", "max_prob", "entropy"], "hidden_size": 896,
     "threshold": 0.5, "metrics": {...}}

A verifier whose features include "companion_overlap" / "companion_ratio" also names the companion
model it was trained with ("companion": SPEC) and runs only with that companion beside the draft.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
from transformers import PreTrainedTokenizerBase

from common.spec.propose.suffix_proposer import Priors, load_priors
from common.errors import PairMismatch
from common.fleet_plane.messages import verifier_digest
from common.model.loading import vocab_fingerprint
from common.spec.margin_logistic import KIND as MARGIN_LOGISTIC, MarginLogisticVerifier, parse_margin_logistic
from common.spec.verifier import ConfidenceVerifier, DraftStep, Verifier, draft_confidence_features, draft_margin, parse_verifier
from edge.runtime.ort_sessions import make_session

log = logging.getLogger(__name__)

FORMAT = "sprinter-verifier/1"
CONFIDENCE_FEATURES = ("token_prob", "max_prob", "entropy")
COMPANION_FEATURES = ("companion_overlap", "companion_ratio")  # (S, A) of common/spec/companion.py, in that order
FREE_FEATURES = ("margin", "prev_token_prob", "entropy_delta")  # edge/verifier_training/features.py defines them
HISTORY_FEATURES = ("prev_token_prob", "entropy_delta")  # read DraftStep.previous
KNOWN_FEATURES = ("hidden", *CONFIDENCE_FEATURES, *COMPANION_FEATURES, *FREE_FEATURES)


def step_features(step: DraftStep, names: tuple[str, ...]) -> np.ndarray:
    """The feature vector a verifier with these input names reads for one drafted token."""
    parts: list[np.ndarray] = []
    confidence = dict(zip(CONFIDENCE_FEATURES, draft_confidence_features(step)))
    previous_prob, previous_entropy = step.previous or (confidence["token_prob"], confidence["entropy"])
    free = {"prev_token_prob": previous_prob, "entropy_delta": confidence["entropy"] - previous_entropy}
    for name in names:
        if name == "hidden":
            parts.append(step.hidden.float().numpy().reshape(-1))
        elif name == "margin":
            parts.append(np.array([draft_margin(step)], dtype=np.float32))
        elif name in free:
            parts.append(np.array([free[name]], dtype=np.float32))
        elif name in COMPANION_FEATURES:
            if step.companion is None:
                raise ValueError(f"this verifier reads {name}, but no companion model runs beside the draft: "
                                 "configure one with --companion SPEC (the one the verifier was trained with)")
            parts.append(np.array([step.companion[COMPANION_FEATURES.index(name)]], dtype=np.float32))
        else:
            parts.append(np.array([confidence[name]], dtype=np.float32))
    return np.concatenate(parts).astype(np.float32)


@dataclass
class LearnedVerifier:
    """A trained verifier: `score` is the predicted probability that the target accepts the token."""

    metadata: dict
    session: ort.InferenceSession
    threshold: float
    sha256: str = ""  # common.fleet_plane.messages.verifier_digest: the fleet plane names a verifier by it
    warned_regimes: set[str] = field(default_factory=set)  # "greedy"/"sampling": mismatches already logged

    @property
    def needs_hidden(self) -> bool:
        return "hidden" in self.metadata["features"]

    @property
    def needs_companion(self) -> bool:
        return any(name in COMPANION_FEATURES for name in self.metadata["features"])

    @property
    def needs_history(self) -> bool:
        return any(name in HISTORY_FEATURES for name in self.metadata["features"])

    @property
    def trained_temperature(self) -> float:
        """The sampling temperature of the data it was trained on (0: greedy labels).

        Verifiers made before the sampling regime existed state no temperature: they were all trained on
        greedy labels, so a missing field means 0 (a pushed artifact must not fail a request over it).
        """
        if "temperature" in self.metadata:
            return float(self.metadata["temperature"])
        collection = self.metadata.get("training", {}).get("collection", {})
        return float(collection.get("temperature", 0.0))

    @classmethod
    def load(cls, metadata_path: Path, threads: int = 1) -> "LearnedVerifier":
        metadata = json.loads(Path(metadata_path).read_text())
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{metadata_path}: not a sprinter verifier (format {metadata.get('format')!r}, expected {FORMAT!r})")
        unknown = set(metadata["features"]) - set(KNOWN_FEATURES)
        if unknown:
            raise ValueError(f"{metadata_path}: unknown features {sorted(unknown)}")
        # a dot product per token: more threads would only add overhead
        onnx_path = Path(metadata_path).parent / metadata["onnx"]
        session = make_session(onnx_path, threads=threads)
        digest = verifier_digest(onnx_path.read_bytes(), metadata)
        metadata.setdefault("id", Path(metadata_path).resolve().parent.name)  # a verifier's directory names it
        return cls(metadata, session, float(metadata["threshold"]), digest)

    def check_pair(self, draft_tokenizer: PreTrainedTokenizerBase, draft_spec: str | None = None,
                   target_id: str | None = None) -> None:
        pair = self.metadata["pair"]
        if pair["vocab_fingerprint"] != vocab_fingerprint(draft_tokenizer):
            raise PairMismatch(f"this verifier was trained for {pair['draft']} -> {pair['target']}, "
                                   "whose vocabulary differs from this draft's")
        for role, actual in (("draft", draft_spec), ("target", target_id)):
            if actual is not None and actual != pair[role]:
                raise PairMismatch(f"this verifier was trained with {role} {pair[role]!r}, not {actual!r}: "
                                       "train one for this pair (sprinter verifier train)")

    def check_companion(self, companion_spec: str | None) -> None:
        """Refuse to run without the companion this verifier reads, or with another one than it was trained with."""
        if not self.needs_companion:
            return
        trained_with = self.metadata.get("companion")
        if companion_spec is None:
            raise ValueError(f"this verifier reads companion features ({', '.join(COMPANION_FEATURES)}): "
                             f"run a companion model beside the draft with --companion {trained_with or 'SPEC'}")
        if trained_with is not None and companion_spec != trained_with:
            raise PairMismatch(f"this verifier was trained with companion {trained_with!r}, not {companion_spec!r}")

    def score(self, step: DraftStep) -> float:
        return float(self.score_features(step_features(step, tuple(self.metadata["features"]))[None, :])[0])

    def score_features(self, features: np.ndarray) -> np.ndarray:
        """[n, F] feature rows (the metadata's features, in order) -> [n] acceptance probabilities."""
        return self.session.run(None, {self.session.get_inputs()[0].name: features.astype(np.float32)})[0].reshape(-1)


SHIPPED_DIR = Path(__file__).parent.parent / "verifiers"  # edge/verifiers: the verifiers the edge ships with
AUTO_FALLBACK = "confidence:0.5"
SUFFIX_CALIBRATION = "suffix_calibration.json"  # beside a shipped verifier: its pair's copies' rates (one regime)


def shipped_verifiers(draft_spec: str | None, target_id: str | None) -> list[Path]:
    """The verifiers this project ships for the pair (trained with `sprinter verifier train`): one per regime.

    With the target unknown (cloud not reachable yet), the draft's verifiers are taken only when they all
    name one target.
    """
    if draft_spec is None:
        return []
    pairs = {p: json.loads(p.read_text())["pair"] for p in sorted(SHIPPED_DIR.glob("*/verifier.json"))}
    candidates = [p for p, pair in pairs.items() if pair["draft"] == draft_spec
                  and (target_id is None or pair["target"] == target_id)]
    return candidates if len({pairs[p]["target"] for p in candidates}) == 1 else []


def shipped_suffix_priors(draft_spec: str | None, target_id: str | None) -> dict[str, Priors]:
    """The copies' calibration shipped beside the pair's verifiers (`sprinter bench proposer --fit-calibration`),
    per regime ("greedy", "sampled"): what suffix and hybrid drafting start from on this pair."""
    priors = {}
    for path in shipped_verifiers(draft_spec, target_id):
        calibration = path.parent / SUFFIX_CALIBRATION
        if calibration.exists():
            priors[json.loads(calibration.read_text())["regime"]] = load_priors(calibration)
    return priors


@dataclass
class TemperatureMatched:
    """Two verifiers for one pair: `greedy` scores tokens drafted at T = 0, `sampling` those drafted at T > 0.

    A decoder picks with common.spec.verifier.verifier_for(this, temperature); the attributes below describe both.
    """

    greedy: LearnedVerifier
    sampling: LearnedVerifier

    def for_temperature(self, temperature: float) -> Verifier:
        return self.sampling if temperature > 0 else self.greedy

    @property
    def threshold(self) -> float:
        return self.greedy.threshold

    @property
    def needs_hidden(self) -> bool:
        return self.greedy.needs_hidden or self.sampling.needs_hidden

    @property
    def needs_companion(self) -> bool:
        return self.greedy.needs_companion or self.sampling.needs_companion

    @property
    def needs_history(self) -> bool:
        return self.greedy.needs_history or self.sampling.needs_history

    @property
    def metadata(self) -> dict:
        return self.greedy.metadata

    def score(self, step: DraftStep) -> float:
        return self.greedy.score(step)

    def check_pair(self, draft_tokenizer: PreTrainedTokenizerBase, draft_spec: str | None = None,
                   target_id: str | None = None) -> None:
        self.greedy.check_pair(draft_tokenizer, draft_spec, target_id)
        self.sampling.check_pair(draft_tokenizer, draft_spec, target_id)


def _shipped(draft_spec: str | None, target_id: str | None) -> Verifier | None:
    verifiers = [LearnedVerifier.load(p) for p in shipped_verifiers(draft_spec, target_id)]
    greedy = [v for v in verifiers if v.trained_temperature == 0]
    sampling = [v for v in verifiers if v.trained_temperature > 0]
    if greedy and sampling:
        log.info("using the shipped verifiers %s (T = 0) and %s (T > 0)", greedy[0].metadata["id"],
                 sampling[0].metadata["id"])
        return TemperatureMatched(greedy[0], sampling[0])
    if verifiers:
        log.info("using the shipped verifier %s", verifiers[0].metadata["id"])
        return verifiers[0]
    return None


def load_verifier(spec: str, draft_tokenizer: PreTrainedTokenizerBase, draft_spec: str | None = None,
                  target_id: str | None = None, companion_spec: str | None = None) -> Verifier:
    """'auto', 'confidence:THRESHOLD', 'margin-logistic[:THRESHOLD]' (common/spec/margin_logistic.py: fitted online
    from the verdicts) or the path of a learned verifier's metadata JSON (checked against the pair).

    'auto' takes the verifiers shipped for this draft/target pair (one for greedy decoding and one for
    sampling when both are shipped: `TemperatureMatched`), else the confidence baseline. A learned verifier
    that reads companion features is refused unless `companion_spec` (--companion) names a companion.
    """
    if spec == "auto":
        verifier = _shipped(draft_spec, target_id)
        if verifier is None:
            log.info("no shipped verifier for %s -> %s: using %s", draft_spec, target_id, AUTO_FALLBACK)
            return parse_verifier(AUTO_FALLBACK)
    elif spec.endswith(".json"):
        verifier = LearnedVerifier.load(Path(spec))
    elif spec.partition(":")[0] == MARGIN_LOGISTIC:
        return parse_margin_logistic(spec.partition(":")[2])
    else:
        return parse_verifier(spec)
    verifier.check_pair(draft_tokenizer, draft_spec, target_id)
    for learned in (verifier.greedy, verifier.sampling) if isinstance(verifier, TemperatureMatched) else (verifier,):
        learned.check_companion(companion_spec)
    return verifier


def verifier_identity(verifier: Verifier) -> dict:
    """{"id", "sha256"} of a verifier (sha256 of its ONNX file; null for the confidence baseline)."""
    if isinstance(verifier, TemperatureMatched):
        return {"id": f"{verifier.greedy.metadata['id']}+{verifier.sampling.metadata['id']}",
                "sha256": verifier.greedy.sha256}
    if isinstance(verifier, LearnedVerifier):
        return {"id": str(verifier.metadata["id"]), "sha256": verifier.sha256}
    if isinstance(verifier, MarginLogisticVerifier):
        return {"id": verifier.spec, "sha256": None}
    return {"id": f"confidence:{verifier.threshold:g}", "sha256": None}


__all__ = ["ConfidenceVerifier", "LearnedVerifier", "TemperatureMatched", "load_verifier",
           "step_features"]
