"""The margin-logistic verifier (`--verifier margin-logistic`): a per-position logistic curve on the draft's logit margin,
fitted online from the edge's own verdicts.

Per draft position k (0 = the first token of a block):
    p_k = sigmoid(w_k * margin + b_k),   margin = the draft's top-1 minus top-2 raw logit at that token
Two parameters per position, shared by every request of one regime (greedy, sampling: `MarginLogisticVerifier`).

Learning, from the verdicts that reach the edge (`observe_verdict`):
    - each verdict adds the block's reached positions: x_1..x_n kept (label 1), then x_{n+1} rejected (label 0) when
      the block was longer; tokens after x_{n+1} were verified but never reached, so they say nothing of p_k;
    - every `refit_every` verdicts, each position with at least `min_examples` recent examples is refitted by IRLS
      (Newton steps on the logistic loss with a small ridge), starting from its current parameters;
    - a fit with a negative slope is rejected and the position keeps its previous parameters: a larger margin (a
      surer draft) never makes acceptance less likely, so a negative slope is noise;
    - until a position has a fit it reads the parameters of the nearest shallower position with one; before any fit
      (the warm-up) every token scores 1.0, so a goodput or adaptive policy drafts to its cap and every position up
      to it gets verified: full verification until there is something to judge with.
The verifier learns from every drafted token's verdict, so it serves the lossless modes only (`call_policy` in
common/spec/modes.py refuses it for sprinter, which releases passed tokens unchecked).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from common.spec.verifier import DraftStep

log = logging.getLogger(__name__)

KIND = "margin-logistic"


def logit_margin(logits: torch.Tensor) -> float:
    """The draft's top-1 minus top-2 raw logit (= log(p1 / p2) under its softmax at T=1)."""
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def fit_logistic(margins: np.ndarray, labels: np.ndarray, start: tuple[float, float] = (0.0, 0.0),
                 ridge: float = 1e-2, max_steps: int = 50, tolerance: float = 1e-8) -> tuple[float, float]:
    """(w, b) minimising the logistic loss of sigmoid(w * margin + b) against 0/1 labels, plus ridge/2 * (w^2 + b^2),
    by Newton steps (IRLS) from `start`, each halved until the loss falls (a full step from far away can overshoot).
    The ridge keeps a position whose examples all agree finite."""
    if ridge <= 0:
        raise ValueError(f"ridge must be > 0 (it keeps separable positions finite), got {ridge:g}")
    x = np.stack([np.asarray(margins, dtype=np.float64), np.ones(len(margins))], axis=1)  # [n, 2]
    y = np.asarray(labels, dtype=np.float64)
    theta = np.asarray(start, dtype=np.float64)
    loss = _penalised_loss(x, y, theta, ridge)
    for _ in range(max_steps):
        p = 1.0 / (1.0 + np.exp(-np.clip(x @ theta, -500.0, 500.0)))
        gradient = x.T @ (p - y) + ridge * theta
        hessian = (x * (p * (1.0 - p))[:, None]).T @ x + ridge * np.eye(2)
        step = np.linalg.solve(hessian, gradient)
        for _ in range(40):
            candidate = _penalised_loss(x, y, theta - step, ridge)
            if candidate <= loss:
                break
            step = step / 2.0
        theta, loss = theta - step, min(loss, candidate)
        if float(np.abs(step).max()) < tolerance:
            break
    return float(theta[0]), float(theta[1])


def _penalised_loss(x: np.ndarray, y: np.ndarray, theta: np.ndarray, ridge: float) -> float:
    z = x @ theta
    return float(np.sum(np.logaddexp(0.0, z) - y * z) + 0.5 * ridge * float(theta @ theta))


@dataclass(frozen=True)
class MarginLogisticSettings:
    threshold: float = 0.5  # a flag policy's threshold (sprinter-exact with --policy flag)
    refit_every: int = 100  # verdicts between fits
    min_examples: int = 20  # reached tokens a position needs before it is fitted
    window: int = 4096  # the most recent examples kept per position: the fit follows drift
    ridge: float = 1e-2

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"margin-logistic threshold must be in [0, 1], got {self.threshold:g}")
        for name in ("refit_every", "min_examples", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"margin-logistic {name} must be >= 1, got {getattr(self, name)}")
        if self.ridge <= 0:
            raise ValueError(f"margin-logistic ridge must be > 0, got {self.ridge:g}")


@dataclass
class FitOutcome:
    """What one refit did, per position: fitted (w, b), or why a position kept its parameters."""

    fitted: dict[int, tuple[float, float]] = field(default_factory=dict)
    rejected_negative: list[int] = field(default_factory=list)
    too_few: list[int] = field(default_factory=list)


@dataclass
class MarginLogistic:
    """One regime's estimator (see the module docstring): scores tokens and learns from verdicts."""

    settings: MarginLogisticSettings = field(default_factory=MarginLogisticSettings)
    needs_hidden: bool = False
    learns_from_verdicts: bool = True  # common/spec/modes.py: not for modes that release passed tokens
    params: dict[int, tuple[float, float]] = field(default_factory=dict)  # position -> (w, b) of its last good fit
    verdicts: int = 0
    fits: int = 0
    _examples: dict[int, deque] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # scores run in worker threads

    @property
    def threshold(self) -> float:
        return self.settings.threshold

    @property
    def warming_up(self) -> bool:
        return not self.params

    def parameters_at(self, position: int) -> tuple[float, float] | None:
        """(w, b) that score `position`: its own fit, else the nearest shallower fitted position's; None: none yet."""
        with self._lock:
            fitted = [k for k in self.params if k <= position]
            return self.params[max(fitted)] if fitted else None

    def probability(self, position: int, margin: float) -> float:
        """p_k for a token at block position `position` with this logit margin; 1.0 while that position warms up."""
        parameters = self.parameters_at(position)
        if parameters is None:
            return 1.0
        w, b = parameters
        return sigmoid(w * margin + b)

    def score(self, step: DraftStep) -> float:
        if step.position is None:
            raise ValueError("the margin-logistic verifier scores by position in the block: DraftStep.position is unset")
        return self.probability(step.position, logit_margin(step.logits))

    def observe_verdict(self, steps: Sequence[DraftStep | None], n_accepted: int) -> None:
        """The target kept the first n_accepted of the block whose drafted steps (in block order; None where a token
        was not the draft model's) are `steps`. Positions past the first rejection were not reached: not learned."""
        if not 0 <= n_accepted <= len(steps):
            raise ValueError(f"n_accepted must be in [0, {len(steps)}], got {n_accepted}")
        self.observe_examples([(k, logit_margin(step.logits), k < n_accepted)
                               for k, step in enumerate(steps[: n_accepted + 1]) if step is not None])

    def observe_examples(self, examples: Sequence[tuple[int, float, bool]]) -> FitOutcome | None:
        """One verdict's reached (position, margin, accepted) triples; refits every `refit_every` verdicts."""
        with self._lock:
            for position, margin, accepted in examples:
                kept = self._examples.setdefault(position, deque(maxlen=self.settings.window))
                kept.append((margin, 1.0 if accepted else 0.0))
            self.verdicts += 1
            due = self.verdicts % self.settings.refit_every == 0
        return self.refit() if due else None

    def refit(self) -> FitOutcome:
        """Fit every position with enough examples; keep the previous parameters where the slope comes out negative."""
        with self._lock:
            data = {k: np.asarray(v, dtype=np.float64) for k, v in self._examples.items()}
            start = dict(self.params)
        outcome = FitOutcome()
        for position, rows in sorted(data.items()):
            if len(rows) < self.settings.min_examples:
                outcome.too_few.append(position)
                continue
            w, b = fit_logistic(rows[:, 0], rows[:, 1], start.get(position, (0.0, 0.0)), self.settings.ridge)
            if w < 0:
                outcome.rejected_negative.append(position)
                continue
            outcome.fitted[position] = (w, b)
        with self._lock:
            self.params.update(outcome.fitted)
            self.fits += 1
        if outcome.rejected_negative:
            log.info("margin-logistic fit %d: negative slopes rejected at positions %s", self.fits,
                     outcome.rejected_negative)
        return outcome


@dataclass
class MarginLogisticVerifier:
    """`--verifier margin-logistic[:THRESHOLD]`: one estimator per regime, since acceptance at T > 0 is another curve."""

    settings: MarginLogisticSettings = field(default_factory=MarginLogisticSettings)
    needs_hidden: bool = False
    learns_from_verdicts: bool = True
    greedy: MarginLogistic = field(init=False)
    sampling: MarginLogistic = field(init=False)

    def __post_init__(self) -> None:
        self.greedy = MarginLogistic(self.settings)
        self.sampling = MarginLogistic(self.settings)

    @property
    def threshold(self) -> float:
        return self.settings.threshold

    @property
    def spec(self) -> str:
        """What `--verifier` names it by (verifier_identity in edge/runtime/verifier.py)."""
        return f"{KIND}:{self.threshold:g}"

    def for_temperature(self, temperature: float) -> MarginLogistic:
        return self.sampling if temperature > 0 else self.greedy

    def score(self, step: DraftStep) -> float:
        return self.greedy.score(step)


def parse_margin_logistic(value: str) -> MarginLogisticVerifier:
    """'' or 'THRESHOLD' (after 'margin-logistic:') -> the verifier."""
    if not value:
        return MarginLogisticVerifier()
    try:
        threshold = float(value)
    except ValueError:
        raise ValueError(f"--verifier {KIND}:THRESHOLD: the threshold must be a number in [0, 1], got {value!r}") from None
    return MarginLogisticVerifier(MarginLogisticSettings(threshold=threshold))
