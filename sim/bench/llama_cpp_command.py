"""`sprinter bench llama-cpp`'s flags and settings (sim/bench/llama_cpp.py measures; its docstring is the help)."""

from __future__ import annotations

import argparse
from sim.bench.registry import add_settings_arguments, settings_from
from sim.bench.settings import LlamaCppBenchSettings


HELPS = {
    "target": "a GGUF preset or a .gguf path, run as shipped",
    "edges": "sessions whose blocks verify in one forward",
    "block": "tokens per block",
    "context": "tokens each session holds before its block",
    "repeats": "timed rounds of the verify step",
    "prompts": "bench prompts for the decode step (sim/data/bench_prompts.jsonl)",
    "max_new_tokens": "tokens each decode request asks for",
    "core": "the core every measured process is pinned to",
    "steps": "verify, decode, turns (a conversation's second turn, prefix cache on and off)",
}


def register(benches: argparse._SubParsersAction, described: dict[str, object]) -> None:
    p = benches.add_parser("llama-cpp", help="the llama.cpp engine against llama-bench and llama-server, one core",
                           **described)
    add_settings_arguments(p, LlamaCppBenchSettings, HELPS)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from common.lab.results_page import publish_if_asked
    from sim.bench.llama_cpp import bench_llama_cpp
    from sim.processes import quiet_http_clients

    quiet_http_clients()  # a line per llama-server request would bury the progress
    settings = settings_from(args, LlamaCppBenchSettings)
    table, _ = bench_llama_cpp(settings)
    print(table)
    print(f"\nwrote {settings.out}/results.json, table.md, plot.png")
    publish_if_asked(args, table, (settings.out / "plot.png",))
    return 0
