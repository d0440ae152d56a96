"""Validate the fleet simulator against a measured sweep: calibrate it from the run, predict, compare.

Calibration, from the same run:
- draft step per mode: the edge's cost model (`/healthz` cost_model.t_draft_ms, an EWMA of forward +
  sampling + scoring, recorded after each mode's requests), median over RTTs; it includes the verifier,
  so `verifier_ms` is 0;
- target forward t(b, n): fitted (sim.fleet.costs.fit_forward_model) to the cloud's per-call verify_ms
  when the daemon reports them (stats.verify_ms), else to the edge cost model's verify line at each
  (rtt, mode)'s mean block length, plus target mode's median gap between tokens (a 1-token forward)
  and its time to first token less the round trip (a prompt-sized forward);
- prefill: prompt_tokens = mean prompt length; draft_prefill_ms from draft mode's requests (wall time
  less one draft step per token, plus one step): the edge's fixed cost per request;
- rtt from the settings (jitter folded into a shifted gamma); the cloud's default batching window.
Per-mode profiles come from the calls' block_lengths/accepted_lengths at each RTT; degraded requests
are left out (they measured the draft alone), and so are pipelined runs (`--pipeline` other than off). One edge, one
generation per prompt, tokens per generation = the measured mean; compared with
`sim.fleet.result.compare_with_measured` (tolerance 15%).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cloud.server import CloudSettings
from common.spec.modes import mode_of
from sim.fleet.costs import FleetCosts, ForwardModel, ModeProfile, RttModel, fit_forward_model
from sim.fleet.simulation import run_fleet
from sim.fleet.result import compare_with_measured
from sim.sweep.results import pipeline_of
from sim.sweep.settings import SimulateSettings, is_baseline
from sim.sweep.summary import token_gaps_ms

log = logging.getLogger(__name__)

TOLERANCE = 0.15


@dataclass
class Calibration:
    draft_step_ms: dict[str, float]  # per mode
    forward: ForwardModel
    forward_samples: list[tuple[int, float, float]]
    prompt_tokens: int
    draft_prefill_ms: float
    notes: list[str] = field(default_factory=list)


def rtt_model(settings: SimulateSettings, rtt_ms: float) -> RttModel:
    """The link's round trip: 2 x delay plus one jitter draw per direction (sim.link.shaping.DelaySampler)."""
    j = settings.jitter_ms
    if j == 0:
        return RttModel(mean_ms=rtt_ms)
    # one-way extra delay: |N(0, j)| has mean 0.798 j and sd 0.603 j; the Lomax has mean 0.577 j and sd j
    mean, sd = (0.798 * j, 0.603 * j) if settings.jitter_distribution == "normal" else (0.577 * j, j)
    return RttModel(mean_ms=rtt_ms + 2 * mean, jitter_ms=math.sqrt(2) * sd, distribution="gamma", floor_ms=rtt_ms)


def _groups(records: list[dict[str, Any]]) -> dict[tuple[float, str], list[dict[str, Any]]]:
    groups: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in records:
        # A degraded request measured the draft, not the system; a 'mode@policy' method has no fleet
        # profile of its own (the simulator models each mode with its default policy); a pipelined run
        # is not compared (its hit rate is a simulator input, not something calibrated here).
        if not r["degraded"] and "@" not in r["mode"] and pipeline_of(r) == "off" and not is_baseline(r["mode"]):
            groups.setdefault((r["rtt_ms"], r["mode"]), []).append(r)
    return groups


def _stats(record: dict[str, Any]) -> dict[str, Any]:
    return record["sprinter"].get("stats", {})


def _mean_block(group: list[dict[str, Any]]) -> float | None:
    """Mean draft tokens per call over the group's calls (per-call records, else the per-request means)."""
    blocks = [g for r in group for g in _stats(r).get("block_lengths") or []]
    if blocks:
        return sum(blocks) / len(blocks)
    weighted = [(r["sprinter"]["block_length_mean"], r["sprinter"].get("target_calls") or 0) for r in group
                if r["sprinter"].get("block_length_mean")]
    calls = sum(c for _, c in weighted)
    return sum(g * c for g, c in weighted) / calls if calls else None


def calibrate(settings: SimulateSettings, records: list[dict[str, Any]],
              snapshots: list[dict[str, Any]]) -> Calibration:
    notes: list[str] = []
    groups = _groups(records)
    drafts: dict[str, list[float]] = {}
    for snap in snapshots:
        cm = snap.get("cost_model") or {}
        if mode_of(snap["mode"]).drafts and cm.get("draft_steps_observed"):
            drafts.setdefault(snap["mode"], []).append(cm["t_draft_ms"])
    if not drafts:
        raise ValueError("no draft step timings (OUT/cost_model.jsonl is empty or holds target mode only)")
    draft_step = {mode: statistics.median(v) for mode, v in drafts.items()}

    samples: list[tuple[int, float, float]] = []
    per_call = [(g, v) for rs in groups.values() for r in rs
                for g, v in zip(_stats(r).get("block_lengths") or [], _stats(r).get("verify_ms") or [])]
    if per_call:
        samples += [(1, g + 1, v) for g, v in per_call]  # the forward runs the block and the previous next token
        notes.append(f"verify time: fitted to {len(per_call)} per-call cloud verify_ms")
    else:
        for snap in snapshots:
            cm = snap.get("cost_model") or {}
            g = _mean_block(groups.get((snap["rtt_ms"], snap["mode"]), []))
            if mode_of(snap["mode"]).speculative and cm.get("round_trips_observed") and g:
                samples.append((1, g + 1, cm["t_verify_base_ms"] + cm["t_verify_per_token_ms"] * g))
        notes.append(f"verify time: the edge cost model's verify line (an EWMA of the cloud's verify_ms) at "
                     f"{len(samples)} (rtt, mode) mean block lengths; the daemon reports no per-call verify_ms")
    target_gaps = [g for (_, mode), rs in groups.items() if mode_of(mode).reference for r in rs for g in token_gaps_ms(r)]
    if target_gaps:
        samples.append((1, 1, statistics.median(target_gaps)))
        notes.append("1-token forward: target mode's median gap between tokens")
    # target mode's first forward carries the whole prompt: its time to first token, less the round
    # trip, measures a prompt-sized forward (without it, prefill is extrapolated from short blocks)
    prefills = [(1, r["prompt_tokens"], max(0.0, _stats(r)["ttft_ms"] - rtt_model(settings, rtt).mean_ms))
                for (rtt, mode), rs in groups.items() if mode_of(mode).reference for r in rs
                if r.get("prompt_tokens") and _stats(r).get("ttft_ms") is not None]
    if prefills:
        samples += prefills
        notes.append("prompt-sized forward: target mode's time to first token less the round trip")
    if not samples:
        raise ValueError("no verify timings to calibrate the target forward from")
    forward = fit_forward_model(samples)

    prompt_lengths = [r["prompt_tokens"] for rs in groups.values() for r in rs if r.get("prompt_tokens")]
    prompt_tokens = round(statistics.mean(prompt_lengths)) if prompt_lengths else 0
    prefill = 0.0
    draft_runs = [r for (_, mode), rs in groups.items() if not mode_of(mode).uses_cloud for r in rs]
    step = draft_step.get(draft_runs[0]["mode"]) if draft_runs else None
    if step is not None:
        prefill = step + max(0.0, statistics.median(r["wall_ms"] - r["completion_tokens"] * step for r in draft_runs))
    else:
        notes.append("draft prefill not modelled (no draft-mode requests)")
    return Calibration(draft_step, forward, samples, prompt_tokens, prefill, notes)


def _profile(mode: str, group: list[dict[str, Any]], notes: list[str]) -> ModeProfile | None:
    if not mode_of(mode).speculative:  # target and draft: no call record to replay
        return ModeProfile(mode, mode)
    blocks = [g for r in group for g in _stats(r).get("block_lengths") or []]
    accepted = [a for r in group for a in _stats(r).get("accepted_lengths") or []]
    if blocks and len(blocks) == len(accepted):
        return ModeProfile.from_record(mode, blocks, accepted)
    # A daemon without per-call records: one typical call, from the means (coarse, and said so).
    s = group[0]["sprinter"]
    if not s.get("block_length_mean") or not s.get("tokens_per_call"):
        return None
    g = max(1, round(statistics.mean(r["sprinter"]["block_length_mean"] or 1 for r in group)))
    e = min(g + 1, max(1, round(statistics.mean(r["sprinter"]["tokens_per_call"] or 1 for r in group))))
    notes.append(f"{mode}: no per-call record; profile from the mean block ({g}) and tokens per call ({e})")
    return ModeProfile(mode, mode, (g,), (e,))


def predict(settings: SimulateSettings, records: list[dict[str, Any]], calibration: Calibration) -> list[dict[str, Any]]:
    cloud = CloudSettings()
    default_step = statistics.median(calibration.draft_step_ms.values())
    rows = []
    skipped_cloud_drafting = False
    for (rtt, mode), group in sorted(_groups(records).items()):
        if mode_of(mode).cloud_drafts:  # the sweep sees no cloud draft forward to fit; bench capacity fits one
            skipped_cloud_drafting = True
            continue
        profile = _profile(mode, group, calibration.notes)
        if profile is None:
            continue
        tokens = sum(r["completion_tokens"] for r in group)
        calls = sum(int(r["sprinter"].get("target_calls") or 0) for r in group)
        costs = FleetCosts(draft_step_ms=calibration.draft_step_ms.get(mode, default_step), verifier_ms=0.0,
                           forward=calibration.forward, rtt=rtt_model(settings, rtt), window_ms=cloud.batch_window_ms,
                           max_batch=cloud.max_batch, uplink_mbps=settings.bandwidth_mbps,
                           downlink_mbps=settings.bandwidth_mbps, prompt_tokens=calibration.prompt_tokens,
                           draft_prefill_ms=calibration.draft_prefill_ms)
        predicted = run_fleet(costs, profile, 1, 1, settings.seed, tokens_per_request=max(1, round(tokens / len(group))),
                              requests=len(group))
        measured = {"tokens_per_s": tokens / (sum(r["wall_ms"] for r in group) / 1e3),
                    "target_calls_per_token": calls / tokens if tokens else 0.0}
        rows.append({"rtt_ms": rtt, "mode": mode, **compare_with_measured(predicted, measured, TOLERANCE)})
    if skipped_cloud_drafting:
        calibration.notes.append("cloud-sd: not simulated here (the sweep measures no cloud draft forward to fit; "
                                 "`sprinter bench capacity` fits and checks one)")
    return rows


def _cell(row: dict[str, Any], metric: str) -> str:
    v = row.get(metric)
    if not isinstance(v, dict):
        return "- | - | -"
    ok = "yes" if abs(v["rel_error"]) <= TOLERANCE else "**no**"
    return f"{v['measured']:.3f} | {v['predicted']:.3f} | {v['rel_error']:+.1%} ({ok})"


def validation_markdown(calibration: Calibration, rows: list[dict[str, Any]]) -> str:
    f = calibration.forward
    within = sum(r["within_tolerance"] for r in rows)
    lines = [
        "# Fleet simulator vs the measured sweep (1 edge)",
        "",
        f"sim.fleet calibrated from this run and run with one edge per (RTT, mode); errors are "
        f"(predicted - measured) / measured, tolerance {TOLERANCE:.0%}. **{within} of {len(rows)} rows are within "
        f"{TOLERANCE:.0%} on every compared metric.**",
        "",
        "| RTT ms | mode | tokens/s measured | predicted | error | target calls/token measured | predicted | error "
        "| within |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['rtt_ms']:g} | {r['mode']} | {_cell(r, 'tokens_per_s')} | "
                     f"{_cell(r, 'target_calls_per_token')} | {'yes' if r['within_tolerance'] else '**no**'} |")
    steps = ", ".join(f"{m} {v:.1f}" for m, v in sorted(calibration.draft_step_ms.items()))
    lines += [
        "", "## Calibration", "",
        f"- draft step (ms, per mode, from the edge's cost model): {steps}",
        f"- target forward t(b, n) = {f.c0_ms:.1f} + {f.c_tok_ms:.2f} n + {f.c_seq_ms:.2f} b ms, fitted to "
        f"{len(calibration.forward_samples)} samples",
        f"- prompt tokens (mean) {calibration.prompt_tokens}, draft prefill {calibration.draft_prefill_ms:.1f} ms",
        *(f"- {note}" for note in dict.fromkeys(calibration.notes)),
        "- not modelled: loss stalls, HTTP and tokenizer overheads outside the draft-mode prefill estimate",
    ]
    return "\n".join(lines) + "\n"


def validate_fleet(settings: SimulateSettings, records: list[dict[str, Any]]) -> Path:
    """Write OUT/fleet_validation.md (and .json); returns the markdown's path."""
    path = settings.out / "cost_model.jsonl"
    wanted = {float(r) for r in settings.rtt_ms}
    snapshots = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    snapshots = [s for s in snapshots if s["rtt_ms"] in wanted and s["mode"] in settings.modes
                 and s.get("pipeline", "off") == "off"]
    calibration = calibrate(settings, records, snapshots)
    rows = predict(settings, records, calibration)
    out = settings.out / "fleet_validation.md"
    out.write_text(validation_markdown(calibration, rows))
    (settings.out / "fleet_validation.json").write_text(json.dumps(
        {"forward": asdict(calibration.forward), "forward_samples": calibration.forward_samples,
         "draft_step_ms": calibration.draft_step_ms, "prompt_tokens": calibration.prompt_tokens,
         "draft_prefill_ms": calibration.draft_prefill_ms, "notes": calibration.notes, "rows": rows}, indent=1) + "\n")
    log.info("fleet validation: %d of %d rows within %.0f%%", sum(r["within_tolerance"] for r in rows), len(rows),
             TOLERANCE * 100)
    return out
