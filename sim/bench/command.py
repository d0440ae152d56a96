"""`sprinter bench local|cloud|draft|policy|prefill|prefix|prefix-fleet|soak|chaos|dashboards|rollout|fleet|capacity|pipeline|features|uplink|placement|proposer|tree-shapes|llama-cpp|auto`: the benchmarks behind docs/benchmarks/.

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
    sprinter bench auto --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --engine llama.cpp --out results/bench-auto
"""

from __future__ import annotations

import argparse

from common.lab.results_page import add_page_arguments
from sim.bench import registry
from sim.bench.settings import capacity, engines, operations, sweeps, trees


BENCHES = (*engines.BENCHES, *capacity.BENCHES, *trees.BENCHES,
           *operations.BENCHES, *sweeps.BENCHES)  # commands that are their settings (registry.py)


def register(subcommands: argparse._SubParsersAction) -> None:
    bench = subcommands.add_parser("bench", help="benchmarks: local modes, cloud batching, draft runtime, policies",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benches = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for entry in BENCHES:
        registry.register(benches, entry)
    for name, parser in benches.choices.items():
        add_page_arguments(parser, name)
