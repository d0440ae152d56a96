"""`sprinter verifier bound`: lossy `sprinter` at a stated quality, and what it costs against sd.

sprinter (the paper's loop: tokens the verifier passes are never checked) trades quality for cloud
calls through its threshold. A threshold earns its place only at a quality a user would accept, so
it is chosen, not guessed:
    1. on the verifier's calibration prompts (never its training or test prompts), decode the target
       and sprinter at every calibrated threshold (the metadata's thresholds_at_fpr);
    2. keep the threshold with the fewest target calls per token whose quality meets the bound:
       agreement:A  (greedy: the share of positions equal to the target's output is at least A), or
       nll:R        (the target's NLL per token of the output is at most R x the target's own);
    3. on the held-out prompts, decode target, sd k=K and sprinter at that threshold, and report
       calls per token and quality side by side: does it call the cloud less than sd at that quality?
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from common.model.cached_lm import DraftLM
from common.spec.modes import mode_of
from common.model.loading import LoadedModel
from common.lab.prompt_sets import PromptRecord
from edge.verifier_training.evaluate import EvalRow, EvalSettings, Method, evaluate, table
from edge.runtime.verifier import LearnedVerifier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QualityBound:
    metric: str  # "agreement" or "nll"
    value: float

    @classmethod
    def parse(cls, spec: str) -> QualityBound:
        """'agreement:0.95' or 'nll:1.03'."""
        metric, _, value = spec.partition(":")
        if metric not in ("agreement", "nll") or not value:
            raise ValueError(f"a quality bound is agreement:A or nll:R (e.g. agreement:0.95, nll:1.03), not {spec!r}")
        return cls(metric, float(value))

    def met(self, row: EvalRow, reference: EvalRow) -> bool:
        if self.metric == "agreement":
            if row.agreement_with_target is None:
                raise ValueError("an agreement bound needs greedy decoding (--temperature 0); use nll:R")
            return row.agreement_with_target >= self.value
        return row.target_nll_per_token <= self.value * reference.target_nll_per_token

    def __str__(self) -> str:
        return f"{self.metric}:{self.value:g}"


@dataclass
class BoundReport:
    bound: str
    threshold: float | None  # None: no calibrated threshold met the bound
    fpr: str | None
    calibration: list[EvalRow]
    held_out: list[EvalRow]

    def tables(self) -> str:
        chosen = "none met it" if self.threshold is None else f"threshold {self.threshold:.4f} (FPR {self.fpr})"
        return (f"Calibration prompts, bound {self.bound}: {chosen}\n\n{table(self.calibration)}\n\n"
                f"Held-out prompts\n\n{table(self.held_out)}")


def _sweep(thresholds: dict[str, float]) -> list[Method]:
    return [Method("target", "target", "-")] + [
        Method(f"sprinter learned@FPR{fpr}", "sprinter", "learned", threshold, "flag")
        for fpr, threshold in sorted(thresholds.items(), key=lambda item: float(item[0]))]


def choose_threshold(rows: list[EvalRow], bound: QualityBound) -> EvalRow | None:
    """The sprinter row with the fewest target calls per token among those that meet the bound."""
    reference = next(r for r in rows if mode_of(r.mode).reference)
    meeting = [r for r in rows if not mode_of(r.mode).lossless and bound.met(r, reference)]
    return min(meeting, key=lambda r: r.target_calls_per_token, default=None)


def run_bound(target: LoadedModel, draft: LoadedModel, make_draft_lm: Callable[[bool], DraftLM],
              learned: LearnedVerifier, calibration: list[PromptRecord], held_out: list[PromptRecord],
              settings: EvalSettings, bound: QualityBound) -> BoundReport:
    thresholds = learned.metadata["thresholds_at_fpr"]
    swept = evaluate(target, draft, make_draft_lm, learned, calibration, settings, _sweep(thresholds))
    chosen = choose_threshold(swept, bound)
    plan = [Method("target", "target", "-"), Method(f"sd k={settings.k}", "sd", "-")]
    fpr = None
    if chosen is not None:
        fpr = chosen.method.rsplit("FPR", 1)[1]
        plan.append(Method(f"sprinter at {bound} (FPR{fpr})", "sprinter", "learned", chosen.threshold, "flag"))
        log.info("bound %s met on calibration prompts at FPR %s (%.3f calls/token)", bound, fpr,
                 chosen.target_calls_per_token)
    else:
        log.warning("no calibrated threshold meets %s on the calibration prompts", bound)
    tested = evaluate(target, draft, make_draft_lm, learned, held_out, settings, plan)
    return BoundReport(str(bound), chosen.threshold if chosen else None, fpr, swept, tested)


def write_report(report: BoundReport, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bound.json").write_text(json.dumps({
        "bound": report.bound, "threshold": report.threshold, "fpr": report.fpr,
        "calibration": [asdict(r) for r in report.calibration], "held_out": [asdict(r) for r in report.held_out]},
        indent=1))
    (out / "bound.md").write_text(report.tables() + "\n")
