"""`sprinter bench llama-cpp`: the cloud's llama.cpp engine against llama.cpp's own programs, same core, same GGUF.

Each measurement runs beside what a user of this machine would run instead, on the same pinned core:

  verify   EDGES sessions of CONTEXT tokens each verify a BLOCK-token block, in process (the engine and its
           batcher): all in one forward (the engine's batching), then one after another; beside them the same
           blocks in one llama_decode through llama.cpp's C API alone (unified KV, then a KV stream per sequence),
           and llama-bench's pp(EDGES x BLOCK) and pp(BLOCK) at depth CONTEXT (one sequence, one row read).
  decode   mode target: the cloud (`cloud serve --engine llama.cpp --threads 1`, and `--engine resident` in
           bfloat16 where the target is a preset) streams a Generate per prompt over gRPC; llama-server (-t 1)
           streams /completion for the same token ids; greedy, each with its
           prompt cache (the shared chat template's prefix), one request at a time, interleaved. Tokens over wall time (prefill included), and decode tokens/s
           (the tokens after the first over the time after it).
  turns    a conversation's second turn (the first turn's prompt and answer, then the next question): its
           time to the first token with the prefix cache, and on a cloud started with --no-prefix-cache.

    sprinter bench llama-cpp --target qwen2.5-coder-1.5b --out results/bench-llama-cpp

Writes results.json, table.md and plot.png into --out; the verify step's prefill (EDGES x CONTEXT tokens)
takes a few minutes on one core.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import httpx

from common.model.loading import gguf_file, load_gguf_tokenizer
from common.model.presets import GGUF_PRESETS
from common.model.prompting import encode_prompt
from sim.bench.prompts import load_bench_prompts
from sim.bench.run_folder import RunFolder, jsonable
from sim.bench.settings.engines import LlamaCppBenchSettings
from sim.bench.timed_generate import generate_at
from sim.cloud_under_test import CloudUnderTest
from sim.sweep.baselines import LocalBaselines, llama_program


@dataclass
class LlamaCppBenchResult:
    settings: dict
    verify: dict = field(default_factory=dict)
    decode: dict = field(default_factory=dict)
    turns: dict = field(default_factory=dict)


def bench_llama_cpp(settings: LlamaCppBenchSettings) -> str:
    result = LlamaCppBenchResult(jsonable(settings))
    gguf = gguf_file(settings.target)
    folder = RunFolder(settings.out)
    if "verify" in settings.steps:
        result.verify = measure_verify(settings, gguf)
    if "decode" in settings.steps:
        result.decode = measure_decode(settings, gguf)
    if "turns" in settings.steps:
        result.turns = measure_turns(settings, gguf)
    folder.write_results(settings, verify=result.verify, decode=result.decode, turns=result.turns)
    table = folder.write_table(format_table(result))
    plot(result, folder.path("plot.png"))
    return table


def measure_verify(settings: LlamaCppBenchSettings, gguf: Path) -> dict:
    """Verified tokens/s of EDGES blocks at CONTEXT: batched, one by one (ours), and llama-bench's."""
    from sim.bench.llama_cpp_verify import c_api_verifies, timed_verifies

    os.sched_setaffinity(0, {settings.core})
    batched_s, alone_s = asyncio.run(timed_verifies(settings.target, settings.edges, settings.block,
                                                    settings.context, settings.repeats))
    tokens = settings.edges * settings.block
    c_api = {unified: median(c_api_verifies(settings.target, settings.edges, settings.block, settings.context,
                                            settings.repeats, unified)) for unified in (True, False)}
    bench = llama_bench(gguf, settings.core, [tokens, settings.block], settings.context)
    return {"verified_tokens": tokens,
            "c_api_unified_tokens_per_s": tokens / c_api[True], "c_api_streams_tokens_per_s": tokens / c_api[False],
            "batched_tokens_per_s": tokens / median(batched_s), "batched_forward_s": batched_s,
            "one_by_one_tokens_per_s": tokens / sum(median(s) for s in alone_s),
            "one_forward_s": [median(s) for s in alone_s],
            f"llama_bench_pp{tokens}_tokens_per_s": bench[tokens],
            f"llama_bench_pp{settings.block}_tokens_per_s": bench[settings.block]}


def llama_bench(gguf: Path, core: int, prompt_sizes: list[int], depth: int) -> dict[int, float]:
    """llama-bench's prompt-processing tokens/s for each size at `depth`, one thread on `core`."""
    command = ["taskset", "-c", str(core), llama_program("llama-bench"), "-m", str(gguf), "-t", "1", "-n", "0", "-r", "3",
               "-p", ",".join(map(str, prompt_sizes)), "-d", str(depth), "-o", "json"]
    rows = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    return {row["n_prompt"]: row["avg_ts"] for row in rows}


DECODE_ROWS = {"sprinter_llama_cpp": "sprinter cloud, --engine llama.cpp (gRPC Generate)",
               "sprinter_resident": "sprinter cloud, --engine resident, bfloat16 (gRPC Generate)",
               "llama_server": "llama-server"}


def measure_decode(settings: LlamaCppBenchSettings, gguf: Path) -> dict:
    """Mode target on our cloud, on each engine (the resident one where the target is a preset it loads), against
    llama-server: the same prompts' token ids, interleaved per prompt, every process on the same core."""
    tokenizer = load_gguf_tokenizer(gguf)
    prompts = [encode_prompt(tokenizer, p["prompt"], p["chat"]) for p in load_bench_prompts()[:settings.prompts]]
    clouds = {"sprinter_llama_cpp": _llama_cpp_cloud(settings)}
    if settings.target in GGUF_PRESETS:
        clouds["sprinter_resident"] = CloudUnderTest(settings.target, "bfloat16", {"engine": "resident"},
                                                     cpus=frozenset({settings.core}))
    runs: dict[str, list[dict]] = {name: [] for name in [*clouds, "llama_server"]}
    with LocalBaselines(("llama-server",), settings.target, settings.target, settings.out, {settings.core},
                        None) as server, ExitStack() as started:
        addresses = {name: started.enter_context(cloud.running(settings.out / f"cloud-{name}.log")).address
                     for name, cloud in clouds.items()}
        for ids in prompts:
            for name, address in addresses.items():
                runs[name].append(asyncio.run(generate_at(address, ids, settings.max_new_tokens)).record())
            runs["llama_server"].append(asyncio.run(_llama_server_stream(server, ids, settings.max_new_tokens)))
    return {**{name: _rates(r) for name, r in runs.items()}, "prompts": len(prompts), "per_prompt": runs}


def _llama_cpp_cloud(settings: LlamaCppBenchSettings, *flags: str) -> CloudUnderTest:
    return CloudUnderTest(settings.target, None, {"engine": "llama.cpp"}, ("--threads", "1", *flags),
                          cpus=frozenset({settings.core}))


def measure_turns(settings: LlamaCppBenchSettings, gguf: Path) -> dict:
    """A conversation's second turn (the first turn's prompt and answer, then the next question): its time to the
    first token on a cloud with the prefix cache and on one without, the same turns."""
    tokenizer = load_gguf_tokenizer(gguf)
    texts = [p["prompt"] for p in load_bench_prompts()[:settings.prompts + 1]]
    firsts = [encode_prompt(tokenizer, text, True) for text in texts[:-1]]
    follow = [tokenizer(f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)["input_ids"] for text in texts[1:]]
    out: dict = {"second_turn_tokens": []}
    for label, flags in (("cached", ()), ("cold", ("--no-prefix-cache",))):
        ttft, cached = [], []
        with _llama_cpp_cloud(settings, *flags).running(settings.out / f"cloud-turns-{label}.log") as cloud:
            for first, then in zip(firsts, follow):
                answer = asyncio.run(generate_at(cloud.address, first, settings.max_new_tokens)).token_ids
                second = asyncio.run(generate_at(cloud.address, first + answer + then, 1))
                ttft.append(second.first_s)
                cached.append(second.cached_tokens)
                if label == "cached":
                    out["second_turn_tokens"].append(len(first + answer + then))
        out[label] = {"ttft_s": ttft, "ttft_s_median": median(ttft), "cached_tokens": cached}
    out["cached_over_cold"] = out["cached"]["ttft_s_median"] / out["cold"]["ttft_s_median"]
    return out


async def _llama_server_stream(server: LocalBaselines, ids: list[int], max_new: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        streamed = await server.stream(client, "llama-server", ids, max_new)
    return {"tokens": len(streamed["token_ids"]), "first_s": streamed["first_s"], "wall_s": streamed["wall_s"],
            "token_ids": streamed["token_ids"]}


def _rates(runs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    return {"tokens": tokens, "tokens_per_s": tokens / sum(r["wall_s"] for r in runs),
            "decode_tokens_per_s": sum(r["tokens"] - 1 for r in runs) / sum(r["wall_s"] - r["first_s"] for r in runs),
            "ttft_s_median": median(r["first_s"] for r in runs)}


def format_table(result: LlamaCppBenchResult) -> str:
    lines = ["Every row on one pinned core, one thread; the same GGUF file.", ""]
    v, d = result.verify, result.decode
    if v:
        n = v["verified_tokens"]
        block = n // result.settings["edges"]
        lines += ["| verify | tokens/s | vs llama-bench pp |", "| --- | --- | --- |",
                  f"| sprinter llama.cpp engine, {result.settings['edges']} blocks in one forward | "
                  f"{v['batched_tokens_per_s']:.1f} | {v['batched_tokens_per_s'] / v[f'llama_bench_pp{n}_tokens_per_s']:.2f}x pp{n} |",
                  f"| the same blocks one by one | {v['one_by_one_tokens_per_s']:.1f} | "
                  f"{v['one_by_one_tokens_per_s'] / v[f'llama_bench_pp{block}_tokens_per_s']:.2f}x pp{block} |",
                  f"| llama.cpp's C API alone, the same blocks in one llama_decode, unified KV | "
                  f"{v['c_api_unified_tokens_per_s']:.1f} | {v['c_api_unified_tokens_per_s'] / v[f'llama_bench_pp{n}_tokens_per_s']:.2f}x pp{n} |",
                  f"| the same, a KV stream per sequence | {v['c_api_streams_tokens_per_s']:.1f} | "
                  f"{v['c_api_streams_tokens_per_s'] / v[f'llama_bench_pp{n}_tokens_per_s']:.2f}x pp{n} |",
                  f"| llama-bench pp{n} at depth {result.settings['context']} | {v[f'llama_bench_pp{n}_tokens_per_s']:.1f} | 1.00x |",
                  f"| llama-bench pp{block} at depth {result.settings['context']} | "
                  f"{v[f'llama_bench_pp{block}_tokens_per_s']:.1f} | |",
                  "", f"Batching gives {v['batched_tokens_per_s'] / v['one_by_one_tokens_per_s']:.2f}x one by one; the "
                  f"engine gives {v['batched_tokens_per_s'] / v['c_api_unified_tokens_per_s']:.2f}x llama.cpp's own "
                  f"decode of the same batch. llama-bench's pp{n} is one sequence over one context, reading one row.", ""]
    if d:
        theirs = d["llama_server"]
        lines += ["| mode target | tokens/s (wall) | decode tokens/s | decode vs llama-server | TTFT p50 (s) |",
                  "| --- | --- | --- | --- | --- |"]
        for key, name in DECODE_ROWS.items():
            if key in d:
                r = d[key]
                lines.append(f"| {name} | {r['tokens_per_s']:.2f} | {r['decode_tokens_per_s']:.2f} | "
                             f"{r['decode_tokens_per_s'] / theirs['decode_tokens_per_s']:.2f}x | {r['ttft_s_median']:.3f} |")
        lines += ["", f"{d['prompts']} prompts, interleaved.", ""]
    t = result.turns
    if t:
        lines += ["| a conversation's second turn | time to first token p50 (s) | prompt tokens from the cache |",
                  "| --- | --- | --- |",
                  f"| prefix cache on | {t['cached']['ttft_s_median']:.3f} | {median(t['cached']['cached_tokens']):.0f} |",
                  f"| --no-prefix-cache | {t['cold']['ttft_s_median']:.3f} | 0 |", "",
                  f"The second turn ({median(t['second_turn_tokens']):.0f} prompt tokens, median) starts in "
                  f"{t['cached_over_cold']:.2f}x the cold time."]
    return "\n".join(lines)


def plot(result: LlamaCppBenchResult, path: Path) -> None:
    from common.lab.plots import saved_figure

    with saved_figure(path, 1, 2, dpi=110, figsize=(10, 3.5)) as (_, axes):
        _draw(result, axes)


def _draw(result: LlamaCppBenchResult, axes) -> None:
    v, d = result.verify, result.decode
    if v:
        n, block = v["verified_tokens"], v["verified_tokens"] // result.settings["edges"]
        bars = {"ours, batched": v["batched_tokens_per_s"], "ours, one by one": v["one_by_one_tokens_per_s"],
                "C API, unified KV": v["c_api_unified_tokens_per_s"],
                "C API, stream per seq": v["c_api_streams_tokens_per_s"],
                f"llama-bench pp{n}": v[f"llama_bench_pp{n}_tokens_per_s"],
                f"llama-bench pp{block}": v[f"llama_bench_pp{block}_tokens_per_s"]}
        axes[0].barh(list(bars), list(bars.values()), color=["C0", "C0", "C1", "C1", "C1", "C1"])
        axes[0].set_title(f"verify: {result.settings['edges']} x {block} tokens at {result.settings['context']}")
        axes[0].set_xlabel("verified tokens/s")
    if d:
        labels = {"sprinter_llama_cpp": "ours, llama.cpp", "sprinter_resident": "ours, resident bf16",
                  "llama_server": "llama-server"}
        bars = {label: d[key]["decode_tokens_per_s"] for key, label in labels.items() if key in d}
        axes[1].barh(list(bars), list(bars.values()), color=["C1" if "llama-server" in b else "C0" for b in bars])
        axes[1].set(title="mode target: decode", xlabel="tokens/s")
