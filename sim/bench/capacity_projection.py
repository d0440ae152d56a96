"""bench capacity's projection: the fleet simulator fitted to one capacity run, checked against it, then projected.

    sprinter bench capacity ... --out OUT                  measures, then projects (results.json's "projection")
    sprinter bench capacity --measured OUT/results.json --out OUT2     projects an earlier run again, measures nothing

The fit (`fit_costs`), from the run's own figures only:
  target forward  t(b, n) = c0 + c_tok n + c_seq b (sim.fleet.costs.fit_forward_model) over every row's replica
                  metrics (mean batch b, mean tokens n, mean ms per target forward) and every Session row's verdicts
                  (median verify ms by batch b, n = b x (the row's drafted per round + 1): a block and the token before)
  draft forward   the same over the cloud-drafting rows' draft metrics: per draft forward, b = (draft steps + the
                  generations' prompts) and n = (draft steps + their prompt tokens), since each generation's prompt
                  is a draft request too (the mean of a linear cost is the cost of the means)
  the rest        the replaying edges' draft time per block token (`--edge-draft-ms`), the run's batch window (the
                  cloud's default: 0, continuous) and --max-batch, the prompts' mean length as the prefill.
Profiles (`profiles`): the rounds cloud-sd recorded (tokens kept, drafted), replayed as the bench replays them:
cloud-sd and sd-block the recorded rounds as they are, sprinter-exact each block cut after its rejected token
(sim/bench/capacity_report.py replayed_length), target one token a call. A results.json from before the rounds
were written out holds only their means: its profiles are then SYNTHESIZED (k drafted a round, each token kept
with the probability that gives the recorded tokens per round) and say so (`rounds_basis`).

The check (`check`): every measured point (mode, E, RTT) simulated with the prompts its edges ran (edge e's
generation g is prompt (e + g) mod P) beside the measured per-user tokens/s and per-token ITL p99, and the edges
per replica that the simulated points give against the measured ones (E within the run's list, RTT 0).
The projection (sim.fleet.capacity.project_capacity, ITL per token as the bench measures it): per-user tokens/s
by E and the edges per replica at the run's ITL p99 target for each RTT, the replica's --max-batch set as the
bench sets it for the largest E projected (max E + 4); the formula 1 + gamma t_d / t_v beside the simulated
ratio and, where the run measured that RTT, the measured one.
A forward busy share (target and draft forwards' time over the point's time) above 1 means the two kinds ran at
once (a cloud before its draft shared the target's thread): their times then include each other's, and the fit
takes them scaled by the point's core share / busy share (`overlap_scaled`, and the table says so).
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cloud.batcher import MAX_HOLD_S, STRAGGLER_SHARE
from common.spec.modes import mode_of
from common.lab.plots import saved_figure
from common.table_cells import cell
from sim.bench.capacity_report import edges_per_replica, replayed_length
from sim.fleet.capacity import project_capacity
from sim.fleet.costs import FleetCosts, ModeProfile, RttModel, fit_forward_model
from sim.fleet.simulation import run_fleet

log = logging.getLogger(__name__)
SYNTHETIC_CALLS = 400  # rounds in a synthesized record
Round = tuple[int, int]  # (tokens kept, draft tokens drafted)
Sample = tuple[float, float, float]  # (requests, tokens, ms) of a forward
OVERLAP = 1.05  # a busy share above this: the point's forwards overlapped


@dataclass(frozen=True)
class Rounds:
    """The run's recorded cloud-sd rounds: per prompt, its rounds; the prompts' lengths and generation lengths."""

    per_prompt: list[list[Round]]
    prompt_tokens: list[int]
    generation_tokens: float  # the mean over the prompts (each replayed generation has its recorded length)
    basis: str  # "recorded", or how they were synthesized (then per_prompt is one list, not the prompts')

    def of_prompts(self, indices: list[int]) -> list[Round]:
        return [r for i in indices for r in self.per_prompt[i % len(self.per_prompt)]]

    def for_point(self, row: dict[str, Any], generations: int) -> list[Round]:
        """The rounds a measured point's edges replayed: edge e's generation g ran prompt (e + g) mod P. Synthesized
        rounds have no prompts: a point of a mode that replays blocks whole gets rounds synthesized from its own
        tokens and drafted per round; a cut one (sprinter-exact: its drafted count is cut) the run's."""
        if self.basis == "recorded":
            return self.of_prompts([e + g for e in range(row["edges"]) for g in range(generations)])
        if row.get("tokens_per_round") and row.get("drafted_per_round") and not mode_of(row["mode"]).uses_verifier:
            return synthetic_rounds(max(1, round(row["drafted_per_round"])), row["tokens_per_round"])
        return self.per_prompt[0]


def run_settings(results: dict[str, Any]) -> dict[str, Any]:
    """The settings a results.json was measured with ("args" in one written before sim/bench/run_folder.py)."""
    return results.get("settings") or results["args"]


def synthetic_rounds(k: int, tokens_per_round: float, n_calls: int = SYNTHETIC_CALLS) -> list[Round]:
    """k drafted a round, each kept (until the first rejection) with the p that makes the mean tokens per round
    1 + p + ... + p^k equal `tokens_per_round` (bisection), rounded to n_calls rounds."""
    target = min(max(tokens_per_round, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if sum(p ** j for j in range(k + 1)) < target else (lo, p)
    p = (lo + hi) / 2
    probs = [p ** j * (1 - p) for j in range(k)] + [p ** k]  # j accepted tokens
    return [(j + 1, k) for j, q in enumerate(probs) for _ in range(round(q * n_calls))]


def recorded_rounds(results: dict[str, Any], prompt_tokens: list[int] | None = None) -> Rounds:
    """The results' recorded rounds; from an older results.json (means only) synthesized, with `prompt_tokens`
    (the bench prompts' lengths, which it did not write) required."""
    recorded = results["recorded"]
    if "per_prompt" in recorded:
        per_prompt = [[(int(k), int(d)) for k, d in p["rounds"]] for p in recorded["per_prompt"]]
        return Rounds(per_prompt, [int(p["prompt_tokens"]) for p in recorded["per_prompt"]],
                      statistics.fmean(sum(k for k, _ in rounds) for rounds in per_prompt), "recorded")
    if not prompt_tokens:
        raise ValueError("this results.json predates the recorded rounds: the prompts' lengths must be given")
    k, per_round = int(run_settings(results)["k"]), float(recorded["tokens_per_round"])
    basis = (f"SYNTHESIZED: this results.json holds only the recorded rounds' means ({recorded['rounds']} rounds, "
             f"{per_round:.2f} tokens a round); each round drafts k={k}, each token kept until the first rejection with "
             "the probability that gives that mean (the rounds' spread and drafted counts are not the run's); the "
             "check's points each from their own tokens and drafted per round alike")
    length = recorded["rounds"] * per_round / max(1, recorded["prompts"])
    return Rounds([synthetic_rounds(k, per_round)], list(prompt_tokens), length, basis)


def profiles(modes: list[str], rounds: list[Round]) -> dict[str, ModeProfile]:
    """Each mode's calls as the bench makes them from these rounds (module docstring)."""
    out = {}
    for name in modes:
        mode = mode_of(name)
        if mode.reference:
            out[name] = ModeProfile(name, name)
            continue
        blocks = [replayed_length(kept, drafted, cut_at_rejection=mode.uses_verifier) for kept, drafted in rounds]
        out[name] = ModeProfile.from_record(name, blocks, [kept - 1 for kept, _ in rounds])
    return out


def _busy_share(row: dict[str, Any]) -> float | None:
    c = row["cloud"]
    busy = (c["target_forwards"] or 0) * (c["target_forward_ms"] or 0) + (c["draft_forwards"] or 0) * (c["draft_forward_ms"] or 0)
    return busy / (row["elapsed_s"] * 1e3) if row.get("elapsed_s") else None


def overlap_scale(row: dict[str, Any]) -> float:
    """1, or for a point whose forwards overlapped (busy share > 1: draft and target ran at once on the core), the
    core share over the busy share: what a forward's time was its own, the core split evenly between the two."""
    busy = _busy_share(row)
    return (row.get("cloud_cpu_share") or 1.0) / busy if busy and busy > OVERLAP else 1.0


def forward_samples(rows: list[dict[str, Any]], prompt_tokens: float) -> tuple[list[Sample], list[Sample]]:
    """(b, n, ms) of the target's forwards and of the draft's (module docstring), overlapped times scaled."""
    target, draft = [], []
    for row in rows:
        c, scale = row["cloud"], overlap_scale(row)
        if c.get("target_forwards") and c.get("target_forward_ms") and c.get("target_batch_mean"):
            target.append((c["target_batch_mean"], c["target_tokens_mean"], c["target_forward_ms"] * scale))
        per_request = (row.get("drafted_per_round") or 0) + 1
        target += [(int(b), int(b) * per_request, ms * scale) for b, ms in row.get("verify_ms_by_batch", {}).items()]
        if c.get("draft_forwards") and c.get("draft_forward_ms") and c.get("draft_batch_mean"):
            # each generation's prompt goes through the draft too, a request of its own in some forward
            forwards, steps, prompts = c["draft_forwards"], c["draft_batch_mean"] * c["draft_forwards"], row["generations"]
            draft.append(((steps + prompts) / forwards, (steps + prompts * prompt_tokens) / forwards,
                          c["draft_forward_ms"] * scale))
    return target, draft


def fit_costs(results: dict[str, Any], rounds: Rounds) -> tuple[FleetCosts, dict[str, Any]]:
    """The replica's costs fitted to the run, and what they were fitted to."""
    args, rows = run_settings(results), results["rows"]
    prompt_tokens = statistics.fmean(rounds.prompt_tokens)
    target, draft = forward_samples(rows, prompt_tokens)
    if not target:
        raise ValueError("the run has no target forwards to fit (no row with replica metrics or verdicts)")
    costs = FleetCosts(draft_step_ms=float(results.get("edge_draft_ms", args.get("edge_draft_ms", 0.0))),
                       verifier_ms=0.0, forward=fit_forward_model(target),
                       draft_forward=fit_forward_model(draft) if draft else None, rtt=RttModel(0.0),
                       window_ms=float(args.get("batch_window_ms") or 0.0), max_batch=max(max(args["edges"]) + 4, 8),
                       straggler_share=STRAGGLER_SHARE, max_hold_ms=MAX_HOLD_S * 1e3,  # the batcher's own hold
                       prompt_tokens=round(prompt_tokens), note=f"fitted to bench capacity's run of {results.get('date', '?')}")
    point = lambda r: f"{r['mode']} E={r['edges']} RTT={r['rtt_ms']:g}"  # noqa: E731
    return costs, {"target_samples": target, "draft_samples": draft,
                   "forward_busy_share": {point(r): _busy_share(r) for r in rows},
                   "overlap_scaled": {point(r): overlap_scale(r) for r in rows if overlap_scale(r) != 1.0}}


def check(results: dict[str, Any], costs: FleetCosts, rounds: Rounds, seed: int = 0) -> dict[str, Any]:
    """Every measured point simulated with its own prompts (module docstring)."""
    generations, modes = int(run_settings(results)["generations"]), list(run_settings(results)["modes"])
    points, simulated_rows = [], []
    for row in results["rows"]:
        profile = profiles([row["mode"]], rounds.for_point(row, generations))[row["mode"]]
        length = max(1, round(row["tokens"] / row["generations"]))  # the point's own mean generation length
        sim = run_fleet(replace(costs, rtt=RttModel(float(row["rtt_ms"]))), profile, row["edges"], 1, seed,
                        tokens_per_request=length, requests=generations)
        measured, simulated = row["tokens_per_s_per_user"], sim.tokens_per_s_mean
        points.append({"mode": row["mode"], "edges": row["edges"], "rtt_ms": row["rtt_ms"],
                       "measured_tokens_per_s_per_user": measured, "simulated_tokens_per_s_per_user": simulated,
                       "rel_error": simulated / measured - 1 if measured else None,
                       "measured_itl_ms_p99": row["itl_ms_p99"], "simulated_itl_ms_p99": sim.itl_per_token_ms_p99,
                       "measured_target_batch_mean": row["cloud"]["target_batch_mean"],
                       "simulated_target_batch_mean": sim.cloud_batch_size_mean})
        simulated_rows.append({"mode": row["mode"], "edges": row["edges"], "rtt_ms": row["rtt_ms"],
                               "itl_ms_p99": sim.itl_per_token_ms_p99})
    target = results["itl_p99_target_ms"]
    capacity = {m: {"measured": edges_per_replica(results["rows"], m, target),
                    "simulated": edges_per_replica(simulated_rows, m, target)} for m in modes}
    return {"points": points, "edges_per_replica": capacity}


def project(results: dict[str, Any], edges: list[int], rtts_ms: list[float], prompt_tokens: list[int] | None = None,
            seed: int = 0) -> dict[str, Any]:
    """The whole projection of one run (module docstring): JSON-ready."""
    rounds = recorded_rounds(results, prompt_tokens)
    costs, fit = fit_costs(results, rounds)
    modes, generations = list(run_settings(results)["modes"]), int(run_settings(results)["generations"])
    every = list(range(len(rounds.per_prompt)))
    by_mode = profiles(modes, rounds.of_prompts(every))
    if any(p.traits.cloud_drafts for p in by_mode.values()) and costs.draft_forward is None:
        raise ValueError("a cloud-drafting mode was run but no row has the replica's draft forwards to fit")
    itl_target = float(results["itl_p99_target_ms"])
    checked = check(results, costs, rounds, seed)
    wide = replace(costs, max_batch=max(max(edges) + 4, costs.max_batch))
    projection = project_capacity(wide, by_mode, list(edges), list(rtts_ms), itl_target, seed=seed, e_max=max(edges),
                                  tokens_per_request=max(1, round(rounds.generation_tokens)), requests=generations,
                                  itl="per-token")
    for entry in projection["formula"]:
        measured = [edges_per_replica(results["rows"], m, itl_target, entry["rtt_ms"])
                    for m in (entry["edge_label"], entry["cloud_label"])]
        entry["measured"] = measured[0] / measured[1] if all(measured) else None
        # at the most edges projected the replica is saturated: per-user rates stand as the replica's throughputs
        rates = [next(r["tokens_per_s_per_user"][-1] for r in projection["rows"]
                      if r["label"] == label and r["rtt_ms"] == entry["rtt_ms"])
                 for label in (entry["edge_label"], entry["cloud_label"])]
        entry["saturated_throughput"] = rates[0] / rates[1] if rates[1] else None
    return {"rounds_basis": rounds.basis, "costs": costs.to_dict(), "projected_max_batch": wide.max_batch, "fit": fit,
            "profiles": {m: {"tokens_per_call": p.tokens_per_call, "calls": len(p.block_lengths),
                             "block_mean": statistics.fmean(p.block_lengths) if p.block_lengths else None}
                         for m, p in by_mode.items()},
            "check": checked, **projection}


def _model(fwd: dict[str, float] | None) -> str:
    return "-" if fwd is None else f"{fwd['c0_ms']:.1f} + {fwd['c_tok_ms']:.2f} n + {fwd['c_seq_ms']:.2f} b ms"


def _check_table(checked: dict[str, Any]) -> list[str]:
    lines = ["| mode | RTT ms | edges | tokens/s per user: measured | simulated | error | ITL p99 ms: measured | "
             "simulated | target batch: measured | simulated |", "|---" * 10 + "|"]
    for p in checked["points"]:
        lines.append(f"| {p['mode']} | {p['rtt_ms']:g} | {p['edges']} | {cell(p['measured_tokens_per_s_per_user'], '.2f')} | "
                     f"{cell(p['simulated_tokens_per_s_per_user'], '.2f')} | {cell(p['rel_error'], '+.0%')} | "
                     f"{cell(p['measured_itl_ms_p99'])} | {cell(p['simulated_itl_ms_p99'])} | "
                     f"{cell(p['measured_target_batch_mean'], '.2f')} | {cell(p['simulated_target_batch_mean'], '.2f')} |")
    lines += ["", "| mode | edges per replica (RTT 0, E in the run's list): measured | simulated |", "|---|---|---|"]
    lines += [f"| {m} | {c['measured'] or '< 1'} | {c['simulated'] or '< 1'} |" for m, c in checked["edges_per_replica"].items()]
    return lines


def _projection_tables(projection: dict[str, Any]) -> list[str]:
    rows, lines = projection["rows"], []
    labels = list(dict.fromkeys(r["label"] for r in rows))
    for rtt in dict.fromkeys(r["rtt_ms"] for r in rows):
        at = {r["label"]: r for r in rows if r["rtt_ms"] == rtt}
        lines += ["", f"Simulated tokens/s per user, RTT {rtt:g} ms:", "",
                  "| edges | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        for i, e in enumerate(at[labels[0]]["edges"]):
            lines.append(f"| {e} | " + " | ".join(cell(at[m]["tokens_per_s_per_user"][i], ".2f") for m in labels) + " |")
    lines += ["", f"Simulated edges per replica at per-token ITL p99 <= {projection['itl_p99_ms']:.1f} ms:", "",
              "| RTT ms | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for rtt in dict.fromkeys(r["rtt_ms"] for r in rows):
        at = {r["label"]: r["edges_at_itl"] for r in rows if r["rtt_ms"] == rtt}
        shown = lambda e: "< 1" if not e else f">= {e}" if e == projection["e_max"] else str(e)  # noqa: E731
        lines.append(f"| {rtt:g} | " + " | ".join(shown(at[m]) for m in labels) + " |")
    if projection["formula"]:
        lines += ["", "Edge drafting's gain in edges per replica (formula 1 + gamma t_d / t_v at the simulated cloud-sd "
                  "capacity's batch; simulated; measured where the run has the RTT; the simulated throughput ratio at the most "
                  "edges projected, where the replica is saturated):", "",
                  "| RTT ms | edge / cloud | gamma | t_d ms | t_v ms | formula | simulated | measured | saturated |",
                  "|---" * 9 + "|"]
        lines += [f"| {f['rtt_ms']:g} | {f['edge_label']} / {f['cloud_label']} | {f['gamma']:.2f} | {f['t_d_ms']:.1f} | "
                  f"{f['t_v_ms']:.1f} | {f['predicted']:.2f} | {cell(f['simulated'], '.2f')} | {cell(f['measured'], '.2f')} | "
                  f"{cell(f['saturated_throughput'], '.2f')} |" for f in projection["formula"]]
    return lines


def format_projection(projection: dict[str, Any]) -> str:
    costs, fit = projection["costs"], projection["fit"]
    overlapped = {k: v for k, v in fit["forward_busy_share"].items() if v and v > 1.05}
    lines = ["## Projection: the fleet simulator fitted to this run", "",
             f"Target forward {_model(costs['forward'])} ({len(fit['target_samples'])} samples); cloud draft forward "
             f"{_model(costs['draft_forward'])} ({len(fit['draft_samples'])} samples); edge draft "
             f"{costs['draft_step_ms']:g} ms a token; window {costs['window_ms']:g} ms; prompts "
             f"{costs['prompt_tokens']} tokens; --max-batch {projection['projected_max_batch']} projected.",
             f"Rounds: {projection['rounds_basis']}."]
    if overlapped:
        lines.append("Forwards overlapped (busy share > 1: the draft and target ran at once, each time includes the "
                     "other's) at " + ", ".join(f"{k} ({v:.2f})" for k, v in overlapped.items()) + "; the fit took "
                     "their times x core share / busy share.")
    lines += ["", "Check: the run's points simulated (each with its edges' prompts):", ""] + _check_table(projection["check"])
    return "\n".join(lines + _projection_tables(projection))


def plot_projection(projection: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    """Per-user tokens/s against edges per replica, a panel per RTT: simulated lines, the measured points as markers."""
    rtts = list(dict.fromkeys(r["rtt_ms"] for r in projection["rows"]))
    with saved_figure(path, 1, len(rtts), figsize=(4.2 * len(rtts), 4), squeeze=False, sharey=True) as (fig, axes):
        labels = list(dict.fromkeys(r["label"] for r in projection["rows"]))
        colours = {m: f"C{i}" for i, m in enumerate(labels)}
        for ax, rtt in zip(axes[0], rtts):
            for r in (r for r in projection["rows"] if r["rtt_ms"] == rtt):
                ax.plot(r["edges"], r["tokens_per_s_per_user"], color=colours[r["label"]], label=f"{r['label']} (sim)")
                seen = sorted((m["edges"], m["tokens_per_s_per_user"]) for m in rows if m["mode"] == r["label"]
                              and math.isclose(m["rtt_ms"], rtt) and m["tokens_per_s_per_user"])
                if seen:
                    ax.plot(*zip(*seen), "o", color=colours[r["label"]], label=f"{r['label']} (measured)")
            ax.set(xscale="log", xlabel="edges per replica", title=f"RTT {rtt:g} ms")
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].set_ylabel("tokens/s per user")
        axes[0][0].legend(fontsize=7)
