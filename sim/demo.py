"""`sprinter demo` (`make demo`): the whole system on loopback, as a user runs it.

    sprinter demo --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b

Starts the cloud service (target) and the edge daemon (draft + verifier) as separate processes,
sends a few varied prompts through the edge's OpenAI-compatible API in several modes, prints one
comparison table, and stops both processes cleanly.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sim.processes import cloud_process, edge_daemon, free_port

if TYPE_CHECKING:  # openai is the `test` extra: imported when the demo runs
    from openai import OpenAI

log = logging.getLogger(__name__)

PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences why the sky is blue.",
    "What is the difference between a list and a tuple in Python?",
)
MODES = ("target", "sd-block", "sprinter", "sprinter-exact")


@dataclass
class DemoRow:
    mode: str
    tokens_per_s: float
    target_calls_per_token: float
    agreement_with_target: float
    tokens: int


def agreement(text: str, reference: str) -> float:
    """Share of the reference's characters reproduced position by position (1.0: identical)."""
    if not reference:
        return 1.0 if not text else 0.0
    return sum(a == b for a, b in zip(text, reference)) / max(len(reference), len(text))


def register(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser("demo", help="the whole system on loopback: cloud + edge processes, a comparison table",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--verifier", default="auto")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("results/demo"))
    p.set_defaults(run=run)


def ask_in_mode(client: OpenAI, mode: str, max_tokens: int, references: dict[str, str],
                samples: dict[str, str]) -> DemoRow:
    """Every prompt in one mode, greedy; target mode (asked first) sets the references of agreement."""
    tokens = calls = 0
    seconds = 0.0
    agreements = []
    for prompt in PROMPTS:
        started = time.perf_counter()
        reply = client.chat.completions.create(
            model="sprinter", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0, extra_body={"mode": mode})
        seconds += time.perf_counter() - started
        text = reply.choices[0].message.content
        extension = reply.model_extra["sprinter"]
        tokens += reply.usage.completion_tokens
        calls += extension["target_calls"]
        if mode == "target":
            references[prompt] = text
        agreements.append(agreement(text, references[prompt]))
        samples.setdefault(mode, text)
        print(f"  {mode:15s} {reply.usage.completion_tokens:3d} tokens  {prompt[:48]}", flush=True)
    return DemoRow(mode, tokens / seconds, calls / tokens, sum(agreements) / len(agreements), tokens)


def print_table(rows: list[DemoRow], samples: dict[str, str]) -> None:
    print(f"\nsample ({MODES[-1]}): {PROMPTS[0]}\n{samples[MODES[-1]]}\n")
    print("| mode | tokens/s | target calls per token | agreement with target |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row.mode} | {row.tokens_per_s:.2f} | {row.target_calls_per_token:.3f} | "
              f"{row.agreement_with_target:.3f} |")


def run(args: argparse.Namespace) -> int:
    from openai import OpenAI

    for name in ("httpx", "httpx2"):  # one line per request drowns the table (openai logs as httpx2)
        logging.getLogger(name).setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"starting the cloud ({args.target}) and the edge daemon ({args.draft}, verifier {args.verifier}); "
          "the first run converts and exports the models once", flush=True)
    with cloud_process("--target", args.target, "--drain-s", "5", log_path=args.out / "cloud.log",
                       startup_timeout_s=900) as cloud_address, \
            edge_daemon(["--draft", args.draft, "--verifier", args.verifier, "--cloud", cloud_address,
                         "--mode", "sprinter-exact", "--model-name", f"{args.draft}+{args.target}"],
                        free_port(), args.out / "edge.log") as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="local", timeout=600, max_retries=0)
        print(f"cloud on {cloud_address}, edge API on {base}/v1\n", flush=True)
        samples: dict[str, str] = {}
        references: dict[str, str] = {}
        rows = [ask_in_mode(client, mode, args.max_tokens, references, samples) for mode in MODES]
    print_table(rows, samples)
    (args.out / "demo.json").write_text(json.dumps({"rows": [asdict(r) for r in rows], "samples": samples}, indent=1))
    print(f"\n(end to end through the OpenAI API, greedy, {len(PROMPTS)} prompts; wrote {args.out}/demo.json)")
    return 0
