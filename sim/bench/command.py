"""`sprinter bench local|cloud|draft|policy|readme|prefill|soak|chaos|rollout|fleet|pipeline`: the benchmarks behind the tables of docs/benchmarks/.

    sprinter bench local --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-local
    sprinter bench cloud --targets smollm2-135m,qwen2.5-coder-1.5b --out results/bench-cloud
    sprinter bench draft --model qwen2.5-coder-0.5b --out results/bench-draft
    sprinter bench policy --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-policy
    sprinter bench readme --out results/bench --readme docs/benchmarks/index.md
    sprinter bench prefill --target smollm2-135m --prompt-tokens 4000 --out results/bench-prefill
    sprinter bench fleet --target smollm2-135m --edges 8 --out results/bench-fleet
    sprinter bench pipeline --sweep results/pipeline --edges 1000 --replicas 2 --out results/bench-pipeline
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from common.devices import add_device_argument
from common.models import DTYPES
from sim.bench import chaos, cloud, draft, engine, fleet, local, pipeline, policy, prefill, readme, rollout, soak
from sim.bench.prompts import PROMPTS_FILE
from sim.sweep.report import format_summary

log = logging.getLogger(__name__)


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split(","))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _described(module_doc: str | None) -> dict[str, object]:
    return {"description": module_doc, "formatter_class": argparse.RawDescriptionHelpFormatter}


def register(subcommands: argparse._SubParsersAction) -> None:
    bench = subcommands.add_parser("bench", help="benchmarks: local modes, cloud batching, draft runtime, policies",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benches = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    _register_local(benches)
    _register_cloud(benches)
    _register_draft(benches)
    _register_policy(benches)
    _register_readme(benches)
    prefill.register_prefill(benches)
    soak.register_soak(benches)
    chaos.register_chaos(benches)
    rollout.register_rollout(benches)
    fleet.register_fleet(benches)
    pipeline.register_pipeline(benches)


def _register_local(benches: argparse._SubParsersAction) -> None:
    p = benches.add_parser("local", help="every local decoding mode and transformers' assisted generation",
                           **_described(local.__doc__))
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--prompts", type=Path, default=PROMPTS_FILE, help="JSONL with prompt, chat, category")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperatures", type=_floats, default=(0.0, 1.0), help="comma list (default 0,1)")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--verifier-threshold", type=float, default=0.5, help="confidence verifier for sprinter")
    p.add_argument("--assisted", type=_names, default=tuple(c.name for c in local.ASSISTED_CONFIGS),
                   help="assisted-generation configs to run (comma list; empty for none; default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/bench-local"))
    p.set_defaults(run=run_local)


def _register_cloud(benches: argparse._SubParsersAction) -> None:
    p = benches.add_parser("cloud", help="verification throughput of one cloud process under N edges, batching on/off",
                           **_described(cloud.__doc__))
    p.add_argument("--targets", type=_names, default=("smollm2-135m", "qwen2.5-coder-1.5b"),
                   help="comma list (default smollm2-135m,qwen2.5-coder-1.5b)")
    p.add_argument("--edges", type=_ints, help="comma list (default 1,2,4,8,16; --random-weights: 1,8,32,64)")
    p.add_argument("--rounds", type=int, help="verify calls per edge (default 8; --random-weights: 20 timed)")
    p.add_argument("--k", type=int, default=5, help="draft tokens per block")
    p.add_argument("--contexts", type=_ints, default=(0,),
                   help="prompt lengths in tokens, comma list (default 0: the bench prompts as they are)")
    p.add_argument("--batch-window-ms", type=float, help="default: the cloud's own")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--source", type=Path, help="run the cloud from this checkout (e.g. a worktree of an older commit)")
    p.add_argument("--engine", default="resident", choices=("resident", "vllm"),
                   help="the cloud's engine (vllm: the environment `make vllm` builds)")
    p.add_argument("--label", help="name of this run's rows (default: the engine's); rows of other labels in "
                                   "OUT/results.json are kept, so runs compare engines or checkouts")
    p.add_argument("--batching", choices=("both", "on", "off"), default="both",
                   help="measure with batching on, off (--max-batch 1), or both")
    p.add_argument("--cpus", type=_ints, default=(), help="pin the cloud process to these cores (comma list)")
    add_device_argument(p, "the cloud's target runs (resident engine)")
    p.add_argument("--random-weights", action="store_true",
                   help="no cloud process: the engine in-process on --device, each target a real architecture with "
                        "random weights (sim/bench/architectures; no model packages needed)")
    p.add_argument("--accepted", type=int, help="--random-weights only: advance each context by this many accepted "
                                                "tokens per round (default: as the random target verifies, about 0)")
    p.add_argument("--warmup", type=int, default=3, help="--random-weights only: untimed rounds first")
    p.add_argument("--attention", type=_names, default=("per-session", "paged"),
                   help="--random-weights only: the resident engine's layouts to measure (default per-session,paged)")
    p.add_argument("--out", type=Path, help="default results/bench-cloud (--random-weights: results/bench-engine)")
    p.set_defaults(run=run_cloud)


def _register_draft(benches: argparse._SubParsersAction) -> None:
    p = benches.add_parser("draft", help="per-token latency of the edge's draft runtime: ONNX Runtime vs torch",
                           **_described(draft.__doc__))
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed decodes per config per round")
    p.add_argument("--rounds", type=int, default=3, help="passes over all configs (each rebuilds the runtime)")
    p.add_argument("--threads", type=int, help="intra-op threads, torch and ORT (default: the cores it may use)")
    p.add_argument("--configs", type=_names, default=tuple(c.name for c in draft.CONFIGS),
                   help="comma list of configs to run (default all)")
    p.add_argument("--out", type=Path, default=Path("results/bench-draft"))
    p.set_defaults(run=run_draft)


def _register_policy(benches: argparse._SubParsersAction) -> None:
    defaults = policy.PolicyBenchSettings()
    p = benches.add_parser("policy", help="sprinter-exact with each call policy over the network sweep",
                           **_described(policy.__doc__))
    p.add_argument("--target", default=defaults.target)
    p.add_argument("--draft", default=defaults.draft)
    p.add_argument("--mode", default=defaults.mode, help="the mode whose call policy varies")
    p.add_argument("--policies", type=_names, default=defaults.policies,
                   help=f"comma list (default {','.join(defaults.policies)})")
    p.add_argument("--temperatures", type=_floats, default=defaults.temperatures, help="comma list; one sweep each")
    p.add_argument("--rtt-ms", type=_floats, default=defaults.rtt_ms, help="comma list (default 0,50,100,200)")
    p.add_argument("--limit", type=int, default=defaults.limit, help="prompts")
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    p.add_argument("--fleet-validation", action=argparse.BooleanOptionalAction, default=defaults.fleet_validation)
    p.add_argument("--out", type=Path, default=defaults.out, help="each temperature's sweep goes into OUT/T<temperature>")
    p.set_defaults(run=run_policy)


def _register_readme(benches: argparse._SubParsersAction) -> None:
    p = benches.add_parser("readme", help="put a sweep's summary into the benchmarks page between the bench markers",
                           **_described(readme.__doc__))
    p.add_argument("--out", type=Path, default=Path("results/bench"), help="the sweep's output directory")
    p.add_argument("--readme", type=Path, default=Path("docs/benchmarks/index.md"),
                   help="the page with the bench markers")
    p.set_defaults(run=run_readme)


def run_local(args: argparse.Namespace) -> int:
    settings = local.LocalBenchSettings(
        target=args.target, draft=args.draft, dtype=args.dtype, prompts=args.prompts,
        max_new_tokens=args.max_new_tokens, temperatures=args.temperatures, k=args.k,
        verifier_threshold=args.verifier_threshold, assisted=args.assisted, seed=args.seed, out=args.out)
    print(local.bench_local(settings))
    print(f"\nwrote {args.out}/results.json, table.md, tokens_per_s.png")
    return 0


def run_cloud(args: argparse.Namespace) -> int:
    batching = {"both": (True, False), "on": (True,), "off": (False,)}[args.batching]
    if args.random_weights:
        return _run_engine(args, batching)
    if args.accepted is not None:
        raise SystemExit("sprinter bench cloud: --accepted is for --random-weights (a real target decides)")
    args.out = args.out or Path("results/bench-cloud")
    defaults = cloud.CloudBenchSettings()
    settings = cloud.CloudBenchSettings(targets=args.targets, edges=args.edges or defaults.edges,
                                        rounds=args.rounds or defaults.rounds, k=args.k,
                                        contexts=args.contexts, batch_window_ms=args.batch_window_ms,
                                        max_batch=args.max_batch, dtype=args.dtype, out=args.out, source=args.source,
                                        engine=args.engine, label=args.label, cpus=args.cpus, batching=batching,
                                        device=args.device)
    print(cloud.bench_cloud(settings))
    print(f"\nwrote {args.out}/results.json, table.md, verified_tokens_per_s.png")
    return 0


def _run_engine(args: argparse.Namespace, batching: tuple[bool, ...]) -> int:
    """`--random-weights`: the engine in-process (sim/bench/engine.py)."""
    refused = [flag for flag, given in (("--source", args.source), ("--label", args.label), ("--cpus", args.cpus),
                                        ("--batch-window-ms", args.batch_window_ms is not None),
                                        ("--engine vllm", args.engine != "resident")) if given]
    if refused:
        raise SystemExit(f"sprinter bench cloud: {', '.join(refused)} need a cloud process; --random-weights runs "
                         "the resident engine in this one")
    defaults = engine.EngineBenchSettings()
    settings = engine.EngineBenchSettings(
        targets=args.targets, device=args.device, dtype=args.dtype, edges=args.edges or defaults.edges,
        contexts=defaults.contexts if args.contexts == (0,) else args.contexts, k=args.k,
        rounds=args.rounds or defaults.rounds, warmup=args.warmup, accepted=args.accepted, batching=batching,
        attention=args.attention,
        out=args.out or Path("results/bench-engine"))
    try:
        print(engine.bench_engine(settings))
    except ValueError as err:  # an unknown architecture or device
        raise SystemExit(f"sprinter bench cloud: {err}") from None
    print(f"\nwrote {settings.out}/results.json, table.md, verified_tokens_per_s.png")
    return 0


def run_draft(args: argparse.Namespace) -> int:
    settings = draft.DraftBenchSettings(model=args.model, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                                  repeats=args.repeats, rounds=args.rounds, threads=args.threads,
                                  configs=args.configs, out=args.out)
    table, probe = draft.bench_draft(settings)
    print(table)
    print(f"\nONNX Runtime CPU MatMul [1,896]x[896,65536] ms by dtype: {probe}")
    print(f"\nwrote {args.out}/results.json and table.md")
    return 0


def run_policy(args: argparse.Namespace) -> int:
    settings = policy.PolicyBenchSettings(out=args.out, target=args.target, draft=args.draft, mode=args.mode,
                                   policies=args.policies, temperatures=args.temperatures, rtt_ms=args.rtt_ms,
                                   limit=args.limit, max_new_tokens=args.max_new_tokens,
                                   fleet_validation=args.fleet_validation)
    try:  # a bad policy or mode is a usage error, said before any process starts
        settings.sweeps()
    except ValueError as err:
        raise SystemExit(f"sprinter bench policy: {err}") from None
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the progress bar
    for sweep in policy.bench_policy(settings):
        print(f"\n## T={sweep.temperature:g} ({sweep.out})\n\n{format_summary(sweep.out)}")
    return 0


def run_readme(args: argparse.Namespace) -> int:
    readme.update_readme(args.readme, args.out)
    log.info("updated %s from %s/summary.md", args.readme, args.out)
    return 0
