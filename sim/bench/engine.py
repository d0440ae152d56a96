"""bench cloud --random-weights: the resident engine's verify forward, in-process, on any device.

    sprinter bench cloud --random-weights --device cuda --targets qwen2.5-1.5b,qwen2.5-7b \
        --edges 1,8,32,64 --contexts 128,1024,4096 --out results/bench-engine

No network, no gRPC stubs and no model packages: the target is a real architecture built from its
`config.json` with random weights, on the device (sim/bench/random_weights.py), and the benchmark
drives the engine's packed forward (cloud/packed_forward.py) the way the cloud's batcher does. Each
edge holds a session of about `--contexts` tokens; a round sends every edge's verify: the token of
its last verdict and `k` draft tokens (k + 1 new tokens, k + 1 rows read, greedy). With batching on
they share one forward; off, they run one after another, as `--max-batch 1` would serve them.

Random weights reject nearly every draft token, so by default a session's context grows one token
per round (the verdict's token). `--accepted N` (benchmarks only) advances each context by N
accepted tokens per round instead, as a recorded acceptance profile would.

Both of the resident engine's layouts are measured (`--attention`, default both): per-session
buffers with one attention call per session per layer, and the paged pool with one flex_attention
call per layer (fused on CUDA, unfused on a CPU; with query tiles per session on CUDA, as a paged cloud there
has them by default: cloud/query_tiles.py).

Reports, per target, layout, context and edge count: forward p50/p99 (one forward of the round), verify
p50/p99 (from the round's start to the edge's rows on the host: an unbatched edge waits for the
edges before it), and verified draft tokens/s. Writes results.json, table.md and a plot.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from cloud.kv_pool import KVPool, PagedKV
from cloud.packed_forward import forward_packed, install
from cloud.paged_attention import PAGE_TOKENS_PAGED
from cloud.resident_kv import KVLayout, ResidentKV
from cloud.settings import CloudSettings
from common.model.devices import resolve_device
from common.model.loading import DTYPES
from common.lab.plots import saved_figure
from common.stats import percentile
from common.sampling.params import SamplingParams
from common.spec.acceptance_rules import Proposal, decide
from sim.bench.random_weights import random_model
from sim.bench.run_folder import RunFolder
from sim.bench.settings.engines import EngineBenchSettings

PREFILL_CHUNK = 512  # prompt tokens per prefill forward


@dataclass
class EngineRow:
    target: str
    device: str
    attention: str
    context: int
    edges: int
    batching: bool
    forward_p50_ms: float
    forward_p99_ms: float
    verify_p50_ms: float
    verify_p99_ms: float
    tokens_per_s: float  # verified draft tokens per second, all edges together
    growth_per_round: float  # context tokens each session gained per round


@dataclass
class BenchSession:
    cache: ResidentKV | PagedKV
    pending: int  # the last verdict's token: fed first in the next verify


def open_sessions(model: torch.nn.Module, kv: KVLayout | KVPool, n: int, context: int,
                   rng: random.Random) -> list[BenchSession]:
    vocab = model.config.vocab_size
    sessions = []
    for _ in range(n):
        cache = new_cache(kv, context + 64)
        prompt = [rng.randrange(vocab) for _ in range(context)]
        prefill(model, cache, prompt[:-1])
        sessions.append(BenchSession(cache, prompt[-1]))
    return sessions


def new_cache(kv: KVLayout | KVPool, tokens: int) -> ResidentKV | PagedKV:
    """An empty session cache of the store's layout, with room reserved for `tokens`."""
    cache = kv.session() if isinstance(kv, KVPool) else ResidentKV(kv)
    cache.reserve(tokens)
    return cache


def prefill(model: torch.nn.Module, cache: ResidentKV | PagedKV, tokens: list[int]) -> None:
    """`tokens` into `cache`, PREFILL_CHUNK at a time, as the cloud prefills a prompt."""
    for start in range(0, len(tokens), PREFILL_CHUNK):
        forward_packed(model, [cache], [tokens[start:start + PREFILL_CHUNK]], [1], [False])


def _verify(model: torch.nn.Module, sessions: list[BenchSession], k: int, accepted: int | None,
            rng: random.Random) -> list[tuple[float, float]]:
    """One forward for `sessions`' verifies; each session's (forward, end) perf_counter times; caches roll back."""
    vocab = model.config.vocab_size
    blocks = [[rng.randrange(vocab) for _ in range(k)] for _ in sessions]
    pasts = [session.cache.length for session in sessions]
    tiles = CloudSettings(attention="paged").tiled(model.device.type)  # query tiles as a paged cloud there has them
    started = time.perf_counter()
    rows = forward_packed(model, [s.cache for s in sessions], [[s.pending] + b for s, b in zip(sessions, blocks)],
                          [k + 1] * len(sessions), [False] * len(sessions),
                          query_tiles=tiles)
    ended = time.perf_counter()  # the rows are on the host: the device has finished
    for session, block, past, row in zip(sessions, blocks, pasts, rows):
        verdict = decide(Proposal(block), "block", SamplingParams(), argmax=row.argmax.tolist())
        n_accepted, next_token = verdict.n_accepted, verdict.next_token
        if accepted is not None:
            n_accepted, next_token = min(accepted, k), block[min(accepted, k - 1)]
        session.cache.truncate(past + 1 + n_accepted)
        session.pending = next_token
    return [(ended - started, ended)] * len(sessions)


def _round(model: torch.nn.Module, sessions: list[BenchSession], settings: EngineBenchSettings, batching: bool,
           rng: random.Random) -> tuple[list[float], list[float], float]:
    """One round: every session verifies once. (forward times, verify latencies, round seconds)."""
    started = time.perf_counter()
    if batching:
        timings = _verify(model, sessions, settings.k, settings.accepted, rng)
    else:
        timings = [t for session in sessions for t in _verify(model, [session], settings.k, settings.accepted, rng)]
    round_s = time.perf_counter() - started
    forwards = [timings[0][0]] if batching else [forward_s for forward_s, _ in timings]
    return forwards, [end - started for _, end in timings], round_s


def measure_row(model: torch.nn.Module, kv: KVLayout | KVPool, target: str, context: int, n_edges: int,
                batching: bool, settings: EngineBenchSettings) -> EngineRow:
    rng = random.Random(context * 1000 + n_edges)
    sessions = open_sessions(model, kv, n_edges, context, rng)
    row = measure_sessions(model, sessions, target, context, batching, settings, rng)
    release(sessions)
    return row


def measure_sessions(model: torch.nn.Module, sessions: list[BenchSession], target: str, context: int, batching: bool,
                     settings: EngineBenchSettings, rng: random.Random) -> EngineRow:
    """Warmup and timed rounds of verifies over open `sessions` (their contexts grow as the verdicts say)."""
    start_length = sessions[0].cache.length
    forwards, latencies, seconds = [], [], 0.0
    for i in range(settings.warmup + settings.rounds):
        round_forwards, round_latencies, round_s = _round(model, sessions, settings, batching, rng)
        if i >= settings.warmup:
            forwards += round_forwards
            latencies += round_latencies
            seconds += round_s
    rounds = settings.warmup + settings.rounds
    growth = (sessions[0].cache.length - start_length) / rounds
    cache = sessions[0].cache
    return EngineRow(target, str(cache.layout.device), "paged" if isinstance(cache, PagedKV) else "per-session", context,
                     len(sessions), batching,
                     statistics.median(forwards) * 1e3, percentile(forwards, 0.99) * 1e3,
                     statistics.median(latencies) * 1e3, percentile(latencies, 0.99) * 1e3,
                     len(sessions) * settings.k * settings.rounds / seconds, growth)


def release(sessions: list[BenchSession]) -> None:
    for session in sessions:
        session.cache.release()


def format_table(rows: list[EngineRow]) -> str:
    lines = ["| target | device | attention | context | edges | batching | forward p50 ms | forward p99 ms | verify p50 ms | "
             "verify p99 ms | verified tok/s | batched/unbatched | context growth/round |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        key = (row.target, row.attention, row.context, row.edges)
        partner = next((r for r in rows if (r.target, r.attention, r.context, r.edges) == key and not r.batching), None)
        ratio = f"{row.tokens_per_s / partner.tokens_per_s:.2f}x" if row.batching and partner else ""
        lines.append(f"| {row.target} | {row.device} | {row.attention} | {row.context} | {row.edges} | {'on' if row.batching else 'off'} "
                     f"| {row.forward_p50_ms:.2f} | {row.forward_p99_ms:.2f} | {row.verify_p50_ms:.2f} "
                     f"| {row.verify_p99_ms:.2f} | {row.tokens_per_s:.0f} | {ratio} | {row.growth_per_round:.1f} |")
    return "\n".join(lines)


def plot(rows: list[EngineRow], path: Path) -> None:
    targets = sorted({r.target for r in rows})
    with saved_figure(path, 1, len(targets), figsize=(5.5 * len(targets), 4), squeeze=False) as (fig, axes):
        for ax, target in zip(axes[0], targets):
            for attention, context, batching in sorted({(r.attention, r.context, r.batching) for r in rows
                                                        if r.target == target}):
                line = sorted((r for r in rows if (r.target, r.attention, r.context, r.batching)
                               == (target, attention, context, batching)), key=lambda r: r.edges)
                ax.plot([r.edges for r in line], [r.tokens_per_s for r in line], marker="o" if batching else "x",
                        linestyle="-" if attention == "paged" else "--" if batching else ":",
                        label=f"{attention}, context {context}, batching {'on' if batching else 'off'}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set(xlabel="concurrent edges", ylabel="verified draft tokens/s")
            ax.set_title(f"{target} ({rows[0].device}, random weights)")
            ax.legend(fontsize=7)


def bench_engine(settings: EngineBenchSettings) -> str:
    """Every target, context, edge count and batching setting; writes OUT, returns the table."""
    device = resolve_device(settings.device)
    folder = RunFolder(settings.out)
    rows = []
    for target in settings.targets:
        model = random_model(target, DTYPES[settings.dtype], device)
        install(model)
        for attention in settings.attention:
            kv = kv_store(model, attention, settings)
            cases = [(c, e, b) for c in settings.contexts for e in settings.edges for b in settings.batching]
            for context, n_edges, batching in tqdm(cases, desc=f"{target} {attention} on {device}"):
                rows.append(measure_row(model, kv, target, context, n_edges, batching, settings))
            del kv
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    folder.write_results(settings, device_name=_device_name(device), rows=rows)
    table = folder.write_table(format_table(rows))
    plot(rows, folder.path("verified_tokens_per_s.png"))
    return table


def kv_store(model: torch.nn.Module, attention: str, settings: EngineBenchSettings) -> KVLayout | KVPool:
    """Per-session buffers, or a pool that holds every edge's longest context (as --kv-budget-mb would)."""
    longest = max(settings.contexts) + (settings.warmup + settings.rounds) * (settings.k + 1) + 64
    if attention == "per-session":
        return KVLayout.of(model, max_tokens=longest)
    if attention != "paged":
        raise ValueError(f"--attention {attention!r}: per-session or paged")
    layout = KVLayout.of(model, page_tokens=PAGE_TOKENS_PAGED, max_tokens=longest)
    return KVPool(layout, max(settings.edges) * layout.pages(longest) * layout.bytes_per_page)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
