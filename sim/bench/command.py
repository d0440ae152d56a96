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

from common.arguments import DTYPE_NAMES, comma_list, floats, ints, names, one_of
from common.model.devices import add_device_argument
from common.lab.results_page import add_page_arguments
from sim.bench import chaos, dashboards, soak
from sim.bench.policy import PolicyBenchSettings
from sim.bench import registry
from sim.bench.settings import trees
from sim.bench.registry import described as _described
from sim.bench.runs import (run_capacity, run_cloud, run_draft, run_features, run_fleet, run_local, run_pipeline,
                            run_placement, run_policy, run_prefill, run_prefix,
                            run_prefix_fleet, run_proposer, run_rollout, run_uplink)
from sim.bench.settings import (LAYOUTS, LLAMA_CPP, CapacityBenchSettings, CloudBenchSettings, DraftBenchSettings, EngineBenchSettings,
                                FleetBenchSettings, LocalBenchSettings, PlacementBenchSettings, PrefillBenchSettings,
                                PrefixBenchSettings, PrefixFleetSettings, RolloutSettings)


BENCHES = (LLAMA_CPP, *trees.BENCHES)  # benches whose command is their settings (sim/bench/registry.py)


def register(subcommands: argparse._SubParsersAction) -> None:
    bench = subcommands.add_parser("bench", help="benchmarks: local modes, cloud batching, draft runtime, policies",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benches = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    _register_local(benches)
    _register_cloud(benches)
    _register_draft(benches)
    _register_policy(benches)
    _register_prefill(benches)
    _register_prefix(benches)
    _register_prefix_fleet(benches)
    soak.register_soak(benches)
    chaos.register_chaos(benches)
    dashboards.register_dashboards(benches)
    _register_rollout(benches)
    _register_fleet(benches)
    _register_capacity(benches)
    _register_pipeline(benches)
    _register_features(benches)
    _register_uplink(benches)
    _register_placement(benches)
    _register_proposer(benches)
    for entry in BENCHES:
        registry.register(benches, entry)
    for name, parser in benches.choices.items():
        add_page_arguments(parser, name)


def _register_local(benches: argparse._SubParsersAction) -> None:
    defaults = LocalBenchSettings()
    p = benches.add_parser("local", help="every local decoding mode and transformers' assisted generation",
                           **_described("sim.bench.local"))
    p.add_argument("--target", default=defaults.target)
    p.add_argument("--draft", default=defaults.draft)
    p.add_argument("--dtype", default=defaults.dtype, choices=DTYPE_NAMES)
    p.add_argument("--prompts", type=Path, default=defaults.prompts, help="JSONL with prompt, chat, category")
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    p.add_argument("--temperatures", type=floats, default=defaults.temperatures, help="comma list (default 0,1)")
    p.add_argument("--k", type=int, default=defaults.k)
    p.add_argument("--verifier-threshold", type=float, default=defaults.verifier_threshold,
                   help="confidence verifier for sprinter")
    p.add_argument("--assisted", type=comma_list(str, "names", allow_empty=True), default=defaults.assisted,
                   help="assisted-generation configs to run (comma list; empty for none; default all)")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--out", type=Path, default=defaults.out)
    p.set_defaults(run=run_local)


def _register_cloud(benches: argparse._SubParsersAction) -> None:
    defaults, engine = CloudBenchSettings(), EngineBenchSettings()
    p = benches.add_parser("cloud", help="verification throughput of one cloud process under N edges, batching on/off",
                           **_described("sim.bench.cloud"))
    p.add_argument("--targets", type=names, default=defaults.targets,
                   help="comma list (default smollm2-135m,qwen2.5-coder-1.5b)")
    p.add_argument("--edges", type=ints, help="comma list (default 1,2,4,8,16; --random-weights: 1,8,32,64)")
    p.add_argument("--rounds", type=int, help="verify calls per edge (default 8; --random-weights: 20 timed)")
    p.add_argument("--k", type=int, default=defaults.k, help="draft tokens per block")
    p.add_argument("--contexts", type=ints, default=defaults.contexts,
                   help="prompt lengths in tokens, comma list (default 0: the bench prompts as they are)")
    p.add_argument("--batch-window-ms", type=float, help="default: the cloud's own")
    p.add_argument("--max-batch", type=int, default=defaults.max_batch)
    p.add_argument("--dtype", default=defaults.dtype)
    p.add_argument("--source", type=Path, help="run the cloud from this checkout (e.g. a worktree of an older commit)")
    p.add_argument("--engine", default=defaults.engine, choices=("resident", "vllm"),
                   help="the cloud's engine (vllm: the environment `make vllm` builds)")
    p.add_argument("--label", help="name of this run's rows (default: the engine's); rows of other labels in "
                                   "OUT/results.json are kept, so runs compare engines or checkouts")
    p.add_argument("--batching", choices=("both", "on", "off"), default="both",
                   help="measure with batching on, off (--max-batch 1), or both")
    p.add_argument("--cpus", type=ints, default=defaults.cpus, help="pin the cloud process to these cores (comma list)")
    add_device_argument(p, "the cloud's target runs (resident engine)")
    p.add_argument("--random-weights", action="store_true",
                   help="no cloud process: the engine in-process on --device, each target a real architecture with "
                        "random weights (sim/bench/architectures; no model packages needed)")
    p.add_argument("--accepted", type=int, help="--random-weights only: advance each context by this many accepted "
                                                "tokens per round (default: as the random target verifies, about 0)")
    p.add_argument("--warmup", type=int, default=engine.warmup, help="--random-weights only: untimed rounds first")
    p.add_argument("--attention", type=names, default=engine.attention,
                   help="--random-weights only: the resident engine's layouts to measure (default per-session,paged)")
    p.add_argument("--out", type=Path, help="default results/bench-cloud (--random-weights: results/bench-engine)")
    p.set_defaults(run=run_cloud)


def _register_draft(benches: argparse._SubParsersAction) -> None:
    defaults = DraftBenchSettings()
    p = benches.add_parser("draft", help="per-token latency of the edge's draft runtime: ONNX Runtime vs torch",
                           **_described("sim.bench.draft"))
    p.add_argument("--model", default=defaults.model)
    p.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
    p.add_argument("--new-tokens", type=int, default=defaults.new_tokens)
    p.add_argument("--repeats", type=int, default=defaults.repeats, help="timed decodes per config per round")
    p.add_argument("--rounds", type=int, default=defaults.rounds,
                   help="passes over all configs (each rebuilds the runtime)")
    p.add_argument("--threads", type=int, help="intra-op threads, torch and ORT (default: the cores it may use)")
    p.add_argument("--configs", type=names, default=defaults.configs, help="comma list of configs to run (default all)")
    p.add_argument("--out", type=Path, default=defaults.out)
    p.set_defaults(run=run_draft)


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



def _register_prefill(benches: argparse._SubParsersAction) -> None:
    defaults = PrefillBenchSettings()
    p = benches.add_parser("prefill", help="verify latency of busy sessions while a long prompt opens",
                           **_described("sim.bench.prefill"))
    p.add_argument("--target", default=defaults.target)
    p.add_argument("--dtype", default=defaults.dtype)
    p.add_argument("--sessions", type=int, default=defaults.sessions, help="busy sessions verifying in a loop")
    p.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
    p.add_argument("--k", type=int, default=defaults.k)
    p.add_argument("--quiet-s", type=float, default=defaults.quiet_s)
    p.add_argument("--serve-args", default="", help="extra `cloud serve` flags, one string")
    p.add_argument("--cloud-pythonpath", help="PYTHONPATH of the cloud process (another checkout)")
    p.add_argument("--label", default="run", help="the row's name in the table")
    p.add_argument("--out", type=Path, default=defaults.out)
    p.set_defaults(run=run_prefill)


def _register_prefix(benches: argparse._SubParsersAction) -> None:
    defaults = PrefixBenchSettings()
    p = benches.add_parser("prefix", help="what the cloud's prefix cache saves: conversations, shared prompts, "
                                          "n choices",
                           **_described("sim.bench.prefix"))
    p.add_argument("--target", default=defaults.target)
    p.add_argument("--dtype", default=defaults.dtype, choices=DTYPE_NAMES)
    for name in ("history_tokens", "answer_tokens", "new_tokens", "edges", "rounds", "system_tokens", "choices",
                 "kv_budget_mb"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    p.add_argument("--cloud-cpus", type=ints, default=list(defaults.cloud_cpus), help="cores the cloud is pinned to")
    p.add_argument("--out", type=Path, default=defaults.out)
    p.set_defaults(run=run_prefix)


def _register_prefix_fleet(benches: argparse._SubParsersAction) -> None:
    d = PrefixFleetSettings()
    p = benches.add_parser("prefix-fleet", help="the prefix caches from end to end, through edge daemons: a "
                                                "conversation's second turn; replicas and edges sharing system prompts",
                           **_described("sim.bench.prefix_fleet"))
    p.add_argument("--target", default=d.target)
    p.add_argument("--draft", default=d.draft)
    p.add_argument("--dtype", default=d.dtype, choices=DTYPE_NAMES)
    p.add_argument("--draft-runtime", default=d.draft_runtime, choices=("torch", "onnx"), help="the edges' draft runtime")
    p.add_argument("--parts", type=names, default=d.parts, help="comma list of conversation, fleet (default both)")
    for name in ("history_tokens", "answer_tokens", "new_tokens", "max_tokens", "conversations", "replicas", "edges",
                 "rounds", "system_tokens", "question_tokens"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--cpus", type=ints, default=d.cpus, help="cores every process is pinned to (comma list)")
    p.add_argument("--out", type=Path, default=d.out)
    p.set_defaults(run=run_prefix_fleet)


def _register_rollout(benches: argparse._SubParsersAction) -> None:
    p = benches.add_parser("rollout", help="fleet config rollout latency to real and simulated edges; telemetry cost",
                           **_described("sim.bench.rollout"))
    defaults = RolloutSettings()
    p.add_argument("--real-edges", type=int, default=defaults.real_edges)
    p.add_argument("--simulated-edges", type=int, default=defaults.simulated_edges)
    p.add_argument("--rounds", type=int, default=defaults.rounds)
    p.add_argument("--draft", default=defaults.draft)
    p.add_argument("--telemetry-pairs", type=int, default=defaults.telemetry_pairs)
    p.add_argument("--out", type=Path, default=defaults.out)
    p.set_defaults(run=run_rollout)


FLEET_CHOICES = {"dtype": DTYPE_NAMES, "profile": ("demo-sd", "measured")}


def _register_fleet(benches: argparse._SubParsersAction) -> None:
    d = FleetBenchSettings()
    p = benches.add_parser("fleet", help="E edges on 1 vs 2 cloud replicas, and the fleet simulator's projection",
                           **_described("sim.bench.fleet"))
    for name, kind, help_text in [
            ("target", str, ""), ("draft", str, "default: bench cloud's draft for the target"), ("dtype", str, ""),
            ("edges", int, "synthetic edges"), ("k", int, "draft tokens per block"), ("out", Path, ""),
            ("rounds-per-session", int, "verifies per generation"), ("duration-s", float, "measured phase per layout"),
            ("rounds", int, "instead of --duration-s: verifies per edge"), ("batch-window-ms", float, ""),
            ("layouts", comma_list(one_of(LAYOUTS, "layout"), "layouts"), f"comma list of {', '.join(LAYOUTS)}"),
            ("max-batch", int, ""),
            ("draft-step-ms", float, "projection: one draft token (assumed)"), ("rtt-jitter-ms", float, ""),
            ("rtt-ms", float, "projection: round trip (assumed)"), ("tokens-per-request", int, "projection"),
            ("profile", str, "demo-sd (illustrative) or measured (the replay's acceptance)"),
            ("replicas", ints, "projection: replica counts"), ("fleet-edges", ints, "projection: edge counts"),
            ("sim-requests", int, "projection: generations per edge"),
            ("measured", Path, "an earlier fleet.json: project again from its measured rows, measure nothing")]:
        default = getattr(d, name.replace("-", "_"))
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        p.add_argument(f"--{name}", type=kind, default=default, choices=FLEET_CHOICES.get(name),
                       help=f"{help_text} (default {shown})".strip())
    p.set_defaults(run=run_fleet)


def _register_capacity(benches: argparse._SubParsersAction) -> None:
    d = CapacityBenchSettings()
    p = benches.add_parser("capacity", help="edges per cloud replica when the edges draft vs when the cloud drafts",
                           **_described("sim.bench.capacity"))
    for name, kind, help_text in [
            ("target", str, ""), ("draft", str, "the cloud's draft, and the edges' (replayed)"),
            ("modes", names, "comma list"), ("edges", ints, "concurrent edges per point, comma list"),
            ("rtts", floats, "round trips in ms, comma list"), ("k", int, "draft tokens per round"),
            ("max-new-tokens", int, "tokens per generation"), ("generations", int, "per edge per point"),
            ("batch-window-ms", float, "default: the cloud's own"),
            ("edge-draft-ms", float, "sd-block, sprinter-exact: an edge's draft time per block token (0: instant)"),
            ("cloud-cpu", int, "the replica's core (default: the last one); the edges run on the others"),
            ("project-edges", ints, "the fleet simulator fitted to the run, projected to these edge counts"),
            ("project-rtts", floats, "... and these RTTs in ms"),
            ("measured", Path, "an earlier OUT/results.json: project it again (its own settings), measure nothing"),
            ("out", Path, "")]:
        default = getattr(d, name.replace("-", "_"))
        shown = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in default) \
            if isinstance(default, tuple) else default
        p.add_argument(f"--{name}", type=kind, default=default,
                       help=help_text if default is None else f"{help_text} (default {shown})".strip())
    p.add_argument("--dtype", default=d.dtype, choices=DTYPE_NAMES)
    p.add_argument("--itl-p99-ms", type=float, default=d.itl_p99_ms,
                   help="the per-token ITL p99 that edges per replica are counted at (default 2.5x the target-alone "
                        "mode's at one edge and RTT 0: a user keeps 40%% of an idle replica's streaming speed)")
    p.set_defaults(run=run_capacity)


def _register_pipeline(benches: argparse._SubParsersAction) -> None:
    p = benches.add_parser("pipeline", help="the edge pipeline at fleet scale, from a measured sweep",
                           **_described("sim.bench.pipeline"))
    p.add_argument("--sweep", type=Path, required=True, help="a `sprinter simulate --pipeline ...` OUT directory")
    p.add_argument("--edges", type=int, default=1000)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rtt-ms", type=floats, default=(20.0, 50.0, 100.0, 200.0, 300.0))
    p.add_argument("--tokens-per-request", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("results/bench-pipeline"))
    p.set_defaults(run=run_pipeline)


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
