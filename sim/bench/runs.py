"""What each `sprinter bench X` does with its flags (sim/bench/command.py): its settings, then the bench.

A bench's module is imported by its run alone: most load torch, gRPC or ONNX Runtime, which `--help` must not wait for.
"""

from __future__ import annotations

import argparse
import logging
import shlex
from pathlib import Path

from common.lab.results_page import publish_if_asked
from sim.processes import quiet_http_clients
from sim.bench.policy import PolicyBenchSettings
from sim.bench.settings import (CapacityBenchSettings, CloudBenchSettings, DraftBenchSettings, EngineBenchSettings,
                                FleetBenchSettings, LocalBenchSettings, PlacementBenchSettings, PrefillBenchSettings,
                                PrefixBenchSettings, PrefixFleetSettings, RolloutSettings)

log = logging.getLogger(__name__)


def run_local(args: argparse.Namespace) -> int:
    from sim.bench import local
    settings = LocalBenchSettings(
        target=args.target, draft=args.draft, dtype=args.dtype, prompts=args.prompts,
        max_new_tokens=args.max_new_tokens, temperatures=args.temperatures, k=args.k,
        verifier_threshold=args.verifier_threshold, assisted=args.assisted, seed=args.seed, out=args.out)
    return _report(args, local.bench_local(settings), args.out, ("results.json", "table.md", "tokens_per_s.png"))


def run_cloud(args: argparse.Namespace) -> int:
    batching = {"both": (True, False), "on": (True,), "off": (False,)}[args.batching]
    if args.random_weights:
        return _run_engine(args, batching)
    if args.accepted is not None:
        raise SystemExit("sprinter bench cloud: --accepted is for --random-weights (a real target decides)")
    from sim.bench import cloud
    args.out = args.out or Path("results/bench-cloud")
    defaults = CloudBenchSettings()
    settings = CloudBenchSettings(targets=args.targets, edges=args.edges or defaults.edges,
                                  rounds=args.rounds or defaults.rounds, k=args.k,
                                  contexts=args.contexts, batch_window_ms=args.batch_window_ms,
                                  max_batch=args.max_batch, dtype=args.dtype, out=args.out, source=args.source,
                                  engine=args.engine, label=args.label, cpus=args.cpus, batching=batching,
                                  device=args.device)
    return _report(args, cloud.bench_cloud(settings), args.out,
                   ("results.json", "table.md", "verified_tokens_per_s.png"))


def _run_engine(args: argparse.Namespace, batching: tuple[bool, ...]) -> int:
    """`--random-weights`: the engine in-process (sim/bench/engine.py)."""
    from sim.bench import engine
    refused = [flag for flag, given in (("--source", args.source), ("--label", args.label), ("--cpus", args.cpus),
                                        ("--batch-window-ms", args.batch_window_ms is not None),
                                        ("--engine vllm", args.engine != "resident")) if given]
    if refused:
        raise SystemExit(f"sprinter bench cloud: {', '.join(refused)} need a cloud process; --random-weights runs "
                         "the resident engine in this one")
    defaults = EngineBenchSettings()
    settings = EngineBenchSettings(
        targets=args.targets, device=args.device, dtype=args.dtype, edges=args.edges or defaults.edges,
        contexts=defaults.contexts if args.contexts == (0,) else args.contexts, k=args.k,
        rounds=args.rounds or defaults.rounds, warmup=args.warmup, accepted=args.accepted, batching=batching,
        attention=args.attention,
        out=args.out or Path("results/bench-engine"))
    try:
        table = engine.bench_engine(settings)
    except ValueError as err:  # an unknown architecture or device
        raise SystemExit(f"sprinter bench cloud: {err}") from None
    return _report(args, table, settings.out, ("results.json", "table.md", "verified_tokens_per_s.png"))


def run_draft(args: argparse.Namespace) -> int:
    from sim.bench import draft
    settings = DraftBenchSettings(model=args.model, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                                  repeats=args.repeats, rounds=args.rounds, threads=args.threads,
                                  configs=args.configs, out=args.out)
    table, probe = draft.bench_draft(settings)
    probe_line = f"ONNX Runtime CPU MatMul [1,896]x[896,65536] ms by dtype: {probe}"
    return _report(args, f"{table}\n\n{probe_line}", args.out, ("results.json", "table.md"))


def run_policy(args: argparse.Namespace) -> int:
    from sim.bench import policy
    from sim.sweep.report import format_summary
    settings = PolicyBenchSettings(out=args.out, target=args.target, draft=args.draft, mode=args.mode,
                                   policies=args.policies, temperatures=args.temperatures, rtt_ms=args.rtt_ms,
                                   limit=args.limit, max_new_tokens=args.max_new_tokens,
                                   fleet_validation=args.fleet_validation)
    try:  # a bad policy or mode is a usage error, said before any process starts
        settings.sweeps()
    except ValueError as err:
        raise SystemExit(f"sprinter bench policy: {err}") from None
    quiet_http_clients()  # a line per request would bury the progress bar
    tables = [f"T={sweep.temperature:g} (`{sweep.out}`):\n\n{format_summary(sweep.out).strip()}"
              for sweep in policy.bench_policy(settings)]
    return _report(args, "\n\n".join(tables), args.out, ())



def run_prefill(args: argparse.Namespace) -> int:
    from sim.bench import prefill
    settings = PrefillBenchSettings(target=args.target, dtype=args.dtype, sessions=args.sessions,
                                    prompt_tokens=args.prompt_tokens, k=args.k, quiet_s=args.quiet_s,
                                    serve_args=tuple(shlex.split(args.serve_args)),
                                    cloud_pythonpath=args.cloud_pythonpath, out=args.out)
    result = prefill.bench_prefill(settings, args.label)
    return _report(args, f"{prefill.TABLE_HEADER}\n{prefill.format_result(result)}", args.out,
                   ("results.jsonl (appended)",))


def run_prefix(args: argparse.Namespace) -> int:
    from sim.bench import prefix
    settings = PrefixBenchSettings(target=args.target, dtype=args.dtype, history_tokens=args.history_tokens,
                                   answer_tokens=args.answer_tokens, new_tokens=args.new_tokens, edges=args.edges,
                                   rounds=args.rounds, system_tokens=args.system_tokens, choices=args.choices,
                                   kv_budget_mb=args.kv_budget_mb, cloud_cpus=tuple(args.cloud_cpus), out=args.out)
    result = prefix.bench_prefix(settings)
    return _report(args, prefix.format_result(result, settings), args.out, ("results.jsonl (appended)",))


def run_prefix_fleet(args: argparse.Namespace) -> int:
    from sim.bench import prefix_fleet
    quiet_http_clients()  # a line per request would bury the progress
    settings = PrefixFleetSettings(**{name: getattr(args, name) for name in PrefixFleetSettings.__dataclass_fields__})
    result = prefix_fleet.bench_prefix_fleet(settings)
    return _report(args, prefix_fleet.format_result(result, settings), args.out, ("results.json",))


def run_rollout(args: argparse.Namespace) -> int:
    from sim.bench import rollout
    settings = RolloutSettings(args.real_edges, args.simulated_edges, args.rounds, args.draft, args.telemetry_pairs,
                               out=args.out)
    quiet_http_clients()  # a line per request would bury the rounds
    return _report(args, rollout.bench_rollout(settings), settings.out, ("rollout.json", "rollout.png"))


def run_capacity(args: argparse.Namespace) -> int:
    from sim.bench import capacity
    settings = CapacityBenchSettings(**{name: getattr(args, name) for name in CapacityBenchSettings.__dataclass_fields__})
    return _report(args, capacity.bench_capacity(settings), settings.out,
                   ("results.json", "table.md", "tokens_per_s_per_user.png", "projection.png"))


def run_fleet(args: argparse.Namespace) -> int:
    from sim.bench import fleet
    settings = FleetBenchSettings(**{name: getattr(args, name) for name in FleetBenchSettings.__dataclass_fields__})
    return _report(args, fleet.bench_fleet(settings), settings.out, ("fleet.json", "table.md", "projection.png"))


def run_pipeline(args: argparse.Namespace) -> int:
    from sim.bench import pipeline
    table = pipeline.bench_pipeline(args.sweep, args.edges, args.replicas, list(args.rtt_ms), args.tokens_per_request,
                                    args.out)
    return _report(args, table, args.out, ("pipeline.json", "pipeline.png"))


def run_features(args: argparse.Namespace) -> int:
    from sim.bench import features
    settings = features.FeaturesBenchSettings(target=args.target, draft=args.draft, dtype=args.dtype, modes=args.modes,
                                              repeats=args.repeats, max_tokens=args.max_tokens, out=args.out)
    quiet_http_clients()  # a line per request would bury the progress
    return _report(args, features.bench_features(settings), args.out, ("results.json", "table.md"))


def run_uplink(args: argparse.Namespace) -> int:
    from sim.bench import uplink
    settings = uplink.UplinkBenchSettings(target=args.target, draft=args.draft, dtype=args.dtype, rtts_ms=args.rtt_ms,
                                          bandwidth_mbps=args.bandwidth_mbps or None, prompts=args.prompts,
                                          max_tokens=args.max_tokens, k=args.k, temperature=args.temperature,
                                          out=args.out)
    quiet_http_clients()
    return _report(args, uplink.bench_uplink(settings), args.out, ("results.json", "table.md"))


def run_placement(args: argparse.Namespace) -> int:
    from sim.bench import placement
    settings = PlacementBenchSettings(
        target=args.target, draft=args.draft, dtype=args.dtype, rtts_ms=args.rtt_ms, load_rtts_ms=args.load_rtt_ms,
        load_streams=args.load_streams, prompts=args.prompts, max_tokens=args.max_new_tokens, k=args.k,
        mode=args.mode, warmup=args.warmup, mqtt=args.mqtt, out=args.out)
    quiet_http_clients()
    return _report(args, placement.bench_placement(settings), args.out, ("results.json", "table.md", "tokens_per_s.png"))


def run_proposer(args: argparse.Namespace) -> int:
    from sim.bench import proposer
    extra = {"prompts": args.prompts} if args.prompts else {}
    settings = proposer.ProposerBenchSettings(
        target=args.target, draft=args.draft, dtype=args.dtype, draft_runtime=args.draft_runtime, rtt_ms=args.rtt_ms,
        modes=args.modes, proposers=args.proposers, repeats=args.repeats, per_category=args.per_category,
        categories=args.categories, max_tokens=args.max_tokens, k=args.k, suffix_cache=args.suffix_cache == "on",
        out=args.out, temperature=args.temperature, skip_per_category=args.skip_per_category,
        fit_calibration=args.fit_calibration, branch_tokens=args.branch_tokens, **extra)
    quiet_http_clients()
    return _report(args, proposer.bench_proposer(settings), args.out, ("results.json", "table.md", "proposers.png"))


def _report(args: argparse.Namespace, table: str, out: Path, written: tuple[str, ...]) -> int:
    """A bench's ending: its table, the files it wrote into `out`, and with --page the table and its plots in the
    page's section (common/lab/results_page.py)."""
    print(table)
    if written:
        print("\nwrote " + ", ".join(str(out / name) for name in written))
    publish_if_asked(args, table, tuple(out / name for name in written if name.endswith(".png")))
    return 0
