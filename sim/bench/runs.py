"""What each `sprinter bench X` does with its flags (sim/bench/command.py): its settings, then the bench.

A bench's module is imported by its run alone: most load torch, gRPC or ONNX Runtime, which `--help` must not wait for.
"""

from __future__ import annotations

import argparse
import logging
import shlex
from pathlib import Path

from common.results_page import publish_if_asked
from sim.bench.policy import PolicyBenchSettings
from sim.bench.settings import (CloudBenchSettings, DraftBenchSettings, EngineBenchSettings, FleetBenchSettings,
                                LocalBenchSettings, PrefillBenchSettings, RolloutSettings)

log = logging.getLogger(__name__)


def run_local(args: argparse.Namespace) -> int:
    from sim.bench import local
    settings = LocalBenchSettings(
        target=args.target, draft=args.draft, dtype=args.dtype, prompts=args.prompts,
        max_new_tokens=args.max_new_tokens, temperatures=args.temperatures, k=args.k,
        verifier_threshold=args.verifier_threshold, assisted=args.assisted, seed=args.seed, out=args.out)
    table = local.bench_local(settings)
    print(table)
    print(f"\nwrote {args.out}/results.json, table.md, tokens_per_s.png")
    publish_if_asked(args, table, (args.out / "tokens_per_s.png",))
    return 0


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
    table = cloud.bench_cloud(settings)
    print(table)
    print(f"\nwrote {args.out}/results.json, table.md, verified_tokens_per_s.png")
    publish_if_asked(args, table, (args.out / "verified_tokens_per_s.png",))
    return 0


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
    print(table)
    print(f"\nwrote {settings.out}/results.json, table.md, verified_tokens_per_s.png")
    publish_if_asked(args, table, (settings.out / "verified_tokens_per_s.png",))
    return 0


def run_draft(args: argparse.Namespace) -> int:
    from sim.bench import draft
    settings = DraftBenchSettings(model=args.model, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                                  repeats=args.repeats, rounds=args.rounds, threads=args.threads,
                                  configs=args.configs, out=args.out)
    table, probe = draft.bench_draft(settings)
    probe_line = f"ONNX Runtime CPU MatMul [1,896]x[896,65536] ms by dtype: {probe}"
    print(f"{table}\n\n{probe_line}")
    print(f"\nwrote {args.out}/results.json and table.md")
    publish_if_asked(args, f"{table}\n\n{probe_line}")
    return 0


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
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the progress bar
    tables = [f"T={sweep.temperature:g} (`{sweep.out}`):\n\n{format_summary(sweep.out).strip()}"
              for sweep in policy.bench_policy(settings)]
    print("\n\n".join(tables))
    publish_if_asked(args, "\n\n".join(tables))
    return 0



def run_prefill(args: argparse.Namespace) -> int:
    from sim.bench import prefill
    settings = PrefillBenchSettings(target=args.target, dtype=args.dtype, sessions=args.sessions,
                                    prompt_tokens=args.prompt_tokens, k=args.k, quiet_s=args.quiet_s,
                                    serve_args=tuple(shlex.split(args.serve_args)),
                                    cloud_pythonpath=args.cloud_pythonpath, out=args.out)
    result = prefill.bench_prefill(settings, args.label)
    table = f"{prefill.TABLE_HEADER}\n{prefill.format_result(result)}"
    print(table)
    print(f"\nappended to {args.out}/results.jsonl")
    publish_if_asked(args, table)
    return 0


def run_rollout(args: argparse.Namespace) -> int:
    from sim.bench import rollout
    settings = RolloutSettings(args.real_edges, args.simulated_edges, args.rounds, args.draft, args.telemetry_pairs,
                               out=args.out)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the rounds
    table = rollout.bench_rollout(settings)
    print(table)
    print(f"\nwrote {settings.out / 'rollout.json'}, {settings.out / 'rollout.png'}")
    publish_if_asked(args, table, (settings.out / "rollout.png",))
    return 0


def run_fleet(args: argparse.Namespace) -> int:
    from sim.bench import fleet
    settings = FleetBenchSettings(**{name: getattr(args, name) for name in FleetBenchSettings.__dataclass_fields__})
    table = fleet.bench_fleet(settings)
    print(table)
    print(f"\nwrote {settings.out}/fleet.json, table.md, projection.png")
    publish_if_asked(args, table, (settings.out / "projection.png",))
    return 0


def run_pipeline(args: argparse.Namespace) -> int:
    from sim.bench import pipeline
    table = pipeline.bench_pipeline(args.sweep, args.edges, args.replicas, list(args.rtt_ms), args.tokens_per_request,
                                    args.out)
    print(table)
    publish_if_asked(args, table, (args.out / "pipeline.png",))
    return 0


def run_features(args: argparse.Namespace) -> int:
    from sim.bench import features
    settings = features.FeaturesBenchSettings(target=args.target, draft=args.draft, dtype=args.dtype, modes=args.modes,
                                              repeats=args.repeats, max_tokens=args.max_tokens, out=args.out)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the progress
    table = features.bench_features(settings)
    print(table)
    print(f"\nwrote {args.out}/results.json and table.md")
    publish_if_asked(args, table)
    return 0
