"""`sprinter demo` (`make demo`): the whole system on loopback, as a user runs it.

    sprinter demo --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b [--dtype float32]

Starts the cloud service (target) and the edge daemon (draft + verifier) as separate processes,
sends a few varied prompts through the edge's OpenAI-compatible API in several modes, stops both
processes, and prints one comparison table. Its quality columns say what a user can trust:
`agreement with target` (share of the target mode's greedy tokens reproduced, position by
position) and `target NLL/token` (how likely the target itself finds each mode's output, scored
here after the processes stopped; lower is better, and equal to the target's own when the text is
the same). In bfloat16 a lossless mode may agree below 1: CPU kernels round a one-token and a
k-token target forward differently, so near-ties flip (docs/getting-started.md, Exactness); a footnote says so, and
`--dtype float32` shows exact identity at about half the speed.

Beside our modes the table has what a user of this machine would run instead (`--baselines`, by default
whenever the models are GGUF presets and llama.cpp is built: `make llama-cpp`): llama.cpp's server alone,
and with its own speculative decoding, on the same prompts after our processes stopped. Every row names
the engine that computed the target's rows; `--engine llama.cpp` puts the cloud's target on llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common.spec.modes import AUTO_MODE, chooses_mode, mode_of
from common.arguments import DTYPE_NAMES, names
from sim.cloud_under_test import CloudUnderTest
from sim.processes import edge_daemon, free_port
from sim.sweep.settings import BASELINES, is_baseline

if TYPE_CHECKING:  # openai is the `test` extra: imported when the demo runs
    from openai import OpenAI

log = logging.getLogger(__name__)

PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences why the sky is blue.",
    "What is the difference between a list and a tuple in Python?",
)
MODES = ("target", "cloud-sd", "sd-block", "sprinter", "sprinter-exact")  # a choice of what to show, not a trait (tests/house/test_layout.py)


@dataclass
class ModeAnswers:
    """What one mode answered to every prompt, as the client received it."""

    mode: str
    engine: str = ""  # what computed the target's rows
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    target_calls: int = 0
    degraded: int = 0  # answers the edge finished from the draft alone (cloud unreachable)


@dataclass
class DemoRow:
    mode: str
    lossless: bool
    tokens_per_s: float
    target_calls_per_token: float
    agreement_with_target: float
    target_nll_per_token: float | None
    tokens: int
    degraded: int = 0
    engine: str = ""


def register(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser("demo", help="the whole system on loopback: cloud + edge processes, a comparison table",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--verifier", default="auto")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES,
                   help="of the target (cloud and scoring) and the torch draft; float32 shows lossless modes exact")
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1),
                   help=f"how many of the {len(PROMPTS)} demo prompts to send")
    p.add_argument("--engine", default="resident", choices=("resident", "llama.cpp"),
                   help="the cloud's target engine (llama.cpp: the GGUF as shipped, the cloud's draft's too)")
    p.add_argument("--baselines", type=names, default=None,
                   help=f"rows of what a user would run instead: any of {', '.join(BASELINES)}, or '' for none "
                        "(default: both, where the models are GGUF presets and llama.cpp is built)")
    p.add_argument("--out", type=Path, default=Path("results/demo"))
    p.set_defaults(run=run)


def baselines_to_run(args: argparse.Namespace) -> tuple[str, ...]:
    """What --baselines asks for; by default both where llama.cpp can run the models (said when it cannot)."""
    if args.baselines is not None:
        return tuple(b for b in args.baselines if b)
    from common.model.loading import gguf_file
    from sim.sweep.baselines import llama_program

    try:
        gguf_file(args.target), gguf_file(args.draft), llama_program("llama-server")
    except (OSError, ValueError) as err:
        print(f"no llama.cpp baselines: {err}")
        return ()
    return BASELINES


def ask_baselines(names: tuple[str, ...], args: argparse.Namespace, prompts: tuple[str, ...]) -> list[ModeAnswers]:
    """Every prompt through each baseline's llama-server, greedy, as the same token ids our edge sent."""
    import asyncio

    import httpx

    from common.lab.prompt_sets import PromptRecord
    from sim.sweep.baselines import LocalBaselines

    async def ask(servers: LocalBaselines, name: str) -> ModeAnswers:
        answers = ModeAnswers(name, engine="llama.cpp (llama-server)")
        async with httpx.AsyncClient(timeout=600) as client:
            for i, prompt in enumerate(prompts):
                record = await servers.request(client, PromptRecord(id=str(i), category="demo", chat=True, prompt=prompt), name,
                                               args.max_tokens, 0.0, 0)
                answers.seconds += record["wall_ms"] / 1e3
                answers.texts.append(record["text"])
                answers.token_ids.append(record["token_ids"])
                answers.tokens += record["completion_tokens"]
                print(f"  {name:15s} {record['completion_tokens']:3d} tokens  {prompt[:48]}", flush=True)
        return answers

    with LocalBaselines(names, args.target, args.draft, args.out, None, None) as servers:
        return [asyncio.run(ask(servers, name)) for name in names]


def ask_in_mode(client: OpenAI, mode: str, prompts: tuple[str, ...], max_tokens: int, engine: str = "") -> ModeAnswers:
    """Every prompt in one mode, greedy."""
    answers = ModeAnswers(mode, engine)
    for prompt in prompts:
        started = time.perf_counter()
        reply = client.chat.completions.create(
            model="sprinter", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0, extra_body={"mode": mode})
        answers.seconds += time.perf_counter() - started
        extension = reply.model_extra["sprinter"]
        answers.texts.append(reply.choices[0].message.content)
        answers.token_ids.append(list(extension["token_ids"]))
        answers.tokens += reply.usage.completion_tokens
        answers.target_calls += extension["target_calls"]
        answers.degraded += bool(extension["degraded"])
        chose = " -> ".join(s["mode"] for s in extension.get("decision", {}).get("switches", []))
        print(f"  {mode:15s} {reply.usage.completion_tokens:3d} tokens  {prompt[:48]}"
              + (f"  (ran {chose})" if chose else ""), flush=True)
    return answers


def score(answers: list[ModeAnswers], prompts: tuple[str, ...], target_spec: str, dtype: str) -> list[DemoRow]:
    """Agreement with the target mode's tokens, and the target's NLL of each output (the target loaded here)."""
    from common.model.loading import DTYPES, load_model
    from common.model.prompting import encode_prompt
    from common.lab.quality import agreement, target_nll_per_token
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the cloud already converted the weights: a bar here is noise
    target = load_model(target_spec, DTYPES[dtype])
    prompt_ids = [encode_prompt(target.tokenizer, prompt, chat=True) for prompt in prompts]
    references = next(a for a in answers if _is_reference(a.mode)).token_ids
    rows = []
    for a in answers:
        agreements = [agreement(ids, ref) for ids, ref in zip(a.token_ids, references)]
        nlls = [target_nll_per_token(target, p, ids) for p, ids in zip(prompt_ids, a.token_ids)]
        rows.append(DemoRow(a.mode, is_baseline(a.mode) or chooses_mode(a.mode) or mode_of(a.mode).lossless,
                            a.tokens / a.seconds if a.seconds else 0.0, a.target_calls / a.tokens if a.tokens else 0.0,
                            sum(agreements) / len(agreements), sum(nlls) / len(nlls), a.tokens, a.degraded, a.engine))
    return rows


def _is_reference(mode: str) -> bool:
    """The row the others are compared with: the target mode (a baseline row is none of our modes)."""
    return not is_baseline(mode) and not chooses_mode(mode) and mode_of(mode).reference


def format_table(rows: list[DemoRow], dtype: str) -> str:
    """The comparison table, then one footnote line per thing a reader could mistake for a bug."""
    lines = ["| mode | engine | lossless | tokens/s | target calls per token | agreement with target | target NLL/token |",
             "|---|---|---|---|---|---|---|"]
    below = [r for r in rows if r.lossless and not _is_reference(r.mode) and r.agreement_with_target < 1
             and not r.degraded]
    for row in rows:
        mark = "*" if row.mode in {r.mode for r in below} else ""
        nll = "-" if row.target_nll_per_token is None else f"{row.target_nll_per_token:.3f}"
        lines.append(f"| {row.mode} | {row.engine or '-'} | {'yes' if row.lossless else 'no'} | {row.tokens_per_s:.2f} | "
                     f"{row.target_calls_per_token:.3f} | {row.agreement_with_target:.3f}{mark} | {nll} |")
    names = ", ".join(r.mode for r in below)
    if below and dtype == "bfloat16":
        lines.append(f"\n* {names}: lossless, yet below 1 here. In bfloat16 the CPU kernels round a one-token and a "
                     "k-token target forward differently, so where the target's two best tokens nearly tie, the "
                     "choice can flip and the texts part from there (docs/getting-started.md, Exactness); the target NLL column "
                     "shows the quality is the target's. `make demo DTYPE=float32` (`sprinter demo --dtype "
                     "float32`) shows exact identity, at about half the speed.")
    elif below:
        lines.append(f"\n* {names}: lossless, yet below 1 in {dtype}, where lossless modes must reproduce the "
                     "target token for token: that is a bug; please report it with the demo.json this run wrote.")
    if any(not r.lossless for r in rows):
        lines.append("Modes marked 'no' (sprinter) are approximate by design: fewer target calls for output the "
                     "target may not have chosen; their NLL shows what that costs.")
    degraded = [f"{r.mode} ({r.degraded})" for r in rows if r.degraded]
    if degraded:
        lines.append(f"Degraded answers (the cloud was unreachable; finished from the draft alone): "
                     f"{', '.join(degraded)}; their agreement says nothing about the modes.")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from openai import OpenAI

    for name in ("httpx", "httpx2"):  # one line per request drowns the table (openai logs as httpx2)
        logging.getLogger(name).setLevel(logging.WARNING)
    prompts = PROMPTS[:args.prompts]
    args.out.mkdir(parents=True, exist_ok=True)
    llama = args.engine == "llama.cpp"
    modes = (*MODES, AUTO_MODE)  # and auto: per request, whichever of them its cost model predicts fastest
    engine = "llama.cpp" if llama else f"resident ({args.dtype})"
    baselines = baselines_to_run(args)
    print(f"starting the cloud ({args.target} on {engine}) and the edge daemon ({args.draft}, verifier "
          f"{args.verifier}); the first run converts and exports the models once", flush=True)
    cloud = CloudUnderTest(args.target, None if llama else args.dtype,  # llama.cpp: the GGUF's own types
                           {"draft": args.draft, "engine": "llama.cpp" if llama else None, "drain_s": 5},
                           startup_timeout_s=900)
    with cloud.running(args.out / "cloud.log") as running, \
            edge_daemon(["--draft", args.draft, "--verifier", args.verifier, "--cloud", running.address,
                         "--mode", "sprinter-exact", "--dtype", args.dtype,
                         "--model-name", f"{args.draft}+{args.target}"],
                        free_port(), args.out / "edge.log") as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="local", timeout=600, max_retries=0)
        print(f"cloud on {running.address}, edge API on {base}/v1\n", flush=True)
        answers = [ask_in_mode(client, mode, prompts, args.max_tokens, engine) for mode in modes]
    answers += ask_baselines(baselines, args, prompts) if baselines else []
    print("\nscoring every output with the target (NLL per token)", flush=True)
    rows = score(answers, prompts, args.target, args.dtype)
    print(f"\nsample ({modes[-1]}): {prompts[0]}\n{answers[len(modes) - 1].texts[0]}\n")
    print(format_table(rows, args.dtype))
    (args.out / "demo.json").write_text(json.dumps(
        {"dtype": args.dtype, "prompts": prompts, "rows": [asdict(r) for r in rows],
         "answers": [asdict(a) for a in answers]}, indent=1))
    print(f"\n(end to end through the OpenAI API, greedy, {len(prompts)} prompts, {args.dtype}; "
          f"wrote {args.out}/demo.json)")
    return 0
