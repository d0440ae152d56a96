"""`sprinter bench local|cloud|draft|policy|prefill|prefix|prefix-fleet|soak|chaos|dashboards|rollout|fleet|capacity|pipeline|features|uplink|placement|proposer|tree-shapes|llama-cpp`: the benchmarks behind docs/benchmarks/.

Each prints its table; with `--page docs/benchmarks/PAGE.md` it also writes it (and its plots) into that page,
between the markers of its section, saying the date, the machine, the commit and the command.

    sprinter bench local --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-local
    sprinter bench cloud --targets smollm2-135m,qwen2.5-coder-1.5b --out results/bench-cloud
    sprinter bench draft --model qwen2.5-coder-0.5b --out results/bench-draft
    sprinter bench policy --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-policy
    sprinter bench prefill --target smollm2-135m --prompt-tokens 4000 --out results/bench-prefill
    sprinter bench prefix --target qwen2.5-coder-1.5b --out results/bench-prefix
    sprinter bench prefix-fleet --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-prefix-fleet
    sprinter bench fleet --target smollm2-135m --edges 8 --out results/bench-fleet
    sprinter bench capacity --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-capacity
    sprinter bench pipeline --sweep results/pipeline --edges 1000 --replicas 2 --out results/bench-pipeline
    sprinter bench features --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-features
    sprinter bench placement --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-placement
    sprinter bench proposer --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-proposer
    sprinter bench tree-shapes --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-tree-shapes
    sprinter bench llama-cpp --target qwen2.5-coder-1.5b --out results/bench-llama-cpp
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.arguments import DTYPE_NAMES, comma_list, floats, names
from common.lab.results_page import add_page_arguments
from sim.bench.policy import PolicyBenchSettings
from sim.bench import registry
from sim.bench.registry import described as _described
from sim.bench.runs import run_features, run_placement, run_policy, run_proposer, run_uplink
from sim.bench.settings import PlacementBenchSettings
from sim.bench.settings import capacity, engines, operations, trees


BENCHES = (*engines.BENCHES, *capacity.BENCHES, *trees.BENCHES,
           *operations.BENCHES)  # commands that are their settings (registry.py)


def register(subcommands: argparse._SubParsersAction) -> None:
    bench = subcommands.add_parser("bench", help="benchmarks: local modes, cloud batching, draft runtime, policies",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benches = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    _register_policy(benches)
    _register_features(benches)
    _register_uplink(benches)
    _register_placement(benches)
    _register_proposer(benches)
    for entry in BENCHES:
        registry.register(benches, entry)
    for name, parser in benches.choices.items():
        add_page_arguments(parser, name)


def _register_policy(benches: argparse._SubParsersAction) -> None:
    defaults = PolicyBenchSettings()
    p = benches.add_parser("policy", help="sprinter-exact with each call policy over the network sweep",
                           **_described("sim.bench.policy"))
    p.add_argument("--target", default=defaults.target)
    p.add_argument("--draft", default=defaults.draft)
    p.add_argument("--mode", default=defaults.mode, help="the mode whose call policy varies")
    p.add_argument("--policies", type=names, default=defaults.policies,
                   help=f"comma list (default {','.join(defaults.policies)})")
    p.add_argument("--temperatures", type=floats, default=defaults.temperatures, help="comma list; one sweep each")
    p.add_argument("--rtt-ms", type=floats, default=defaults.rtt_ms, help="comma list (default 0,50,100,200)")
    p.add_argument("--limit", type=int, default=defaults.limit, help="prompts")
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    p.add_argument("--fleet-validation", action=argparse.BooleanOptionalAction, default=defaults.fleet_validation)
    p.add_argument("--out", type=Path, default=defaults.out, help="each temperature's sweep goes into OUT/T<temperature>")
    p.set_defaults(run=run_policy)


def _register_features(benches: argparse._SubParsersAction) -> None:
    p = benches.add_parser("features", help="what structured output, logprobs and tool calls cost, against plain requests",
                           **_described("sim.bench.features"))
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    p.add_argument("--modes", type=names, default=("sd-block", "sprinter-exact"), help="comma list")
    p.add_argument("--repeats", type=int, default=2, help="passes over the prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("results/bench-features"))
    p.set_defaults(run=run_features)


def _register_uplink(benches: argparse._SubParsersAction) -> None:
    p = benches.add_parser("uplink", help="sampled sd's link bytes: full draft distributions against on-rejection",
                           **_described("sim.bench.uplink"))
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="smollm2-135m:layers=4")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    p.add_argument("--rtt-ms", type=floats, default=(20.0, 100.0), help="comma list")
    p.add_argument("--bandwidth-mbps", type=float, default=20.0, help="each way; 0: unlimited")
    p.add_argument("--prompts", type=int, default=3, help="the first N bench prompts")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("-k", type=int, default=4, help="sd's block length")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=Path("results/bench-uplink"))
    p.set_defaults(run=run_uplink)


def _register_placement(benches: argparse._SubParsersAction) -> None:
    d = PlacementBenchSettings()
    p = benches.add_parser("placement", help="edge, cloud and auto placement of the draft over RTTs and under load",
                           **_described("sim.bench.placement"))
    p.add_argument("--target", default=d.target)
    p.add_argument("--draft", default=d.draft, help="the edges' draft, and the cloud's (cloud serve --draft)")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPE_NAMES)
    p.add_argument("--rtt-ms", type=floats, default=d.rtts_ms, help="comma list (default 0,20,50,100,200)")
    p.add_argument("--load-rtt-ms", type=comma_list(float, "RTTs", allow_empty=True), default=d.load_rtts_ms,
                   help="RTTs measured again under load, comma list (default 50; empty: no load phase)")
    p.add_argument("--load-streams", type=int, default=d.load_streams,
                   help="other users' concurrent cloud-sd streams under load")
    p.add_argument("--prompts", type=int, default=d.prompts, help="the first N bench prompts")
    p.add_argument("--max-new-tokens", type=int, default=d.max_tokens)
    p.add_argument("-k", type=int, default=d.k, help="draft tokens per round")
    p.add_argument("--mode", default=d.mode, help="the placeable mode measured")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed requests per placement at each RTT")
    p.add_argument("--mqtt", default=d.mqtt, help="fleet plane: auto (Mosquitto here), off, or a broker URL")
    p.add_argument("--out", type=Path, default=d.out)
    p.set_defaults(run=run_placement)


def _register_proposer(benches: argparse._SubParsersAction) -> None:
    p = benches.add_parser("proposer", help="tokens per round trip: the draft model, suffix and hybrid drafting, per category",
                           **_described("sim.bench.proposer"))
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    p.add_argument("--draft-runtime", default="torch", choices=["torch", "onnx"], help="the edge's draft runtime")
    p.add_argument("--rtt-ms", type=float, default=50.0)
    p.add_argument("--modes", type=names, default=("sd-block",), help="comma list")
    p.add_argument("--proposers", type=names, default=("model", "suffix", "hybrid"), help="comma list")
    p.add_argument("--branch-tokens", type=names, default=("0",),
                   help="comma list of branch budgets (0, a count, auto): each proposer runs with each, labelled "
                        "`model+tree:auto`; 0 is one path")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled, a seed per pass")
    p.add_argument("--skip-per-category", type=int, default=0,
                   help="leave out the first N prompts of each category (1: hold prompt 1 out of a calibration fit)")
    p.add_argument("--fit-calibration", type=Path,
                   help="write the copies' rates measured here to this JSON (shipped as "
                        "edge/verifiers/PAIR[__sampling]/suffix_calibration.json)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved passes over the prompts (medians reported)")
    p.add_argument("--per-category", type=int, help="the first N prompts of each category (default all)")
    p.add_argument("--categories", type=names, default=(), help="comma list (default every category of the suite)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=5, help="sd's block length")
    p.add_argument("--suffix-cache", default="on", choices=["on", "off"])
    p.add_argument("--prompts", type=Path, help="a prompt file (default sim/data/proposer_prompts.jsonl)")
    p.add_argument("--out", type=Path, default=Path("results/bench-proposer"))
    p.set_defaults(run=run_proposer)
