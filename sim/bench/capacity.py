"""bench capacity: should the devices draft, or should the cloud? Edges per replica, each mode, one core.

    sprinter bench capacity --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --edges 1,2,4,8 --rtts 0,50 \
        --out results/bench-capacity

Edge drafting's gain is capacity: the cloud spends no compute on drafting, so one replica serves about
(1 + gamma t_d / t_v)x more clients (gamma: draft tokens per round; t_d: the cloud's draft forward; t_v: the
target's verify forward). One replica (`sprinter cloud serve --draft D`, pinned to one core, OMP_NUM_THREADS=1)
serves E concurrent synthetic edges, which run in this process on the other cores and cost almost no CPU:
  target          a Generate stream each, a token a chunk
  cloud-sd        a Generate stream with a speculation of k: the cloud drafts and block-verifies, a round a chunk
  sd-block        a Session each, replaying the rounds cloud-sd recorded (below): the cloud only verifies
  sprinter-exact  as sd-block, each block cut after its first rejected token: an ideal verifier's flags, NOT the
                  learned verifier's goodput policy (an approximation: its best case, shorter blocks, the same
                  acceptance)
Greedy decoding. The rounds replayed are recorded first, from cloud-sd itself on the bench prompts (one
generation each, all at once): the same draft, greedy, on the same context, drafts what an edge's draft
would, so a replayed block is the real one. A round records the tokens kept and the count drafted; the
replayed block is the accepted tokens, then one token other than the target's (the rejected draft token
itself is not on the wire), padded to the count drafted: the same verify work and the same verdict.
`diverged_rounds` counts verdicts that were not the recorded ones (batched numerics; bfloat16).
The replaying edges draft in no time unless `--edge-draft-ms` says how long a draft token takes on the device
(they then wait that long per block token before each verify): with 0, their tokens/s per user and ITL are an
edge with an instant draft's, and the figure they are fair for is the replica's capacity, what the cloud spends.
RTT: a Session edge sleeps RTT/2 before each frame and RTT/2 after each answer; a Generate edge pays one RTT
before its request (the chunks then stream). The ITL is per token (sim/bench/capacity_report.py: a release's
gap spread over its tokens); per-user tokens/s is an edge's tokens over its wall time (first request to last
token, prompt prefill included), the mean over edges. `--itl-p99-ms` (default 2.5x target's single-edge
ITL p99, so what a user accepts is at least 40% of an idle replica's target streaming speed) sets the
edges-per-replica figure: the largest E at RTT 0 whose ITL p99 is within it.

Writes OUT/results.json (sim/bench/run_folder.py: date, machine, commit, settings, then "itl_p99_target_ms",
"itl_p99_target_basis", "capacity" {mode: edges or null}, "prediction", "recorded" {"prompts", "rounds",
"tokens_per_round", "acceptance", "per_prompt": each prompt's length and rounds [kept, drafted]}, "rows": one per
(mode, edges, rtt_ms) with the ITL percentiles, tokens/s per user and in total, tokens/drafted per round,
acceptance, verify_ms_by_batch (session modes: the verdicts' verify_ms by cloud batch size),
draft_ms_per_token_seen (cloud-sd: chunk draft_ms / drafted), "cloud" (the replica's metrics over the point:
target forwards, mean ms, batch and tokens; draft forwards, mean ms, mean draft steps per forward),
cloud_cpu_share (the share of its core the replica got: below 1 when other load took some) and
edges_cpu_share); table.md; tokens_per_s_per_user.png. While it runs, OUT/rows.partial.json holds the rows
measured so far. Then the fleet simulator fitted to the run, checked against it and projected to
`--project-edges` x `--project-rtts` (sim/bench/capacity_projection.py): results.json's "projection", the
table's second part, projection.png. `--measured OUT/results.json` projects an earlier run again (other edges,
RTTs), measuring nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc

from common import wire
from common.spec.modes import CLOUD_DRAFTING, Mode, mode_of
from common.sampling.distributions import SamplingParams
from sim.bench.capacity_projection import format_projection, plot_projection, project
from sim.bench.capacity_report import (GenerationTrace, edges_per_replica, format_table, itl_target, plot, prediction,
                                      replayed_length, summarise)
from sim.bench.load_phase import Phase
from sim.bench.prompts import bench_prompt_ids
from sim.bench.run_folder import RunFolder
from sim.bench.settings.capacity import BenchSettingsError, CapacityBenchSettings
from sim.cloud_under_test import CloudUnderTest, replicas_started
from sim.cores import CorePlan, my_cores
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
ITL_FACTOR = 2.5  # the default ITL p99 target, over target mode's at one edge


@dataclass(frozen=True)
class RecordedRound:
    kept: list[int]  # the accepted draft tokens and the target's token after them
    drafted: int


@dataclass(frozen=True)
class Recorded:
    prompt_ids: list[int]
    rounds: list[RecordedRound]


def check_modes(modes: tuple[str, ...]) -> dict[str, Mode]:
    """The modes the bench can run: the reference (Generate), cloud drafting (Generate with a speculation) and the
    lossless edge-drafting modes (Sessions replaying blocks); anything else refused, by name."""
    records = {}
    for name in modes:
        mode = mode_of(name)
        if not (mode.reference or mode.cloud_drafts or mode.placeable):
            raise BenchSettingsError(f"--modes: {name} is neither the target alone, cloud drafting nor a lossless "
                                     "edge-drafting mode; bench capacity cannot run it")
        records[name] = mode
    return records


def replay_block(recorded: RecordedRound, vocab_size: int, cut_at_rejection: bool) -> list[int]:
    """The block an edge sends for a recorded round (module docstring); cut after the rejected token on request."""
    accepted, target_token = recorded.kept[:-1], recorded.kept[-1]
    rejected = target_token + 1 if target_token + 1 < vocab_size else target_token - 1
    length = replayed_length(len(recorded.kept), recorded.drafted, cut_at_rejection)
    return (accepted + [rejected] * length)[:length]  # all accepted: the target's token is the bonus one


async def _generate(stub: pb_grpc.TargetServiceStub, prompt: Recorded, max_new: int, rtt_s: float,
                    speculate: int | None) -> GenerationTrace:
    trace = GenerationTrace(time.perf_counter())
    await asyncio.sleep(rtt_s)  # the request's round trip; the chunks then stream
    call = stub.Generate(wire.generate_request(prompt.prompt_ids, SamplingParams(), max_new, speculate_block=speculate))
    async for chunk in call:
        if chunk.token_ids:
            trace.releases.append((time.perf_counter(), len(chunk.token_ids)))
            if speculate is not None:
                trace.drafted.append(chunk.drafted)
                trace.draft_ms.append(chunk.draft_ms)
    return trace


async def _round_trip(call: Any, frame: Any, rtt_s: float) -> Any:
    await asyncio.sleep(rtt_s / 2)
    await call.write(frame)
    answer = await call.read()
    await asyncio.sleep(rtt_s / 2)
    return answer


async def _session(stub: pb_grpc.TargetServiceStub, prompt: Recorded, rtt_s: float, mode: Mode,
                   vocab_size: int, edge_draft_s: float) -> GenerationTrace:
    trace = GenerationTrace(time.perf_counter())
    call = stub.Session()
    answer = await _round_trip(call, wire.open_frame(prompt.prompt_ids), rtt_s)
    if answer.WhichOneof("frame") != "opened":
        raise RuntimeError(f"cloud refused the session: {answer}")
    length = answer.opened.context_length
    for recorded in prompt.rounds:
        block = replay_block(recorded, vocab_size, cut_at_rejection=mode.uses_verifier)
        await asyncio.sleep(len(block) * edge_draft_s)  # the edge's drafting, as long as it is said to take
        frame = await _round_trip(call, wire.verify_frame(wire.verify_block(length, block, mode.verify_method)), rtt_s)
        if frame.WhichOneof("frame") != "verdict":
            raise RuntimeError(f"cloud refused a replayed block: {frame}")
        verdict = frame.verdict
        kept = list(block[:verdict.n_accepted]) + [verdict.next_token]
        trace.diverged += kept[:len(recorded.kept)] != recorded.kept
        trace.releases.append((time.perf_counter(), min(len(kept), len(recorded.kept))))
        trace.drafted.append(len(block))
        trace.verify_ms.setdefault(verdict.cloud_batch_size, []).append(verdict.verify_ms)
        length = verdict.context_length
    await call.write(wire.close_frame())
    await call.done_writing()
    await call.code()
    return trace


async def _edge(stub: pb_grpc.TargetServiceStub, settings: CapacityBenchSettings, mode: Mode, edge: int, rtt_ms: float,
                prompts: list[Recorded], vocab_size: int) -> list[GenerationTrace]:
    """One synthetic edge: `settings.generations` generations back to back, on the prompts from its own offset."""
    traces = []
    for g in range(settings.generations):
        prompt = prompts[(edge + g) % len(prompts)]
        if mode.drafts:
            traces.append(await _session(stub, prompt, rtt_ms / 1e3, mode, vocab_size, settings.edge_draft_ms / 1e3))
        else:
            max_new = sum(len(r.kept) for r in prompt.rounds)  # the recorded generation's length
            traces.append(await _generate(stub, prompt, max_new, rtt_ms / 1e3,
                                          settings.k if mode.cloud_drafts else None))
    return traces


async def _point(address: str, settings: CapacityBenchSettings, mode: Mode, edges: int, rtt_ms: float,
                 prompts: list[Recorded], vocab_size: int) -> list[list[GenerationTrace]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TargetServiceStub(channel)
        return list(await asyncio.gather(*(_edge(stub, settings, mode, e, rtt_ms, prompts, vocab_size)
                                           for e in range(edges))))


async def record(address: str, prompt_ids: list[list[int]], k: int, max_new: int) -> list[Recorded]:
    """cloud-sd's rounds on each prompt, all at once (module docstring)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TargetServiceStub(channel)

        async def one(ids: list[int]) -> Recorded:
            call = stub.Generate(wire.generate_request(ids, SamplingParams(), max_new, speculate_block=k))
            return Recorded(ids, [RecordedRound(list(c.token_ids), c.drafted) async for c in call if c.token_ids])
        return list(await asyncio.gather(*(one(ids) for ids in prompt_ids)))


def core_plan(settings: CapacityBenchSettings) -> CorePlan:
    """The replica on one core of this process's (`--cloud-cpu`, default the last), the edges on the others."""
    mine = my_cores()
    cloud = settings.cloud_cpu if settings.cloud_cpu is not None else mine[-1]
    if cloud not in mine:
        raise BenchSettingsError(f"--cloud-cpu {cloud} is not among this process's cores {mine}")
    return CorePlan(frozenset({cloud}), frozenset(mine) - {cloud} or frozenset(mine))


def _cloud(settings: CapacityBenchSettings) -> CloudUnderTest:
    most = max(settings.edges) + 4
    return CloudUnderTest(settings.target, settings.dtype, {
        "draft": settings.draft, "max_batch": max(most, 8), "max_sessions": 2 * most, "edge_max_generate": most,
        "max_block": max(settings.k, 1), "batch_window_ms": settings.batch_window_ms}, metrics=True)


def _measure(settings: CapacityBenchSettings, modes: dict[str, Mode]) -> tuple[list[dict], list[Recorded]]:
    prompt_ids, tokenizer = bench_prompt_ids(settings.target)
    plan, rows = core_plan(settings), []
    with plan.edge_here(), replicas_started(_cloud(settings), settings.out, "cloud",
                                                             [plan.cloud]) as (replica,):
        recorded = asyncio.run(record(replica.address, prompt_ids, settings.k, settings.max_new_tokens))
        # modes innermost: load from outside the replica's core (a shared machine) drifts over minutes, and
        # the modes compared at one (RTT, E) should share what drift there is
        for rtt_ms in settings.rtts:
            for edges in settings.edges:
                for name, mode in modes.items():
                    phase = Phase.start([replica])
                    per_edge = asyncio.run(_point(replica.address, settings, mode, edges, rtt_ms, recorded,
                                                  len(tokenizer)))
                    used = phase.end()
                    row = summarise(name, edges, rtt_ms, settings.k, per_edge, used.replicas[0].metrics)
                    # the share of a core the replica got over the point (below 1 when other load took some), and
                    # what the edges (this process) took
                    cloud_cpu = used.replicas[0].cpu_s
                    row["cloud_cpu_share"] = None if cloud_cpu is None else cloud_cpu / row["elapsed_s"]
                    row["edges_cpu_share"] = used.edges_cpu_s / row["elapsed_s"]
                    rows.append(row)
                    # a long run leaves what it has measured so far, should it be stopped
                    (settings.out / "rows.partial.json").write_text(json.dumps(rows, indent=1))
                    log.info("%s E=%d RTT=%g: %.1f tokens/s per user, ITL p99 %.1f ms", name, edges, rtt_ms,
                             row["tokens_per_s_per_user"] or 0, row["itl_ms_p99"] or 0)
    return rows, recorded


def _itl_target(settings: CapacityBenchSettings, rows: list[dict], modes: dict[str, Mode]) -> tuple[float, str]:
    if settings.itl_p99_ms is not None:
        return settings.itl_p99_ms, "--itl-p99-ms"
    reference = next((name for name, mode in modes.items() if mode.reference), None)
    target = itl_target(rows, reference, ITL_FACTOR) if reference else None
    if target is None:
        raise BenchSettingsError("--itl-p99-ms: its default is 2.5x the target-alone mode's ITL p99 at 1 edge and "
                                 "RTT 0; measure that (--modes with it, 1 in --edges, 0 in --rtts) or give a value")
    return target, f"{ITL_FACTOR:g}x {reference}'s single-edge ITL p99"


def _write_projected(settings: CapacityBenchSettings, folder: RunFolder, report: dict[str, Any], table: str) -> str:
    """The projection of `report` (a results.json) added to it; results.json, table.md and the plots written."""
    lengths = None if "per_prompt" in report["recorded"] else [
        len(ids) for ids in bench_prompt_ids((report.get("settings") or report["args"])["target"])[0]]
    report["projection"] = project(report, list(settings.project_edges), list(settings.project_rtts), lengths)
    table = f"{table}\n\n{format_projection(report['projection'])}"
    folder.results_path.write_text(json.dumps(report, indent=1))
    folder.write_table(table)
    plot(report["rows"], folder.path("tokens_per_s_per_user.png"))
    plot_projection(report["projection"], report["rows"], folder.path("projection.png"))
    return table


def _recorded_summary(recorded: list[Recorded]) -> dict[str, Any]:
    rounds = [r for rec in recorded for r in rec.rounds]
    return {"prompts": len(recorded), "rounds": len(rounds),
            "tokens_per_round": sum(len(r.kept) for r in rounds) / max(1, len(rounds)),
            "acceptance": sum(len(r.kept) - 1 for r in rounds) / max(1, sum(r.drafted for r in rounds)),
            "per_prompt": [{"prompt_tokens": len(rec.prompt_ids), "rounds": [[len(r.kept), r.drafted] for r in rec.rounds]}
                           for rec in recorded]}


def bench_capacity(settings: CapacityBenchSettings) -> str:
    """Every mode x RTT x edge count on one pinned replica, then the projection; writes OUT, returns the table.
    With `settings.measured`, an earlier run's results projected again (its own settings kept)."""
    folder = RunFolder(settings.out)
    if settings.measured is not None:
        earlier = json.loads(settings.measured.read_text())
        report = earlier | {"measured_from": str(settings.measured)}
        return _write_projected(settings, folder, report, format_table(earlier["rows"], earlier))
    modes = check_modes(settings.modes)
    rows, recorded = _measure(settings, modes)
    order = list(modes)
    rows.sort(key=lambda r: (order.index(r["mode"]), r["rtt_ms"], r["edges"]))
    itl_p99_ms, basis = _itl_target(settings, rows, modes)
    edge_mode = next((n for n, m in modes.items() if m.placeable and not m.uses_verifier), None)
    summary = {"itl_p99_target_ms": itl_p99_ms, "itl_p99_target_basis": basis,
               "capacity": {name: edges_per_replica(rows, name, itl_p99_ms) for name in modes},
               "edge_draft_ms": settings.edge_draft_ms,
               "prediction": prediction(rows, CLOUD_DRAFTING, edge_mode or "", itl_p99_ms),
               "recorded": _recorded_summary(recorded)}
    # the measurement first, whatever the projection makes of it
    report = folder.write_results(settings, **summary, rows=rows)
    folder.path("rows.partial.json").unlink(missing_ok=True)
    return _write_projected(settings, folder, report, format_table(rows, summary))
