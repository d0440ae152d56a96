"""bench-local: every local decoding mode and transformers' assisted generation, same pair, same prompts.

    python -m sim.bench_local --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-local

Prints a table, writes `results.json` (every run and the summary) and `tokens_per_s.png`.
Both models run in this one process; the network is not involved (see `sprinter simulate` for that).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from common.prompting import DTYPES, encode_prompt
from common.local_engine import DecodeSettings, LocalEngine
from common.models import LoadedModel, load_pair
from common.quality import agreement
from common.sampling import SamplingParams

log = logging.getLogger(__name__)
PROMPTS_FILE = Path(__file__).parent / "data" / "bench_prompts.jsonl"
OUR_MODES = ("target", "sd", "sd-block", "sprinter")


@dataclass(frozen=True)
class AssistedConfig:
    """One setting of transformers' assisted generation (`generate(assistant_model=...)`)."""

    name: str
    num_assistant_tokens: int
    schedule: str  # "constant" or "heuristic"
    confidence_threshold: float  # the assistant stops drafting below this probability (0 disables)


ASSISTED_CONFIGS = (
    AssistedConfig("hf-assisted-k5", 5, "constant", 0.0),
    AssistedConfig("hf-assisted-default", 20, "constant", 0.4),  # transformers' defaults
    AssistedConfig("hf-assisted-heuristic", 5, "heuristic", 0.0),
)


@dataclass
class RunRecord:
    prompt_index: int
    category: str
    temperature: float
    method: str
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    target_calls: int
    target_calls_per_token: float
    tokens_per_call: float | None
    accepted_len_mean: float | None
    agreement_with_target: float | None  # greedy only: share of positions equal to the target's output
    token_ids: list[int]


class ForwardCounter:
    """Counts a model's forward calls (transformers' assisted generation reports none itself)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = model.register_forward_pre_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


def run_assisted(target: LoadedModel, draft: LoadedModel, prompt_ids: list[int], config: AssistedConfig,
                 max_new_tokens: int, temperature: float, seed: int) -> tuple[list[int], float, int]:
    draft.model.generation_config.num_assistant_tokens = config.num_assistant_tokens
    draft.model.generation_config.num_assistant_tokens_schedule = config.schedule
    draft.model.generation_config.assistant_confidence_threshold = config.confidence_threshold
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
    counter = ForwardCounter(target.model)
    torch.manual_seed(seed)  # transformers samples from the global generator
    started = time.perf_counter()
    with torch.inference_mode():
        output = target.model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            assistant_model=draft.model, max_new_tokens=max_new_tokens,
            pad_token_id=target.tokenizer.pad_token_id or target.tokenizer.eos_token_id, **sampling,
        )
    wall_s = time.perf_counter() - started
    counter.close()
    return output[0, len(prompt_ids):].tolist(), wall_s, counter.calls


def summarise(records: list[RunRecord]) -> list[dict]:
    rows = []
    for temperature in sorted({r.temperature for r in records}):
        for method in dict.fromkeys(r.method for r in records):
            runs = [r for r in records if r.method == method and r.temperature == temperature]
            if not runs:
                continue
            tokens = sum(r.new_tokens for r in runs)
            calls = sum(r.target_calls for r in runs)
            accepted = [r.accepted_len_mean for r in runs if r.accepted_len_mean is not None]
            agreements = [r.agreement_with_target for r in runs if r.agreement_with_target is not None]
            rows.append({
                "temperature": temperature, "method": method, "runs": len(runs), "new_tokens": tokens,
                "tokens_per_s": tokens / sum(r.wall_s for r in runs),
                "target_calls_per_token": calls / tokens, "tokens_per_call": tokens / calls if calls else None,
                "accepted_len_mean": sum(accepted) / len(accepted) if accepted else None,
                "agreement_with_target": sum(agreements) / len(agreements) if agreements else None,
            })
    return rows


def format_table(rows: list[dict]) -> str:
    def cell(value: object) -> str:
        return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)

    columns = ["temperature", "method", "tokens_per_s", "target_calls_per_token", "tokens_per_call",
               "accepted_len_mean", "agreement_with_target", "new_tokens"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(temperatures)
    for i, temperature in enumerate(temperatures):
        values = [next((r["tokens_per_s"] for r in rows if r["method"] == m and r["temperature"] == temperature), 0)
                  for m in methods]
        ax.bar([x + i * width for x in range(len(methods))], values, width, label=f"T={temperature:g}")
    ax.set_xticks([x + width * (len(temperatures) - 1) / 2 for x in range(len(methods))], methods, rotation=20)
    ax.set_ylabel("tokens/s")
    ax.set_title("bench-local: decoding speed, both models in one process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--prompts", type=Path, default=PROMPTS_FILE, help="JSONL with prompt, chat, category")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--verifier-threshold", type=float, default=0.5, help="confidence verifier for sprinter")
    parser.add_argument("--assisted", default=",".join(c.name for c in ASSISTED_CONFIGS),
                        help="assisted-generation configs to run (comma list; empty for none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/bench-local"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_grad_enabled(False)

    from common.verifier import ConfidenceVerifier

    target, draft = load_pair(args.target, args.draft, DTYPES[args.dtype])
    engine = LocalEngine(target, draft, ConfidenceVerifier(args.verifier_threshold))
    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    assisted = [c for c in ASSISTED_CONFIGS if c.name in args.assisted.split(",")]

    # Warm-up: first calls pay for kernel selection and allocation.
    warm_ids = encode_prompt(target.tokenizer, "warm up", True)
    engine.generate(warm_ids, DecodeSettings(mode="sd", max_new_tokens=8))
    engine.generate(warm_ids, DecodeSettings(mode="target", max_new_tokens=4))

    records: list[RunRecord] = []
    jobs = [(t, i) for t in temperatures for i in range(len(prompts))]
    for temperature, index in tqdm(jobs, desc="bench-local (temperature, prompt)"):
        prompt = prompts[index]
        ids = encode_prompt(target.tokenizer, prompt["prompt"], prompt["chat"])
        sampling = SamplingParams(temperature=temperature, seed=args.seed + index)
        reference: list[int] | None = None
        for mode in OUR_MODES:
            result = engine.generate(ids, DecodeSettings(mode=mode, max_new_tokens=args.max_new_tokens, sampling=sampling, k=args.k))
            if mode == "target":
                reference = result.token_ids
            s = result.stats
            records.append(RunRecord(
                index, prompt["category"], temperature, mode, s.new_tokens, s.wall_s, s.tokens_per_s, s.target_calls,
                s.target_calls_per_token, s.tokens_per_call, s.accepted_len_mean,
                agreement(result.token_ids, reference) if temperature == 0 else None, result.token_ids))
        for config in assisted:
            tokens, wall_s, calls = run_assisted(target, draft, ids, config, args.max_new_tokens, temperature, args.seed + index)
            records.append(RunRecord(
                index, prompt["category"], temperature, config.name, len(tokens), wall_s, len(tokens) / wall_s, calls,
                calls / len(tokens), len(tokens) / calls, None,
                agreement(tokens, reference) if temperature == 0 else None, tokens))

    rows = summarise(records)
    table = format_table(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "target": args.target, "draft": args.draft, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
        "k": args.k, "verifier": f"confidence:{args.verifier_threshold}",
    }
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "summary": rows, "runs": [asdict(r) for r in records]}, indent=1))
    (args.out / "table.md").write_text(table + "\n")
    plot(rows, args.out / "tokens_per_s.png")
    print(f"\nwrote {args.out}/results.json, table.md, tokens_per_s.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
