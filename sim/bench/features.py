"""`sprinter bench features`: what each OpenAI feature costs, against the same request without it.

    sprinter bench features --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-features

The cloud and the edge (a daemon) run as processes, each on half of this process's cores, the edge dialling the
cloud directly (the system under test, sim/sweep/system.py, without its link). Greedy chat requests go through
the edge's API, interleaved: for every prompt and repeat, the plain request, then the same request with each
feature (a JSON schema of 5 typed fields, logprobs with the top 5, a named tool call), in each mode. Prints
tokens/s, target calls per token and the link's bytes per token (up and down) per feature and mode, each
against the plain request, and the grammar's step cost per token (a mask and an advance, replayed on the
outputs against the target's tokenizer). Writes OUT/results.json and OUT/table.md.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from common.errors import UsageError
from common.model.loading import model_dir
from common.sampling.grammar import GrammarCompiler
from common.sampling.params import GrammarSpec
from edge.api.tool_calls import tool_call_lark
from sim.bench.run_folder import RunFolder
from sim.bench.settings.sweeps import FeaturesBenchSettings
from sim.sweep.system import SystemSettings, SystemUnderTest, measure_here

log = logging.getLogger(__name__)

PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "height_m", "is_student", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
                         "is_student": {"type": "boolean"}, "city": {"enum": ["Oslo", "Lima", "Pune", "Perth"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city", "unit"],
                                                           "properties": {"city": {"type": "string", "maxLength": 24},
                                                                          "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
PROMPTS = ("Describe a fictional student who lives in Oslo.", "Invent a person from Lima and describe them.",
           "Tell me about someone tall from Perth.", "Make up a character from Pune, age and all.")
FEATURES: dict[str, dict[str, Any]] = {
    "plain": {},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                               "strict": True}}},
    "logprobs_top5": {"logprobs": True, "top_logprobs": 5},
    "tool_call": {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
}


@dataclass
class Run:
    feature: str
    mode: str
    prompt: int
    seconds: float
    tokens: int
    target_calls: int
    uplink_bytes: int
    downlink_bytes: int
    text: str = field(repr=False, default="")
    token_ids: list[int] = field(repr=False, default_factory=list)


def bench_features(settings: FeaturesBenchSettings) -> str:
    if not 1 <= settings.prompts <= len(PROMPTS):
        raise UsageError(f"--prompts takes 1 to {len(PROMPTS)} (the bench's own prompts), got {settings.prompts}")
    folder = RunFolder(settings.out)
    system = SystemSettings(settings.target, settings.draft, settings.out, dtype=settings.dtype, link=None,
                            edge_flags=("--verifier", "auto"))
    runs = measure_here(system, lambda sut: _drive(sut, settings))
    steps = grammar_step_us(settings.target, [r for r in runs if r.feature in ("json_schema", "tool_call")])
    folder.write_results(settings, grammar_step_us=steps, runs=runs)
    return folder.write_table(format_table(runs, steps, settings))


async def _drive(system: SystemUnderTest, settings: FeaturesBenchSettings) -> list[Run]:
    prompts = PROMPTS[: settings.prompts]
    runs, total = [], len(prompts) * settings.repeats * len(settings.modes) * len(FEATURES)
    async with httpx.AsyncClient(base_url=system.base, timeout=600) as client:
        for repeat in range(settings.repeats):
            for index, prompt in enumerate(prompts):
                for mode in settings.modes:
                    for feature, fields in FEATURES.items():  # interleaved: drift hits every feature alike
                        runs.append(await _one(client, feature, fields, mode, index, prompt, settings.max_tokens))
                        log.info("%d/%d %s %s: %.1f tokens/s", len(runs), total, mode, feature,
                                 runs[-1].tokens / runs[-1].seconds)
    return runs


async def _one(client: httpx.AsyncClient, feature: str, fields: dict[str, Any], mode: str, index: int, prompt: str,
               max_tokens: int) -> Run:
    body = {"model": "x", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "mode": mode, **fields}
    started = time.perf_counter()
    response = await client.post("/v1/chat/completions", json=body)
    seconds = time.perf_counter() - started
    response.raise_for_status()
    reply = response.json()
    stats, message = reply["sprinter"]["stats"], reply["choices"][0]["message"]
    text = message.get("content") or json.dumps(message.get("tool_calls"))
    return Run(feature, mode, index, seconds, reply["usage"]["completion_tokens"], stats["target_calls"],
               stats["uplink_bytes"], stats["downlink_bytes"], text, reply["sprinter"]["token_ids"])


def grammar_step_us(target: str, runs: list[Run]) -> dict[str, float]:
    """Median cost of one grammar step (the mask for the next token, then the advance) per feature, replayed on
    the runs' own outputs with the target's tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    directory = model_dir(target)  # the tokenizer and the logits width: no weights are loaded for a mask
    tokenizer = AutoTokenizer.from_pretrained(directory)
    compiler = GrammarCompiler(tokenizer, AutoConfig.from_pretrained(directory).get_text_config().vocab_size)
    specs = {"json_schema": GrammarSpec.json_schema(PERSON),
             "tool_call": GrammarSpec.lark(tool_call_lark([WEATHER], FEATURES["tool_call"]["tool_choice"], tokenizer))}
    costs: dict[str, list[float]] = {}
    for run in runs:
        matcher = compiler.compile(specs[run.feature]).matcher()
        for token in run.token_ids:
            started = time.perf_counter()
            allowed = matcher.allowed()
            if not bool(allowed[token]):
                break
            matcher.accept(token)
            costs.setdefault(run.feature, []).append((time.perf_counter() - started) * 1e6)
    return {feature: sorted(values)[len(values) // 2] for feature, values in costs.items()}


def format_table(runs: list[Run], steps: dict[str, float], settings: FeaturesBenchSettings) -> str:
    lines = [f"Features against the plain request: target {settings.target}, draft {settings.draft}, "
             f"{settings.dtype}, greedy, {settings.prompts} prompts x {settings.repeats} repeats, up to "
             f"{settings.max_tokens} tokens, interleaved.", "",
             "| mode | feature | tokens/s | vs plain | target calls/token | vs plain | uplink B/token | "
             "downlink B/token | grammar step us/token |", "|---|---|---|---|---|---|---|---|---|"]
    for mode in settings.modes:
        plain = _totals([r for r in runs if r.mode == mode and r.feature == "plain"])
        for feature in FEATURES:
            t = _totals([r for r in runs if r.mode == mode and r.feature == feature])
            step = f"{steps[feature]:.0f}" if feature in steps else "-"
            lines.append(f"| {mode} | {feature} | {t['tokens_per_s']:.2f} | {t['tokens_per_s'] / plain['tokens_per_s']:.2f}x"
                         f" | {t['calls_per_token']:.3f} | {t['calls_per_token'] / plain['calls_per_token']:.2f}x"
                         f" | {t['uplink']:.1f} | {t['downlink']:.1f} | {step} |")
    return "\n".join(lines)


def _totals(runs: list[Run]) -> dict[str, float]:
    tokens = sum(r.tokens for r in runs) or 1
    return {"tokens_per_s": tokens / sum(r.seconds for r in runs), "calls_per_token": sum(r.target_calls for r in runs) / tokens,
            "uplink": sum(r.uplink_bytes for r in runs) / tokens, "downlink": sum(r.downlink_bytes for r in runs) / tokens}
