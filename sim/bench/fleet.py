"""bench fleet: E synthetic edges on 1 vs 2 cloud replicas, and the fleet simulator's projection (issue 14).

    OMP_NUM_THREADS=1 sprinter bench fleet --target smollm2-135m --edges 8 --out results/bench-fleet

Layouts (`sprinter cloud serve` processes): `one-core` 1 replica pinned to the first core,
OMP_NUM_THREADS=1; `two-cores` 1 replica unpinned, OMP_NUM_THREADS=2; `two-replicas` one pinned to
each core, OMP_NUM_THREADS=1 each. The edges run in this process, unpinned: generations, each a
CloudSession of one shared ReplicaSet (its real placement), replaying draft blocks recorded as in
`bench cloud`. The verdicts' verify_ms by batch size, fitted, with a draft step and RTT (arguments)
and an sd profile (`demo-sd`: illustrative; `measured`: the replay's) drive sim.fleet over
`--replicas` x `--fleet-edges`, after a check of the simulator against each layout. `--measured
OUT/results.json` projects again from an earlier run's measurements (other assumptions), measuring nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from common import wire
from common.model.loading import vocab_fingerprint
from common.lab.plots import saved_figure
from common.sampling.distributions import SamplingParams
from common.stats import percentile
from common.table_cells import cell
from edge.cloud_link.client import CloudEndpoint
from edge.cloud_link.replicas import ReplicaSet
from sim.bench.cloud import DEFAULT_DRAFTS, RecordedEdge, record_edges
from sim.bench.load_phase import Phase, PhaseUse
from sim.bench.prompts import bench_prompt_ids
from sim.bench.run_folder import RunFolder
from sim.bench.settings.capacity import FleetBenchSettings
from sim.cloud_under_test import CloudUnderTest, RunningCloud, replicas_started
from sim.cores import my_cores
from sim.fleet.costs import FleetCosts, ModeProfile, RttModel, demo_profiles, fit_forward_model
from sim.fleet.simulation import run_fleet
from sim.fleet.report import sweep
from sprinter.v1 import decoding_pb2 as pb

log = logging.getLogger(__name__)
WARMUP = 4  # verifies per edge before the clock starts (a session each: prefill and verify shapes seen)
MEASURED_ARGS = ("target", "draft", "dtype", "edges", "k", "rounds_per_session", "batch_window_ms", "max_batch")


def layout_plan(name: str) -> tuple[list[set[int] | None], int, str]:
    """(each replica's CPU set or None for unpinned, OMP_NUM_THREADS each, a description)."""
    cores = my_cores()
    a, b = cores[0], cores[1 % len(cores)]
    plans = {"one-core": ([{a}], 1, f"1 replica pinned to core {a}"),
             "two-cores": ([None], 2, f"1 replica unpinned (cores {','.join(map(str, cores))})"),
             "two-replicas": ([{a}, {b}], 1, f"2 replicas pinned to cores {a} and {b}")}
    return plans[name]  # KeyError: no such layout


@dataclass
class Calls:
    """Every verify of the measured phase, as the edges saw it."""

    latency_ms: list[float] = field(default_factory=list)  # calls that did not open a session
    overhead_ms: list[float] = field(default_factory=list)  # latency - queue - verify: loopback, gRPC, Python
    forward_ms: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))  # batch size -> verify_ms
    accepted: Counter[int] = field(default_factory=Counter)
    per_replica: Counter[str] = field(default_factory=Counter)
    placements: Counter[str] = field(default_factory=Counter)  # sessions opened on each replica
    open_samples: list[dict[str, int]] = field(default_factory=list)  # ReplicaSet.describe() sessions, at each verdict
    verified: int = 0

    def add(self, verdict: pb.Verdict, latency_ms: float, opened: bool, replica: str, k: int) -> None:
        if opened:
            self.placements[replica] += 1
        else:
            self.latency_ms.append(latency_ms)
            self.overhead_ms.append(latency_ms - verdict.queue_ms - verdict.verify_ms)
        self.forward_ms[verdict.cloud_batch_size].append(verdict.verify_ms)
        self.accepted[verdict.n_accepted] += 1
        self.per_replica[replica] += 1
        self.verified += k


async def run_edge(clouds: ReplicaSet, recorded: list[RecordedEdge], edge: int, rounds: int | None,
                   deadline: float | None, calls: Calls, per_session: int) -> None:
    """One synthetic edge: generations back to back, each replaying one prompt's recorded blocks."""
    done, generation = 0, 0
    while (rounds is None or done < rounds) and (deadline is None or time.perf_counter() < deadline):
        prompt = recorded[(edge + generation) % len(recorded)]
        generation += 1
        session, context = clouds.session(SamplingParams()), list(prompt.prompt_ids)
        try:
            for block in prompt.blocks[:per_session]:
                if (rounds is not None and done >= rounds) or (deadline is not None and time.perf_counter() >= deadline):
                    break
                opens, sent = session.opens, time.perf_counter()
                verdict = await session.verify(context, block, wire.method_value("block"))
                calls.add(verdict, (time.perf_counter() - sent) * 1e3, session.opens != opens,
                          session.client.endpoint.address, len(block))
                context += block[:verdict.n_accepted] + [verdict.next_token]
                calls.open_samples.append({r["address"]: r["sessions"] for r in clouds.describe()})
                done += 1
        finally:
            await session.close()


async def _drive(settings: FleetBenchSettings, replicas: list[RunningCloud], recorded: list[RecordedEdge],
                 fingerprint: str) -> tuple[Calls, PhaseUse]:
    """Warm up, then the measured phase: what the edges saw, and what each replica did."""
    endpoint = lambda address, server_name: CloudEndpoint(address, tls_server_name=server_name)  # noqa: E731
    async with ReplicaSet([r.address for r in replicas], endpoint, fingerprint) as clouds:
        edges = range(settings.edges)
        await asyncio.gather(*(run_edge(clouds, recorded, e, WARMUP, None, Calls(), WARMUP) for e in edges))
        phase, calls = await asyncio.to_thread(Phase.start, replicas), Calls()
        deadline = None if settings.rounds else phase.started + settings.duration_s
        await asyncio.gather(*(run_edge(clouds, recorded, e, settings.rounds, deadline, calls,
                                        settings.rounds_per_session) for e in edges))
        return calls, await asyncio.to_thread(phase.end)


def _cloud_side(used: PhaseUse) -> list[dict]:
    """Each replica over the measured phase, from its metrics' increases and its CPU time."""
    rows = []
    for replica in used.replicas:
        forwards = replica.metrics.get("sprinter_cloud_batch_size_count", 0.0)
        forward_s = replica.metrics.get("sprinter_cloud_target_forward_seconds_sum", 0.0)
        rows.append({"address": replica.address, "forwards": int(forwards),
                     "forward_ms_mean": forward_s * 1e3 / forwards if forwards else None,
                     "cpu_s": None if replica.cpu_s is None else round(replica.cpu_s, 2)})
    return rows


def summarise(settings: FleetBenchSettings, layout: str, calls: Calls, used: PhaseUse) -> dict[str, Any]:
    cpus, threads, pinning = layout_plan(layout)
    emitted = sum((a + 1) * n for a, n in calls.accepted.items())
    n_calls = sum(calls.accepted.values())
    # (b, n, ms) per batch size seen: the median verify_ms, n = b x (k + 1) tokens (padded forward)
    samples = [(b, b * (settings.k + 1), round(statistics.median(ms), 2)) for b, ms in sorted(calls.forward_ms.items())]
    elapsed, cloud_side = used.elapsed_s, _cloud_side(used)
    other_cpu = used.machine_cpu_s - used.edges_cpu_s - sum(c["cpu_s"] or 0.0 for c in cloud_side)
    open_mean = {a: round(statistics.fmean(s.get(a, 0) for s in calls.open_samples), 2)
                 for a in sorted({a for s in calls.open_samples for a in s})}
    return {"layout": layout, "replicas": len(cpus), "pinning": pinning, "omp_threads": threads,
            "edges": settings.edges, "elapsed_s": round(elapsed, 2), "verify_calls": n_calls,
            "verified_tokens_per_s": calls.verified / elapsed, "emitted_tokens_per_s": emitted / elapsed,
            "verify_p50_ms": percentile(calls.latency_ms, 0.5), "verify_p99_ms": percentile(calls.latency_ms, 0.99),
            "overhead_ms_p50": percentile(calls.overhead_ms, 0.5),
            "batch_mean": sum(b * len(ms) for b, ms in calls.forward_ms.items()) / n_calls if n_calls else None,
            "calls_per_replica": dict(calls.per_replica), "sessions_placed": dict(calls.placements),
            "sessions_open_mean": open_mean, "cloud": cloud_side, "edges_cpu_s": round(used.edges_cpu_s, 2),
            "other_cpu_s": round(max(0.0, other_cpu), 2),
            "accepted": {str(a): n for a, n in sorted(calls.accepted.items())},
            "forward_samples": samples, "forward_fit": asdict(fit_forward_model(samples)) if samples else None}


def measure_layout(settings: FleetBenchSettings, layout: str, recorded: list[RecordedEdge], fingerprint: str) -> dict:
    cpus, threads, pinning = layout_plan(layout)
    log.info("layout %s: %s, OMP_NUM_THREADS=%d, %d edges", layout, pinning, threads, settings.edges)
    cloud = CloudUnderTest(settings.target, settings.dtype, {
        "batch_window_ms": settings.batch_window_ms, "max_batch": settings.max_batch,
        "max_sessions": 4 * settings.edges + 8}, threads=threads, metrics=True)
    with replicas_started(cloud, settings.out, f"cloud-{layout}", cpus) as replicas:
        calls, used = asyncio.run(_drive(settings, replicas, recorded, fingerprint))
    return summarise(settings, layout, calls, used)


def project(settings: FleetBenchSettings, rows: list[dict], prompt_tokens: int) -> dict[str, Any]:
    """The simulator checked against each measured layout, then the sweep with a one-core replica's costs."""
    validation, accepted = [], [int(a) for row in rows for a, n in row["accepted"].items() for _ in range(n)]
    # sd with the replay's acceptance (low: after a rejection the blocks go on with the draft's text, not the target's)
    replay = ModeProfile.from_record("sd", [settings.k] * len(accepted), accepted, name="sd (replay acceptance)")
    for row in rows:
        costs = FleetCosts(0.0, 0.0, fit_forward_model(row["forward_samples"]), RttModel(row["overhead_ms_p50"] or 0.0),
                           settings.batch_window_ms, settings.max_batch, padded_batches=False, prompt_tokens=prompt_tokens)
        sim = run_fleet(costs, replay, settings.edges, row["replicas"], duration_s=row["elapsed_s"],
                        tokens_per_request=max(1, round(settings.rounds_per_session * replay.tokens_per_call)))
        validation.append({"layout": row["layout"], "measured_emitted_tokens_per_s": row["emitted_tokens_per_s"],
                           "simulated_emitted_tokens_per_s": sim.fleet_tokens_per_s,
                           "rel_error": sim.fleet_tokens_per_s / row["emitted_tokens_per_s"] - 1})
    # a replica's costs from the one-core run: its core is its own, the edges can run on the other one
    basis = next((r for r in rows if r["layout"] == "one-core"), rows[0])
    overhead = basis["overhead_ms_p50"] or 0.0
    costs = FleetCosts(settings.draft_step_ms, 0.0, fit_forward_model(basis["forward_samples"]),
                       RttModel(settings.rtt_ms + overhead, settings.rtt_jitter_ms), settings.batch_window_ms,
                       settings.max_batch, padded_batches=False, prompt_tokens=prompt_tokens,
                       note=f"forward fitted to the {basis['layout']} run ({basis['pinning']}); draft step "
                            f"{settings.draft_step_ms} ms and RTT {settings.rtt_ms}+-{settings.rtt_jitter_ms} ms "
                            f"assumed, plus {overhead:.1f} ms measured per-call overhead")
    profile = next(p for p in demo_profiles() if p.name == "sd") if settings.profile == "demo-sd" else replay
    results = sweep(costs, [profile], list(settings.fleet_edges), list(settings.replicas), progress=False,
                    tokens_per_request=settings.tokens_per_request, requests=settings.sim_requests)
    return {"costs": costs.to_dict(), "profile": profile.to_dict() | {"tokens_per_call": profile.tokens_per_call},
            "validation": validation, "results": [asdict(r) for r in results]}


def measured_table(rows: list[dict]) -> str:
    base = next((r["verified_tokens_per_s"] for r in rows if r["layout"] == "one-core"), None)
    lines = ["| layout | pinning, OMP threads | verified tokens/s | vs one-core | emitted tokens/s | verify p50 / p99 ms "
             "| batch (per verify) | sessions per replica: placed; open (mean) | verifies per replica "
             "| forward ms per replica | CPU cores used: replicas; edges; other work |", "|---" * 11 + "|"]
    for r in rows:
        clouds, t = r["cloud"], r["elapsed_s"]
        each = lambda values: " / ".join(str(v) for v in values)  # noqa: E731
        per = lambda key: each(r[key].get(c["address"], 0) for c in clouds)  # noqa: E731
        cells = [r["layout"], f"{r['pinning']}, {r['omp_threads']}", cell(r["verified_tokens_per_s"], ",.1f"),
                 f"{r['verified_tokens_per_s'] / base:.2f}x" if base else "-", cell(r["emitted_tokens_per_s"], ",.1f"),
                 f"{cell(r['verify_p50_ms'], ',.0f')} / {cell(r['verify_p99_ms'], ',.0f')}", cell(r["batch_mean"], ",.2f"),
                 f"{per('sessions_placed')}; {per('sessions_open_mean')}", per("calls_per_replica"),
                 each(cell(c["forward_ms_mean"], ",.1f") for c in clouds),
                 f"{each(cell(c['cpu_s'] and c['cpu_s'] / t, ',.2f') for c in clouds)}; {r['edges_cpu_s'] / t:.2f}; "
                 f"{r['other_cpu_s'] / t:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def projection_table(projection: dict, metric: str = "fleet_tokens_per_s", digits: int = 0) -> str:
    results = projection["results"]
    replicas = sorted({r["n_replicas"] for r in results})
    lines = ["| edges \\ replicas | " + " | ".join(map(str, replicas)) + " |", "|---" * (len(replicas) + 1) + "|"]
    for n in sorted({r["n_edges"] for r in results}):
        cells = [next(r[metric] for r in results if r["n_edges"] == n and r["n_replicas"] == m) for m in replicas]
        lines.append(f"| {n} | " + " | ".join(cell(c, f",.{digits}f") for c in cells) + " |")
    return "\n".join(lines)


def report(settings: FleetBenchSettings, rows: list[dict], projection: dict) -> str:
    costs, profile = projection["costs"], projection["profile"]
    fwd = costs["forward"]
    checks = "; ".join(f"{v['layout']} {v['rel_error']:+.0%}" for v in projection["validation"])
    rate = {r["layout"]: r["verified_tokens_per_s"] for r in rows}
    verdict = (f"Two pinned replicas vs one replica on both cores: {rate['two-replicas'] / rate['two-cores']:.2f}x "
               "verified tokens/s. " if {"two-replicas", "two-cores"} <= rate.keys() else "")
    return "\n\n".join([
        f"## Measured: {settings.edges} edges, {settings.target} ({settings.dtype}), k={settings.k}, "
        f"edges in the bench process (unpinned)", measured_table(rows),
        f"{verdict}Simulator vs measured emitted tokens/s (same edges, no draft time, measured overhead as RTT, "
        f"prefill modelled): {checks}.",
        f"## Projection: fleet tokens/s ({profile['name']}, {profile['tokens_per_call']:.2f} tokens/call"
        f"{'; ILLUSTRATIVE profile' if settings.profile == 'demo-sd' else ''})",
        f"A forward of b verifies: {fwd['c0_ms']:.1f} + {fwd['c_tok_ms'] * (settings.k + 1) + fwd['c_seq_ms']:.1f} x b ms. "
        f"{costs['note']}. Each edge runs {settings.sim_requests} generation(s) of {settings.tokens_per_request} tokens, each "
        f"opening with a {costs['prompt_tokens']}-token prefill (unpadded batches: a prefill costs its own tokens); "
        "fleet tokens/s = all tokens / time to the last; least-loaded placement.",
        projection_table(projection), "Tokens/s per edge:", projection_table(projection, "tokens_per_s_mean", 2)])


def plot(projection: dict, path: Path) -> None:
    with saved_figure(path, figsize=(7, 4.5)) as (fig, ax):
        results = projection["results"]
        for m in sorted({r["n_replicas"] for r in results}):
            series = sorted((r for r in results if r["n_replicas"] == m), key=lambda r: r["n_edges"])
            ax.plot([r["n_edges"] for r in series], [r["fleet_tokens_per_s"] for r in series], marker="o",
                    label=f"{m} replica{'s' if m > 1 else ''}")
        ax.set(xscale="log", yscale="log", xlabel="edges", ylabel="fleet tokens/s (simulated)",
               title=f"projection, {projection['profile']['name']}"
                     + (" (illustrative profile)" if projection["profile"]["note"].startswith("ILLUSTRATIVE") else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)


def bench_fleet(settings: FleetBenchSettings) -> str:
    """Every layout measured (or, with `measured`, an earlier run's rows), then the projection; writes OUT."""
    folder = RunFolder(settings.out)
    earlier = json.loads(settings.measured.read_text()) if settings.measured else None
    if earlier:  # the measured configuration, whatever the arguments say
        measured_with = earlier.get("settings") or earlier["args"]
        settings = replace(settings, **{k: measured_with[k] for k in MEASURED_ARGS})
    draft = settings.draft or DEFAULT_DRAFTS.get(settings.target, settings.target)
    load_before = os.getloadavg()
    prompt_ids, tokenizer = bench_prompt_ids(draft)
    prompt_tokens = round(statistics.fmean(len(ids) for ids in prompt_ids))
    if earlier:
        rows = earlier["measured"]
    else:
        recorded = record_edges(settings.target, draft, settings.k, n_tokens=settings.k * settings.rounds_per_session)
        rows = [measure_layout(settings, layout, recorded, vocab_fingerprint(tokenizer)) for layout in settings.layouts]
    projection = project(settings, rows, prompt_tokens)
    folder.write_results(replace(settings, draft=draft), measured_date=earlier["date"] if earlier else None,
                         loadavg=earlier.get("loadavg") if earlier else [load_before, os.getloadavg()],
                         prompt_tokens=prompt_tokens, measured=rows, projection=projection)
    table = folder.write_table(report(settings, rows, projection))
    plot(projection, folder.path("projection.png"))
    return table
