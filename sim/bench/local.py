"""bench local: every local decoding mode and transformers' assisted generation, same pair, same prompts.

    sprinter bench local --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-local

Writes `results.json` (every run and the summary), `table.md` and `tokens_per_s.png`.
Both models run in this one process; the network is not involved (see `sprinter simulate` for that).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings, mode_of
from common.model.loading import DTYPES, LoadedModel, load_pair
from common.lab.plots import grouped_bars, saved_figure
from common.model.prompting import encode_prompt
from common.lab.quality import agreement
from common.sampling.distributions import SamplingParams
from common.spec.verifier import ConfidenceVerifier
from sim.bench.prompts import load_bench_prompts
from sim.bench.run_folder import RunFolder
from sim.bench.settings.engines import ASSISTED_CONFIGS, AssistedConfig, LocalBenchSettings

log = logging.getLogger(__name__)
OUR_MODES = ("target", "sd", "sd-block", "sprinter")  # a choice of what to time, not a trait (tests/house/test_layout.py)


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
    temperatures = sorted({r["temperature"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))

    def rate(method: str, temperature: float) -> float:
        return next((r["tokens_per_s"] for r in rows if r["method"] == method and r["temperature"] == temperature), 0)
    with saved_figure(path, figsize=(9, 4)) as (fig, ax):
        grouped_bars(ax, methods, {f"T={t:g}": [rate(m, t) for m in methods] for t in temperatures}, rotation=20)
        ax.set_ylabel("tokens/s")
        ax.set_title("bench-local: decoding speed, both models in one process")
        ax.legend()


def warm_up(engine: LocalDecoder, tokenizer: PreTrainedTokenizerBase) -> None:
    """First calls pay for kernel selection and allocation: pay them outside the timings."""
    warm_ids = encode_prompt(tokenizer, "warm up", True)
    engine.generate(warm_ids, DecodeSettings(mode="sd", max_new_tokens=8))
    engine.generate(warm_ids, DecodeSettings(mode="target", max_new_tokens=4))


def run_prompt(engine: LocalDecoder, target: LoadedModel, draft: LoadedModel, prompt: dict[str, Any], index: int,
               temperature: float, assisted: list[AssistedConfig], settings: LocalBenchSettings) -> list[RunRecord]:
    """Our modes (target first: the reference of agreement) and the assisted configs on one prompt."""
    ids = encode_prompt(target.tokenizer, prompt["prompt"], prompt["chat"])
    sampling = SamplingParams(temperature=temperature, seed=settings.seed + index)
    records: list[RunRecord] = []
    reference: list[int] | None = None
    for mode in OUR_MODES:
        result = engine.generate(ids, DecodeSettings(mode=mode, max_new_tokens=settings.max_new_tokens,
                                                     sampling=sampling, k=settings.k))
        if mode_of(mode).reference:
            reference = result.token_ids
        s = result.stats
        records.append(RunRecord(
            index, prompt["category"], temperature, mode, s.new_tokens, s.wall_s, s.tokens_per_s, s.target_calls,
            s.target_calls_per_token, s.tokens_per_call, s.accepted_len_mean,
            agreement(result.token_ids, reference) if temperature == 0 else None, result.token_ids))
    for config in assisted:
        tokens, wall_s, calls = run_assisted(target, draft, ids, config, settings.max_new_tokens, temperature,
                                             settings.seed + index)
        records.append(RunRecord(
            index, prompt["category"], temperature, config.name, len(tokens), wall_s, len(tokens) / wall_s, calls,
            calls / len(tokens), len(tokens) / calls, None,
            agreement(tokens, reference) if temperature == 0 else None, tokens))
    return records


@torch.no_grad()  # scoped: a process-wide set_grad_enabled(False) outlives the bench (tests run after it)
def bench_local(settings: LocalBenchSettings) -> str:
    """Every mode and assisted config on every prompt at every temperature; writes OUT, returns the table."""
    target, draft = load_pair(settings.target, settings.draft, DTYPES[settings.dtype])
    engine = LocalDecoder(target, draft, ConfidenceVerifier(settings.verifier_threshold))
    prompts = load_bench_prompts(settings.prompts)
    assisted = [c for c in ASSISTED_CONFIGS if c.name in settings.assisted]
    warm_up(engine, target.tokenizer)
    records: list[RunRecord] = []
    jobs = [(t, i) for t in settings.temperatures for i in range(len(prompts))]
    for temperature, index in tqdm(jobs, desc="bench-local (temperature, prompt)"):
        records += run_prompt(engine, target, draft, prompts[index], index, temperature, assisted, settings)
    rows = summarise(records)
    folder = RunFolder(settings.out)
    folder.write_results(settings, torch_threads=torch.get_num_threads(), summary=rows, runs=records)
    table = folder.write_table(format_table(rows))
    plot(rows, folder.path("tokens_per_s.png"))
    return table
