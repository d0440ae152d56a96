r"""`sprinter fleet simulate`: the fleet-scale discrete-event simulator over a grid of edge and replica counts.

    sprinter fleet simulate --costs costs.json --profiles profiles.json --edges 1,10,100,1000,10000 \
        --replicas 1,4 --out results/fleet
    sprinter fleet simulate --demo --out results/fleet-demo     # illustrative built-in inputs
    sprinter fleet simulate --demo --pipeline off,ahead,send-ahead --hit-rate 0.5 --out results/fleet-pipeline

N edges (1 to 10,000) share M cloud replicas; each edge drafts, sends its block, waits for the
replica's batched target forward and emits, one cloud call per round, with (block length, emitted)
pairs drawn from the mode's recorded profile (the model: sim.fleet.simulation; the inputs:
sim.fleet.costs). Modes: target (the cloud streams, one forward per token), cloud-sd (the cloud drafts
with its own draft and verifies, both on the replica, and streams: sim.fleet.cloud_rounds; costs need
draft_forward), sd, sd-block, sprinter, sprinter-exact (the edge drafts) and draft (no cloud).
OUT gets results.jsonl, table.md, three plots, and the inputs that were used (costs.json,
profiles.json); with --measured, comparison.json. --pipeline models the edge drafting ahead while a
block is in flight (ahead) and sending candidates for the likeliest verdicts (send-ahead):
sim.fleet.pipeline says how, and how the default hit rate is derived from a profile (an assumption).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from common.arguments import ints, names
from common.spec.modes import PIPELINES
from sim.fleet.replicas import ROUTINGS

if TYPE_CHECKING:  # the simulator loads numpy: its modules are imported by the run, not by --help
    from sim.fleet.costs import FleetCosts, ModeProfile
    from sim.fleet.pipeline import PipelineModel
    from sim.fleet.result import FleetResult

log = logging.getLogger(__name__)


def register(programs: argparse._SubParsersAction) -> None:
    """Adds `simulate` to `sprinter fleet` (entry-point group sprinter.fleet_commands)."""
    p = programs.add_parser("simulate", help="fleet-scale discrete-event simulator: N edges, M cloud replicas",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--costs", type=Path, help="FleetCosts JSON (default with --demo: illustrative built-in)")
    p.add_argument("--profiles", type=Path, help="mode profiles JSON (default with --demo: illustrative built-in)")
    p.add_argument("--demo", action="store_true", help="use the built-in ILLUSTRATIVE costs/profiles for what is not given")
    p.add_argument("--modes", type=names, help="comma-separated profile names to run (default: all)")
    p.add_argument("--edges", type=ints, default=(1, 10, 100, 1000, 10000))
    p.add_argument("--replicas", type=ints, default=(1, 4))
    p.add_argument("--tokens-per-request", type=int, default=128)
    p.add_argument("--requests", type=int, default=1, help="generations per edge, back to back")
    p.add_argument("--duration-s", type=float, help="instead of --requests: simulated seconds")
    p.add_argument("--routing", choices=ROUTINGS, default="least-loaded")
    p.add_argument("--start-spread-ms", type=float, default=0.0)
    p.add_argument("--pipeline", type=names, default=("off",),
                   help=f"comma-separated edge pipelines of {','.join(PIPELINES)} (default off); sd, sd-block and "
                        "sprinter-exact run with each, the other modes once, off")
    p.add_argument("--hit-rate", type=float,
                   help="probability that a verdict picks the block drafted ahead (default: derived from each "
                        "profile's acceptance, see sim.fleet.pipeline; 0.3 ahead, 0.5 send-ahead without one)")
    p.add_argument("--candidates", type=int, default=3, help="send-ahead's candidates per block in flight (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--measured", type=Path, help="JSON list of measured rows to compare (writes comparison.json)")
    p.add_argument("--out", type=Path, default=Path("results/fleet"))
    # Missing inputs are a usage error: exit 2 with the usage, as argparse does.
    p.set_defaults(run=functools.partial(run, fail=p.error))


def pipeline_models(args: argparse.Namespace) -> list[PipelineModel]:
    """--pipeline, --hit-rate, --candidates as the engine's settings (ValueError naming what is wrong)."""
    from sim.fleet.pipeline import PipelineModel
    return [PipelineModel(name, args.hit_rate, args.candidates) for name in dict.fromkeys(args.pipeline)]


def load_inputs(args: argparse.Namespace) -> tuple[FleetCosts, list[ModeProfile]]:
    """The costs and profiles given, the illustrative built-ins for those not given; --modes filters."""
    from sim.fleet.costs import FleetCosts, demo_costs, demo_profiles, profiles_from_json
    costs = FleetCosts.from_json(args.costs.read_text()) if args.costs else demo_costs()
    profiles = profiles_from_json(args.profiles.read_text()) if args.profiles else demo_profiles()
    if args.modes:
        profiles = [p for p in profiles if p.name in args.modes]
    return costs, profiles


def report_header(args: argparse.Namespace, costs: FleetCosts, illustrative: bool) -> str:
    header = ("**ILLUSTRATIVE inputs** (built-in; see costs.json / profiles.json notes), not measured.\n"
              if illustrative else "")
    return header + (f"Fleet simulation, seed {args.seed}, {args.tokens_per_request} tokens per generation, "
                     + (f"{args.duration_s} s simulated" if args.duration_s else f"{args.requests} generation(s) per edge")
                     + f", routing {args.routing}, batching window {costs.window_ms} ms, max batch {costs.max_batch}"
                     + pipeline_note(args) + ".")


def pipeline_note(args: argparse.Namespace) -> str:
    if args.pipeline == ("off",):
        return ""
    hit_rate = f"{args.hit_rate:g}" if args.hit_rate is not None else "derived from each profile (ASSUMED: sim.fleet.pipeline)"
    return f", pipelines {','.join(args.pipeline)} with hit rate {hit_rate} and {args.candidates} candidates per round (send-ahead)"


def print_comparison(results: list[FleetResult], measured: Path, out: Path) -> None:
    from sim.fleet.result import compare_all
    comparison = compare_all(results, json.loads(measured.read_text()))
    (out / "comparison.json").write_text(json.dumps(comparison, indent=1) + "\n")
    for row in comparison:
        print(f"{row['profile']} N={row['edges']}: within 15%: {row['within_tolerance']}  "
              + "  ".join(f"{k} {v['rel_error']:+.1%}" for k, v in row.items() if isinstance(v, dict)))


def run(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> int:
    from sim.fleet.costs import profiles_to_json
    from sim.fleet.report import format_table, sweep, write_report

    if not args.demo and (args.costs is None or args.profiles is None):
        fail("give --costs and --profiles, or --demo for the illustrative built-in inputs")
    try:
        pipelines = pipeline_models(args)
    except ValueError as err:
        fail(str(err))
    costs, profiles = load_inputs(args)
    if costs.draft_forward is None and any(p.traits.cloud_drafts for p in profiles):
        fail("--costs has no draft_forward, which mode cloud-sd needs (the cloud's draft step time model); "
             "add it or leave cloud-sd out with --modes")
    illustrative = args.costs is None or args.profiles is None
    if illustrative:
        log.warning("using ILLUSTRATIVE built-in inputs (derived from measured figures, not a measurement)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "costs.json").write_text(costs.to_json() + "\n")  # the inputs travel with the results
    (args.out / "profiles.json").write_text(profiles_to_json(profiles) + "\n")
    for p in profiles:
        log.info("%s: tokens/call %s", p.name, "-" if p.tokens_per_call is None else f"{p.tokens_per_call:.2f}")

    results = sweep(costs, profiles, list(args.edges), list(args.replicas), args.seed,
                    tokens_per_request=args.tokens_per_request, requests=args.requests,
                    duration_s=args.duration_s, routing=args.routing, start_spread_ms=args.start_spread_ms,
                    pipelines=pipelines)
    write_report(results, args.out, report_header(args, costs, illustrative),
                 "ILLUSTRATIVE inputs (not measured)" if illustrative else "")
    print(format_table(results))
    if args.measured:
        print_comparison(results, args.measured, args.out)
    print(f"\nwrote {args.out}/results.jsonl, table.md, tokens_per_s.png, itl_p99.png, cloud_utilisation.png")
    return 0
