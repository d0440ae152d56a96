"""`sprinter verifier eval`: what a verifier buys in decoding, on prompts it was not trained on.

Every method decodes the same held-out prompts with the local decoder (the edge's draft runtime, the
target in-process): the target alone (the reference), sd, and sprinter / sprinter-exact with the
learned verifier and with the confidence baseline at several thresholds each. A threshold sweep
traces each verifier's trade-off curve between cloud cost (target_calls_per_token) and quality
(agreement_with_target, target_nll_per_token); comparing the curves at the same cloud cost is the
fair comparison, so `matched` interpolates the baseline's quality at each learned point's cost.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterable

import numpy as np
from tqdm import tqdm

from common.model.cached_lm import DraftLM
from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings, mode_of
from common.model.loading import LoadedModel
from common.lab.prompt_sets import PromptRecord
from common.model.prompting import encode_prompt
from common.lab.quality import agreement, target_nll_per_token
from common.sampling.distributions import SamplingParams
from common.spec.verifier import ConfidenceVerifier
from edge.runtime.verifier import LearnedVerifier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalSettings:
    max_new_tokens: int = 48
    temperature: float = 0.0
    seed: int = 0
    k: int = 5  # sd's block length
    max_run_length: int = 20
    learned_fprs: tuple[str, ...] = ("0.02", "0.05", "0.1", "0.2")  # thresholds from the verifier's metadata
    confidence_thresholds: tuple[float, ...] = (0.3, 0.5, 0.7, 0.9)
    exact_learned_fprs: tuple[str, ...] = ("0.05",)
    exact_confidence_thresholds: tuple[float, ...] = (0.5,)


@dataclass(frozen=True)
class Method:
    name: str
    mode: str
    verifier: str  # "learned", "confidence" or "-"
    threshold: float | None = None
    policy: str | None = None  # for a mode that takes a call policy (sprinter-exact): "flag" (the paper's loop) or "goodput"


@dataclass
class EvalRow:
    method: str
    mode: str
    verifier: str
    threshold: float | None
    new_tokens: int
    tokens_per_s: float
    target_calls_per_token: float
    tokens_per_call: float | None
    agreement_with_target: float | None  # greedy only
    target_nll_per_token: float


def methods(learned_thresholds: dict[str, float], settings: EvalSettings) -> list[Method]:
    """target, sd, then each verifier's threshold sweep in the paper's loop (send at the first flag),
    then sprinter-exact under the goodput policy, which reads the verifier's scores as acceptance
    probabilities (its default since the call-policy issue)."""
    chosen: list[Method] = [Method("target", "target", "-"), Method(f"sd k={settings.k}", "sd", "-")]
    for mode, fprs, confidences in (("sprinter", settings.learned_fprs, settings.confidence_thresholds),
                                    ("sprinter-exact", settings.exact_learned_fprs, settings.exact_confidence_thresholds)):
        chosen += [Method(f"{mode} learned@FPR{f}", mode, "learned", learned_thresholds[f], "flag") for f in fprs]
        chosen += [Method(f"{mode} confidence:{t:g}", mode, "confidence", t, "flag") for t in confidences]
    chosen += [Method("sprinter-exact learned goodput", "sprinter-exact", "learned",
                      learned_thresholds[settings.exact_learned_fprs[0]], "goodput"),
               Method("sprinter-exact confidence goodput", "sprinter-exact", "confidence",
                      settings.exact_confidence_thresholds[0], "goodput")]
    return chosen


def evaluate(target: LoadedModel, draft: LoadedModel, make_draft_lm: Callable[[bool], DraftLM], learned: LearnedVerifier,
             prompts: list[PromptRecord], settings: EvalSettings, plan: list[Method] | None = None) -> list[EvalRow]:
    """Decode every prompt with every method of `plan` (default `methods`: target first, the reference);
    quality is scored by the target afterwards."""
    sampling = SamplingParams(temperature=settings.temperature, seed=settings.seed)
    prompt_ids = [encode_prompt(target.tokenizer, p.prompt, p.chat) for p in prompts]
    references: list[list[int]] = []
    rows = []
    plan = plan or methods(learned.metadata["thresholds_at_fpr"], settings)
    with tqdm(total=len(plan) * len(prompts), desc="evaluating", unit="run") as progress:
        for method in plan:
            verifier = (replace(learned, threshold=method.threshold) if method.verifier == "learned"
                        else ConfidenceVerifier(method.threshold if method.threshold is not None else 0.5))
            engine = LocalDecoder(target, draft, verifier, make_draft_lm)
            decode = DecodeSettings(mode=method.mode, max_new_tokens=settings.max_new_tokens, sampling=sampling,
                                    k=settings.k, max_run_length=settings.max_run_length,
                                    policy=method.policy if mode_of(method.mode).takes_policy else None)
            outputs, stats = [], []
            for ids in prompt_ids:
                result = engine.generate(ids, decode)
                outputs.append(result.token_ids)
                stats.append(result.stats)
                progress.update(1)
            if mode_of(method.mode).reference:
                references = outputs
            rows.append(_row(method, outputs, stats, prompt_ids, references, target, sampling.greedy))
            log.info("%s: %.3f calls/token, agreement %s", method.name, rows[-1].target_calls_per_token,
                     rows[-1].agreement_with_target)
    return rows


def _row(method: Method, outputs: list[list[int]], stats: list, prompt_ids: list[list[int]],
         references: list[list[int]], target: LoadedModel, greedy: bool) -> EvalRow:
    tokens = sum(len(o) for o in outputs)
    calls = sum(s.target_calls for s in stats)
    wall = sum(s.wall_s for s in stats)
    nll = sum(target_nll_per_token(target, p, o) * len(o) for p, o in zip(prompt_ids, outputs)) / max(1, tokens)
    agree = (sum(agreement(o, r) * len(r) for o, r in zip(outputs, references)) / max(1, sum(map(len, references)))
             if greedy else None)
    return EvalRow(method.name, method.mode, method.verifier, method.threshold, tokens, tokens / wall,
                   calls / tokens, tokens / calls if calls else None, agree, nll)


def matched(rows: list[EvalRow], mode: str = "sprinter", quality: str = "agreement_with_target") -> list[dict]:
    """For each learned point: the confidence baseline's quality interpolated at the same calls per token."""
    curve = sorted((r.target_calls_per_token, getattr(r, quality)) for r in rows
                   if r.mode == mode and r.verifier == "confidence" and getattr(r, quality) is not None)
    out = []
    for r in rows:
        if r.mode != mode or r.verifier != "learned" or getattr(r, quality) is None or len(curve) < 2:
            continue
        calls = r.target_calls_per_token
        inside = curve[0][0] <= calls <= curve[-1][0]
        baseline = float(np.interp(calls, [c for c, _ in curve], [q for _, q in curve])) if inside else None
        out.append({"method": r.method, "target_calls_per_token": calls, quality: getattr(r, quality),
                    f"confidence_{quality}": baseline})
    return out


def table(rows: Iterable[EvalRow]) -> str:
    lines = ["| method | target calls/token | tokens/call | agreement with target | target NLL/token | tokens/s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        agree = "-" if r.agreement_with_target is None else f"{r.agreement_with_target:.3f}"
        per_call = "-" if r.tokens_per_call is None else f"{r.tokens_per_call:.2f}"
        lines.append(f"| {r.method} | {r.target_calls_per_token:.3f} | {per_call} | {agree} | "
                     f"{r.target_nll_per_token:.3f} | {r.tokens_per_s:.2f} |")
    return "\n".join(lines)


def to_dicts(rows: Iterable[EvalRow]) -> list[dict]:
    return [asdict(r) for r in rows]
