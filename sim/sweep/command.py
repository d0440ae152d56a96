"""`sprinter simulate`: the network-latency sweep. Real cloud and edge processes, an emulated link.

    sprinter simulate --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --rtt-ms 0,50,100 --out results/sim

The cloud (`sprinter cloud serve`) and the edge daemon (`sprinter edge serve`) run as separate
processes (pinned to separate cores when there are two), the edge's gRPC channel going through an
emulated link in this process. For each RTT x mode x pipeline x prompt one streamed request goes through the
edge's OpenAI API; then, with both processes stopped, the target judges every output, and OUT gets
summary.csv/md, plots and a fleet-simulator validation. An interrupted sweep resumes where it stopped.
With a fleet plane broker (--mqtt, by default a Mosquitto of its own when installed) the edge's
telemetry and the cloud's load are recorded in OUT/telemetry.jsonl and plotted in OUT/telemetry.png.
A mode that takes a call policy may name one: --modes sprinter-exact@fixed:3,sprinter-exact@goodput.
--pipeline off,ahead,send-ahead (edge/decoding/pipeline.py) measures sd, sd-block and sprinter-exact with each.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from common.arguments import DTYPE_NAMES, floats, names
from common.spec.modes import PROPOSERS
from common.model.devices import DEVICE_HELP
from common.fleet_plane.command import broker_url
from common.lab.results_page import add_page_arguments, publish_if_asked
from sim.processes import quiet_http_clients
from sim.sweep.settings import BASELINES, DEFAULT_MODES, ENGINES, SimulateSettings

log = logging.getLogger(__name__)

# the sweep's plots that go into a docs page with --page (the rest stay in OUT)
PUBLISHED_PLOTS = ("tokens_per_s_vs_rtt", "quality_vs_cloud_cost")


def register(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser(
        "simulate", help="network-latency sweep: real cloud + edge processes over an emulated link",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        # Only flags the user gives land in the namespace, so they override --config and nothing else does.
        argument_default=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, help="JSON object with the same keys as these flags; flags override it")
    p.add_argument("--out", type=Path, help="output directory (results.jsonl, summary.csv/md, plots); required")
    p.add_argument("--target", help="target model spec (default qwen2.5-coder-1.5b)")
    p.add_argument("--draft", help="draft model spec (default qwen2.5-coder-0.5b)")
    p.add_argument("--verifier", help="the edge's --verifier (default auto)")
    p.add_argument("--modes", type=names, help=f"comma-separated (default {','.join(DEFAULT_MODES)})")
    p.add_argument("--baselines", type=names, help=f"what a user would run instead, measured beside the modes on the "
                                                   f"same cores and prompts: any of {', '.join(BASELINES)} (default none)")
    p.add_argument("--engine", choices=ENGINES, help="the cloud's --engine (default resident)")
    p.add_argument("--pipeline", type=names, help="comma-separated edge pipelines of off,ahead,send-ahead (default off); "
                                      "another axis of the sweep for sd, sd-block and sprinter-exact (the other "
                                      "modes run once, off)")
    p.add_argument("--rtt-ms", dest="rtt_ms", type=floats, help="comma-separated round-trip times (default 0,20,50,100,200)")
    p.add_argument("--jitter-ms", dest="jitter_ms", type=float, help="one-way jitter per direction (default 0)")
    p.add_argument("--jitter-distribution", dest="jitter_distribution", choices=["normal", "pareto"])
    p.add_argument("--bandwidth-mbps", dest="bandwidth_mbps", type=float, help="per direction (default unlimited)")
    p.add_argument("--loss", type=float, help="probability of a retransmission stall per chunk (default 0)")
    p.add_argument("--temperature", type=float, help="0 is greedy (default)")
    p.add_argument("--seed", type=int, help="sampling seed of every request (default 0)")
    p.add_argument("--prompts", type=Path, help="JSONL prompt file (default: the shipped set's held-out split)")
    p.add_argument("--limit", type=int, help="prompts, categories interleaved (default 8)")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, help="default 64")
    p.add_argument("--policy", help="the edge's default call policy (default: each mode's own)")
    p.add_argument("--proposer", choices=PROPOSERS, help="what proposes the edge's blocks: model (default), suffix or hybrid")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="of both models (default bfloat16)")
    p.add_argument("--device", help=f"where the cloud's target runs: {DEVICE_HELP}")
    p.add_argument("--threads", type=int, help="intra-op threads per process (default: the cores it may use)")
    p.add_argument("--pin-cpus", dest="pin_cpus", action=argparse.BooleanOptionalAction,
                   help="cloud on one core, edge on another (default on with >= 2 cores)")
    p.add_argument("--fleet-validation", dest="fleet_validation", action=argparse.BooleanOptionalAction,
                   help="calibrate the fleet simulator from this run and compare (default on)")
    p.add_argument("--mqtt", type=_broker_choice, metavar="auto|off|URL",
                   help="fleet plane broker the cloud and edge report to, recorded in OUT/telemetry.jsonl and "
                        "plotted in telemetry.png: auto (default) starts Mosquitto in OUT/broker if installed, "
                        "off runs without, or mqtt://HOST[:PORT] of a broker of yours")
    add_page_arguments(p, "simulate")
    p.set_defaults(run=run)


def _broker_choice(text: str) -> str:
    return text if text in ("auto", "off") else broker_url(text)


def settings_from_args(args: argparse.Namespace) -> SimulateSettings:
    # what common/cli.py adds to every command's namespace, and where --page writes: not sweep settings
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "run", "command", "log_level", "argv", "page", "section")}
    config = json.loads(args.config.read_text()) if getattr(args, "config", None) else {}
    if not isinstance(config, dict):
        raise ValueError(f"{args.config}: expected a JSON object")
    return SimulateSettings.from_mapping({**config, **flags})


def run(args: argparse.Namespace) -> int:
    from sim.sweep.report import format_summary
    from sim.sweep.simulate import simulate

    try:
        settings = settings_from_args(args)
    except ValueError as err:
        raise SystemExit(f"sprinter simulate: {err}") from None
    quiet_http_clients()  # a line per request would bury the progress bar
    log.info("simulate: %s", settings)
    written = simulate(settings)
    print(format_summary(settings.out))
    print("\nwrote " + ", ".join(str(p) for p in written.values()))
    publish_if_asked(args, format_summary(settings.out),
                     tuple(path for name, path in written.items() if name in PUBLISHED_PLOTS))
    return 0
