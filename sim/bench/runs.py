"""What each `sprinter bench X` does with its flags (sim/bench/command.py): its settings, then the bench.

A bench's module is imported by its run alone: most load torch, gRPC or ONNX Runtime, which `--help` must not wait for.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from common.lab.results_page import publish_if_asked
from sim.processes import quiet_http_clients
from sim.bench.policy import PolicyBenchSettings
from sim.bench.settings import PlacementBenchSettings

log = logging.getLogger(__name__)


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
