"""What the fleet simulator is calibrated with: per-step costs (`FleetCosts`) and per-mode call profiles.

Target forward time model (`ForwardModel`), fitted to measured batched forwards:

    t_forward_ms(b, n) = c0_ms + c_tok_ms * n + c_seq_ms * b

b is the number of requests in the batch and n the number of tokens the forward runs. The cloud
runs one packed, unpadded forward per batch (cloud/packed_forward.py), so by default n counts the
requests' own tokens; `FleetCosts.padded_batches` models the engine before it (one left-padded
forward: n = b x the longest request). c0 is the fixed cost of a forward (weights streamed once),
c_tok the marginal cost of a token, c_seq a per-sequence overhead (per-session attention calls).
Context length is not a term: its attention cost is small next to the weights at these sizes.
`FleetCosts.draft_forward` is the same model for the cloud's own draft (mode cloud-sd, `cloud serve
--draft`): one batched draft step, b requests of (mostly) one token each, fitted the same way.

A `ModeProfile` says what one edge does per cloud call, as an empirical distribution of
(block_length, emitted) pairs recorded from real runs; `demo_costs()` and `demo_profiles()` are
illustrative inputs derived from this machine's measured figures (docs/benchmarks).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from common.spec.modes import MODES, Mode, mode_of, placed_mode


@dataclass(frozen=True)
class ForwardModel:
    c0_ms: float
    c_tok_ms: float
    c_seq_ms: float = 0.0

    def t_forward_ms(self, b: int, n: int) -> float:
        return self.c0_ms + self.c_tok_ms * n + self.c_seq_ms * b


def fit_forward_model(samples: list[tuple[int, int, float]]) -> ForwardModel:
    """Least squares fit of t_forward_ms(b, n) to (b, n, ms) samples, coefficients >= 0.

    A forward never gets cheaper with more work, so negative coefficients (which collinear or noisy
    samples produce) are ruled out: non-negative least squares, solved exactly by fitting every
    subset of the three terms and keeping the best fit whose coefficients are all non-negative.
    """
    if not samples:
        raise ValueError("fit_forward_model needs at least one (b, n, ms) sample")
    data = np.asarray(samples, dtype=float).reshape(-1, 3)
    b, n, ms = data.T
    features = np.column_stack([np.ones_like(b), n, b])
    best_sse, best = math.inf, np.zeros(3)
    for keep in itertools.product((True, False), repeat=3):  # the full model first: it wins ties
        cols = [i for i in range(3) if keep[i]]
        if not cols:
            continue
        sub, *_ = np.linalg.lstsq(features[:, cols], ms, rcond=None)
        if (sub < -1e-9).any():
            continue
        coef = np.zeros(3)
        coef[cols] = np.clip(sub, 0.0, None)
        sse = float(((features @ coef - ms) ** 2).sum())
        if sse < best_sse * (1 - 1e-9) - 1e-12:
            best_sse, best = sse, coef
    return ForwardModel(*(float(c) for c in best))


@dataclass(frozen=True)
class RttModel:
    """Round-trip time per call: mean and standard deviation (jitter), lognormal or shifted gamma."""

    mean_ms: float = 0.0
    jitter_ms: float = 0.0
    distribution: str = "lognormal"  # or "gamma": floor_ms + Gamma, the floor being the propagation delay
    floor_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.distribution not in ("lognormal", "gamma"):
            raise ValueError(f"rtt distribution must be 'lognormal' or 'gamma', not {self.distribution!r}")
        if self.mean_ms < 0 or self.jitter_ms < 0:
            raise ValueError("rtt mean_ms and jitter_ms must be >= 0")
        if self.distribution == "gamma" and self.jitter_ms > 0 and self.mean_ms <= self.floor_ms:
            raise ValueError("a shifted gamma rtt needs mean_ms > floor_ms")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        m, s = self.mean_ms, self.jitter_ms
        if s == 0 or m == 0:
            return np.full(size, m)
        if self.distribution == "lognormal":
            sigma2 = math.log1p((s / m) ** 2)
            return rng.lognormal(math.log(m) - sigma2 / 2, math.sqrt(sigma2), size)
        span = m - self.floor_ms
        return self.floor_ms + rng.gamma((span / s) ** 2, s * s / span, size)


def _forward_model(data: dict[str, Any]) -> ForwardModel:
    """Coefficients, or `{"samples": [[b, n, ms], ...]}` to fit them."""
    return fit_forward_model(data["samples"]) if "samples" in data else ForwardModel(**data)


@dataclass(frozen=True)
class FleetCosts:
    draft_step_ms: float  # one draft token on the edge
    verifier_ms: float  # per drafted token, sprinter modes only (the others run no verifier)
    forward: ForwardModel
    rtt: RttModel = field(default_factory=RttModel)
    window_ms: float = 0.0  # cloud batching window (`--batch-window-ms`; 0: continuous batching)
    max_batch: int = 8  # cloud `--max-batch`
    # The batcher's straggler hold with continuous batching (cloud/batcher.py): right after a forward, a batch short
    # of the replica's open generations waits min(max_hold_ms, straggler_share x that forward) for more. 0: off.
    straggler_share: float = 0.0
    max_hold_ms: float = 0.0
    padded_batches: bool = False  # True: n = b x longest request, as the engine before the packed forward ran it
    uplink_mbps: float | None = None  # None: transfer time not modelled
    downlink_mbps: float | None = None
    uplink_bytes_per_token: float = 8.0  # a draft token id and its draft probability
    frame_bytes: float = 64.0  # per message, either way (framing, ids, verdict)
    # Prefill, 0 = not modelled. With prompt_tokens > 0 a generation's first call first opens the
    # session (one more round trip and a forward of the prompt through the batcher), and in target
    # mode the first forward carries the prompt; the edge's first draft token costs draft_prefill_ms.
    prompt_tokens: int = 0
    draft_prefill_ms: float = 0.0
    # The cloud's own draft (cloud-sd): a batched draft step's time; None: not given (cloud-sd cannot run).
    draft_forward: ForwardModel | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if min(self.draft_step_ms, self.verifier_ms, self.window_ms, self.prompt_tokens, self.draft_prefill_ms) < 0:
            raise ValueError("draft_step_ms, verifier_ms, window_ms, prompt_tokens and draft_prefill_ms must be >= 0")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")

    def draft_model(self) -> ForwardModel:
        """The cloud draft's forward time model, which mode cloud-sd needs."""
        if self.draft_forward is None:
            raise ValueError("mode cloud-sd needs the costs' draft_forward (the cloud's draft step time model: "
                             "coefficients or {\"samples\": [[b, n, ms], ...]})")
        return self.draft_forward

    def uplink_ms(self, n_tokens: int) -> float:
        if not self.uplink_mbps:
            return 0.0
        return (self.frame_bytes + self.uplink_bytes_per_token * n_tokens) * 8 / (self.uplink_mbps * 1e3)

    def downlink_ms(self) -> float:
        return self.frame_bytes * 8 / (self.downlink_mbps * 1e3) if self.downlink_mbps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FleetCosts:
        """`forward` (and `draft_forward`) hold coefficients, or `{"samples": [[b, n, ms], ...]}` to fit them here."""
        data = dict(data)
        draft = data.pop("draft_forward", None)
        return cls(forward=_forward_model(data.pop("forward")), rtt=RttModel(**data.pop("rtt", {})),
                   draft_forward=None if draft is None else _forward_model(draft), **data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> FleetCosts:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class ModeProfile:
    """One edge's cloud calls in a mode: pairs (block_length, emitted) drawn uniformly from a record.

    block_length: draft tokens sent with the call; emitted: tokens the user gets for it (accepted
    + the target's next token). `target` needs no record (one token per 1-token forward), `draft`
    makes no calls. In cloud-sd a call is one of the cloud's rounds (g draft steps at the replica, one verify).
    """

    mode: str
    name: str
    block_lengths: tuple[int, ...] = ()
    emitted: tuple[int, ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; one of {', '.join(MODES)}")
        if len(self.block_lengths) != len(self.emitted):
            raise ValueError("block_lengths and emitted differ in length")
        if self.traits.speculative and not self.block_lengths:
            raise ValueError(f"profile {self.name!r}: mode {self.mode} needs a non-empty 'calls' record")
        if any(g < 1 or not 1 <= e <= g + 1 for g, e in zip(self.block_lengths, self.emitted)):
            raise ValueError(f"profile {self.name!r}: every call needs block_length >= 1 and 1 <= emitted <= block_length + 1")

    @property
    def traits(self) -> Mode:
        """The mode's record (common/spec/modes.py), the one the real edge decodes by."""
        return mode_of(self.mode)

    @property
    def tokens_per_call(self) -> float | None:
        if self.traits.reference:  # the target alone: one token per 1-token forward
            return 1.0
        return sum(self.emitted) / len(self.emitted) if self.emitted else None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModeProfile:
        calls = data.get("calls", [])
        return cls(data["mode"], data.get("name", data["mode"]), tuple(int(c["block_length"]) for c in calls),
                   tuple(int(c["emitted"]) for c in calls), data.get("note", ""))

    @classmethod
    def from_record(cls, mode: str, block_lengths: list[int], accepted_lengths: list[int], name: str = "") -> ModeProfile:
        """From an edge's verify record (`StatsRecorder.block_lengths/accepted_lengths`): emitted = accepted + 1."""
        return cls(mode, name or mode, tuple(block_lengths), tuple(a + 1 for a in accepted_lengths))

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "name": self.name, "note": self.note,
                "calls": [{"block_length": g, "emitted": e} for g, e in zip(self.block_lengths, self.emitted)]}


def cloud_profile(edge_profile: ModeProfile, name: str = "") -> ModeProfile:
    """The cloud-sd profile of an edge-drafting lossless profile (sd-block, ...): its record as it is, since the
    cloud's rounds apply the same rule with the same draft (common/spec/modes.py placed_mode)."""
    mode = placed_mode(edge_profile.mode, "cloud")
    if not mode_of(mode).cloud_drafts:
        raise ValueError(f"profile {edge_profile.name!r}: mode {edge_profile.mode} has no cloud-drafting form")
    return ModeProfile(mode, name or mode, edge_profile.block_lengths, edge_profile.emitted,
                       f"{edge_profile.name}'s record, drafted at the replica. {edge_profile.note}".strip())


def profiles_from_json(text: str) -> list[ModeProfile]:
    return [ModeProfile.from_dict(d) for d in json.loads(text)]


def profiles_to_json(profiles: list[ModeProfile]) -> str:
    return json.dumps([p.to_dict() for p in profiles], indent=1)


# --- illustrative inputs: the CLI runs without measured files -----------------------------------

ILLUSTRATIVE = "ILLUSTRATIVE, not a measurement: "

# (b, n, ms): bench-cloud, Qwen2.5-Coder-1.5B bf16 on 2 CPU cores, k=5 (6 tokens per edge), full
# batches, p50 verify latency; and a 1-token forward from bench-local's target mode (7.34 tokens/s).
DEMO_FORWARD_SAMPLES = [(1, 1, 136.0), (1, 6, 171.0), (8, 48, 405.0), (16, 96, 609.0)]
# The cloud's draft (Qwen2.5-Coder-0.5B bf16) as a fraction of the target's forward: batched 1-token steps through
# the cloud's Batcher (packed forward, 64-token contexts), pinned to one core, b = 1, 2, 4, 8, 16: 0.5B 201, 187,
# 179, 211, 278 ms; 1.5B 465, 418, (871, disturbed), 654, 695 ms; median ratio 0.40 (by parameter count: 0.32).
DEMO_DRAFT_TO_TARGET = 0.40


def demo_costs() -> FleetCosts:
    forward = fit_forward_model(DEMO_FORWARD_SAMPLES)
    return FleetCosts(
        draft_step_ms=18.0,  # Qwen2.5-Coder-0.5B, ONNX Runtime int8 (bench-draft, 17.8 ms median)
        verifier_ms=0.8,
        forward=forward,
        draft_forward=ForwardModel(*(DEMO_DRAFT_TO_TARGET * c for c in (forward.c0_ms, forward.c_tok_ms, forward.c_seq_ms))),
        rtt=RttModel(mean_ms=30.0, jitter_ms=10.0),  # assumed WAN link; the measurements ran on loopback
        window_ms=5.0, max_batch=16, padded_batches=True,  # bench-cloud's settings (the padded engine)
        note=ILLUSTRATIVE + "draft 18 ms/step (ONNX int8), verifier 0.8 ms/token, target forward fitted to "
             "bench-cloud (1x6 tokens 171 ms, 8x6 405 ms, 16x6 609 ms) and a 136 ms 1-token step; the cloud's draft "
             f"(cloud-sd) {DEMO_DRAFT_TO_TARGET:g} x the target's forward (measured 0.5B/1.5B step ratio); RTT 30+-10 ms assumed",
    )


def _calls_from_probabilities(probabilities: dict[tuple[int, int], float], n_calls: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An empirical record whose frequencies follow `probabilities` (rounded to n_calls calls)."""
    pairs = [pair for pair, p in sorted(probabilities.items()) for _ in range(round(p * n_calls))]
    return tuple(g for g, _ in pairs), tuple(e for _, e in pairs)


def _sd_probabilities(k: int, accept: float) -> dict[tuple[int, int], float]:
    """Each drafted token kept with probability `accept` until the first rejection."""
    probs = {(k, j + 1): accept ** j * (1 - accept) for j in range(k)}
    probs[(k, k + 1)] = accept ** k
    return probs


def _flag_probabilities(flag: float, cap: int, accept_passed: float, accept_flagged: float) -> dict[tuple[int, int], float]:
    """Blocks end at the first flag (probability `flag` per token) or at the cap; the whole block is then
    verified: passed tokens kept with `accept_passed`, the last one with `accept_flagged`."""
    probs: dict[tuple[int, int], float] = {}
    for g in range(1, cap + 1):
        p_g = (1 - flag) ** (g - 1) * (flag if g < cap else 1.0)
        for j in range(g - 1):  # rejected at passed token j
            probs[(g, j + 1)] = p_g * accept_passed ** j * (1 - accept_passed)
        survive = p_g * accept_passed ** (g - 1)
        probs[(g, g)] = survive * (1 - accept_flagged)
        probs[(g, g + 1)] = survive * accept_flagged
    return probs


def demo_profiles(n_calls: int = 400) -> list[ModeProfile]:
    """Illustrative call records matching the measured block efficiencies (docs/benchmarks, bench local, T=0)."""
    sd = _calls_from_probabilities(_sd_probabilities(5, 0.805), n_calls)  # ~3.7 tokens per call, as measured
    # sprinter: the paper's rule keeps every passed token (accept_passed = 1); flags every ~4.3 tokens,
    # half the flagged tokens accepted: ~4.8 tokens per call, as measured with confidence 0.5.
    sprinter = _calls_from_probabilities(_flag_probabilities(0.23, 20, 1.0, 0.5), n_calls)
    # sprinter-exact: same trigger, block-verified; 0.95 per passed token is an ASSUMPTION (not measured).
    exact = _calls_from_probabilities(_flag_probabilities(0.23, 20, 0.95, 0.5), n_calls)
    return [
        ModeProfile("target", "target", note=ILLUSTRATIVE + "one token per 1-token target forward"),
        ModeProfile("draft", "draft", note=ILLUSTRATIVE + "draft alone, no cloud calls"),
        ModeProfile("sd", "sd", *sd, note=ILLUSTRATIVE + "k=5, ~3.7 tokens per call (measured 3.72)"),
        ModeProfile("sd-block", "sd-block", *sd, note=ILLUSTRATIVE + "identical to sd at T=0 (measured 3.72)"),
        ModeProfile("sprinter", "sprinter", *sprinter, note=ILLUSTRATIVE + "confidence 0.5, ~4.8 tokens per call (measured 4.84)"),
        ModeProfile("sprinter-exact", "sprinter-exact", *exact,
                    note=ILLUSTRATIVE + "ASSUMED: sprinter's blocks, 0.95 acceptance per passed token; not measured"),
        # the cloud's rounds follow sd-block's rule with the same draft: the same (block, emitted) distribution
        ModeProfile("cloud-sd", "cloud-sd", *sd, note=ILLUSTRATIVE + "sd-block's record (same rule, same draft), "
                    "drafted at the replica"),
    ]
