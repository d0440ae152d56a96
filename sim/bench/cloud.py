"""bench cloud: how much verification one cloud process serves to N concurrent edges, batching on vs off.

    sprinter bench cloud --targets smollm2-135m,qwen2.5-coder-1.5b --edges 1,2,4,8,16 --contexts 128,1024,4096 \
        --out results/bench-cloud

Each synthetic edge replays draft blocks recorded from the pair's draft model (greedy, k tokens per
block) over its own Session stream, as fast as verdicts come back, on top of a prompt of about each
`--contexts` length (the bench prompt, preceded by filler text cut from the other prompts). The cloud
runs as a separate process (`sprinter cloud serve`), once with batching on and once with `--max-batch 1`.
`--device` puts the resident engine's target on a GPU; `--random-weights` runs the engine in-process
instead, on real architectures with random weights (sim/bench/engine.py: for GPU hosts without model
packages). `--engine resident|vllm` picks the cloud's engine (vllm: from `make vllm`'s environment), and its
rows are labelled by the engine; `--source DIR --label NAME` runs the cloud from another checkout
(say, a git worktree of an older commit) under another label, so two engines or two versions of one
are compared on one machine in one run (rows of other labels in OUT/results.json are kept).
Reports verified tokens/s, p50/p99 verify latency and, for vllm, the share of the context served
from its prefix cache; writes results.json, table.md and a plot.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from common.spec.local_decoder import LocalDecoder
from common.spec.modes import DecodeSettings
from common.model.loading import load_model
from common.lab.plots import saved_figure
from common.model.prompting import encode_prompt
from common.stats import percentile
from sim.bench.prompts import load_bench_prompts
from sim.bench.run_folder import RunFolder
from sim.bench.settings.engines import CloudBenchSettings

if TYPE_CHECKING:
    from sim.cloud_under_test import CloudUnderTest
    from sprinter.v1 import decoding_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
DEFAULT_DRAFTS = {"smollm2-135m": "smollm2-135m:layers=8", "qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}


@dataclass(frozen=True)
class RecordedEdge:
    prompt_ids: list[int]
    blocks: list[list[int]]


@dataclass
class BenchRow:
    target: str
    engine: str  # the row's label: an engine (resident, vllm), or a name for another checkout's
    context: int  # prompt tokens each edge's session opened with (0: the bench prompts as they are)
    edges: int
    batching: bool
    verified_tokens_per_s: float
    verify_p50_ms: float
    verify_p99_ms: float
    cloud_batch_size_mean: float
    verify_calls: int
    prefix_cache_share: float | None = None  # vllm: context tokens served from its prefix cache / all context tokens


def with_context(edges: list[RecordedEdge], context: int) -> list[RecordedEdge]:
    """Each edge's prompt preceded by filler (the other prompts' tokens, cycled) up to `context` tokens."""
    if context <= 0:
        return edges
    filler = [t for edge in edges for t in edge.prompt_ids]
    padded = []
    for edge in edges:
        missing = max(0, context - len(edge.prompt_ids))
        prefix = (filler * (missing // max(1, len(filler)) + 1))[:missing]
        padded.append(RecordedEdge(prefix + edge.prompt_ids, edge.blocks))
    return padded


def record_edges(target: str, draft: str, k: int, n_tokens: int) -> list[RecordedEdge]:
    """Draft continuations of the shipped bench prompts, cut into k-token blocks."""
    model = load_model(draft)
    engine = LocalDecoder(None, model)
    recorded = []
    for prompt in load_bench_prompts():
        ids = encode_prompt(model.tokenizer, prompt["prompt"], prompt["chat"])
        tokens = engine.generate(ids, DecodeSettings(mode="draft", max_new_tokens=n_tokens)).token_ids
        tokens += [tokens[-1]] * (n_tokens - len(tokens))  # an early EOS still leaves blocks to replay
        recorded.append(RecordedEdge(ids, [tokens[i:i + k] for i in range(0, n_tokens - k + 1, k)]))
    return recorded


async def run_edge(stub: pb_grpc.TargetServiceStub, edge: RecordedEdge, rounds: int, start: asyncio.Event,
                   latencies_ms: list[float], batch_sizes: list[int], opened: asyncio.Semaphore) -> int:
    import grpc  # the replay's imports are its own: --random-weights runs without gRPC stubs

    from common import wire

    call = stub.Session()
    await call.write(wire.open_frame(edge.prompt_ids))
    answer = await call.read()
    if answer.WhichOneof("frame") != "opened":
        raise RuntimeError(f"cloud refused the session: {answer}")
    context_length = answer.opened.context_length
    opened.release()
    await start.wait()
    verified = 0
    for i in range(rounds):
        block = edge.blocks[i % len(edge.blocks)]
        sent = time.perf_counter()
        await call.write(wire.verify_frame(wire.verify_block(context_length, block, "block")))
        frame = await call.read()
        if frame.WhichOneof("frame") != "verdict":
            raise RuntimeError(f"cloud refused a replayed block: {frame}")
        latencies_ms.append((time.perf_counter() - sent) * 1e3)
        batch_sizes.append(frame.verdict.cloud_batch_size)
        context_length = frame.verdict.context_length
        verified += len(block)
    await call.write(wire.close_frame())
    await call.done_writing()
    status = await call.code()  # the stream's final status
    if status != grpc.StatusCode.OK:
        raise RuntimeError(f"session stream ended with {status}: {await call.details()}")
    return verified


async def measure(address: str, edges: list[RecordedEdge], n_edges: int, rounds: int) -> tuple[float, list[float], list[int]]:
    import grpc

    from sprinter.v1 import decoding_pb2_grpc as pb_grpc

    latencies_ms: list[float] = []
    batch_sizes: list[int] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TargetServiceStub(channel)
        start = asyncio.Event()
        opened = asyncio.Semaphore(0)
        tasks = [asyncio.create_task(run_edge(stub, edges[i % len(edges)], rounds, start, latencies_ms, batch_sizes,
                                              opened))
                 for i in range(n_edges)]
        for _ in range(n_edges):  # every session opened (and its prompt prefilled) before the clock starts
            await opened.acquire()
        started = time.perf_counter()
        start.set()
        verified = sum(await asyncio.gather(*tasks))
        return verified / (time.perf_counter() - started), latencies_ms, batch_sizes


def format_table(rows: list[BenchRow]) -> str:
    """speedup: over the same engine unbatched; vs old: over the first other engine's row with the same batching."""
    lines = ["| target | engine | context | edges | batching | verified tokens/s | speedup | vs other engine | "
             "p50 ms | p99 ms | mean batch | prefix cache |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        def same(r: BenchRow) -> bool:
            return (r.target, r.context, r.edges) == (row.target, row.context, row.edges)
        off = next((r for r in rows if same(r) and r.engine == row.engine and not r.batching), None)
        other = next((r for r in rows if same(r) and r.engine != row.engine and r.batching == row.batching), None)
        speedup = f"{row.verified_tokens_per_s / off.verified_tokens_per_s:.2f}x" if off else "-"
        versus = f"{row.verified_tokens_per_s / other.verified_tokens_per_s:.2f}x" if other else "-"
        cached = f"{row.prefix_cache_share:.0%}" if row.prefix_cache_share is not None else "-"
        lines.append(f"| {row.target} | {row.engine} | {row.context} | {row.edges} | {'on' if row.batching else 'off'} | "
                     f"{row.verified_tokens_per_s:.1f} | {speedup} | {versus} | {row.verify_p50_ms:.0f} | "
                     f"{row.verify_p99_ms:.0f} | {row.cloud_batch_size_mean:.2f} | {cached} |")
    return "\n".join(lines)


def plot(rows: list[BenchRow], path: Path) -> None:
    """Verified tokens/s against edges: a panel per target and context, a line per engine and batching."""
    panels = list(dict.fromkeys((r.target, r.context) for r in rows))
    with saved_figure(path, 1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False) as (fig, axes):
        for ax, (target, context) in zip(axes[0], panels):
            for engine in dict.fromkeys(r.engine for r in rows):
                for batching in (True, False):
                    series = [r for r in rows if (r.target, r.context, r.engine, r.batching) == (target, context, engine,
                                                                                                   batching)]
                    if series:
                        ax.plot([r.edges for r in series], [r.verified_tokens_per_s for r in series], marker="o",
                                linestyle="-" if batching else ":", label=f"{engine}, batching {'on' if batching else 'off'}")
            ax.set_xscale("log", base=2)
            ax.set(xlabel="concurrent edges", ylabel="verified tokens/s")
            ax.set_title(f"{target}, context {context}")
            ax.legend(fontsize=7)


def cache_share(before: dict[str, float], after: dict[str, float]) -> float | None:
    """vllm: context tokens served from its prefix cache over all prompt tokens verified between two scrapes."""
    cached, computed = (after.get(k, 0.0) - before.get(k, 0.0) for k in
                        ("sprinter_cloud_engine_cached_tokens_total", "sprinter_cloud_forward_tokens_sum"))
    return cached / (cached + computed) if cached else None


def cloud_under_test(settings: CloudBenchSettings, target: str, batching: bool) -> CloudUnderTest:
    from sim.cloud_under_test import CloudUnderTest

    longest = max(settings.contexts) + settings.k * (settings.rounds + 2) + 64
    source = settings.source.resolve() if settings.source is not None else None
    flags = {"engine": settings.engine,
             "device": None if settings.device == "auto" else settings.device,  # an older cloud may lack --device
             "max_context": max(4096, longest), "max_batch": settings.max_batch if batching else 1,
             "max_sessions": max(settings.edges) + 4,
             # vLLM allocates its whole KV cache at start: 2 GiB holds 16 edges at 4k tokens of SmolLM2 in bf16.
             "kv_budget_mb": 2048 if settings.engine == "vllm" else 16384, "batch_window_ms": settings.batch_window_ms}
    return CloudUnderTest(target, settings.dtype, flags, cpus=frozenset(settings.cpus) or None,
                          pythonpath=f"{source}:{source / 'proto'}" if source else None, metrics=True)


def measure_cloud(settings: CloudBenchSettings, target: str, batching: bool, edges: list[RecordedEdge]) -> list[BenchRow]:
    """One cloud process for `target`, batching on or off (`--max-batch 1`); a row per context and edge count."""
    label = settings.row_label
    log_path = settings.out / f"cloud-{target}-{label}-{'batched' if batching else 'unbatched'}.log"
    rows = []
    with cloud_under_test(settings, target, batching).running(log_path) as cloud:
        asyncio.run(measure(cloud.address, edges, 1, 2))  # warm-up
        for context in settings.contexts:
            replayed = with_context(edges, context)
            for n_edges in tqdm(settings.edges, desc=f"{target} {label} context {context} "
                                                     f"batching {'on' if batching else 'off'}"):
                before = cloud.metrics()
                tokens_per_s, latencies, batch_sizes = asyncio.run(measure(cloud.address, replayed, n_edges,
                                                                           settings.rounds))
                rows.append(BenchRow(target, label, context, n_edges, batching,
                                     tokens_per_s, statistics.median(latencies), percentile(latencies, 0.99),
                                     statistics.fmean(batch_sizes), len(latencies), cache_share(before, cloud.metrics())))
    return rows


def _earlier_rows(settings: CloudBenchSettings, folder: RunFolder) -> list[BenchRow]:
    """Rows already in OUT/results.json that this run does not measure again (other engines, targets or contexts),
    so runs with another --engine or other --contexts add to one table."""
    rows = [BenchRow(**row) for row in (folder.read_results() or {"rows": []})["rows"] if "engine" in row]
    return [row for row in rows if not (row.engine == settings.row_label and row.target in settings.targets
                                        and row.context in settings.contexts and row.batching in settings.batchings)]


def bench_cloud(settings: CloudBenchSettings) -> str:
    """Every target, batching on and off, every context and edge count; writes OUT, returns the table.
    --random-weights: the engine bench in this process instead (sim/bench/engine.py)."""
    if settings.random_weights:
        from sim.bench.engine import bench_engine

        return bench_engine(settings.in_process())
    settings = settings.with_defaults()
    folder = RunFolder(settings.out)
    rows = _earlier_rows(settings, folder)
    for target in settings.targets:
        edges = record_edges(target, DEFAULT_DRAFTS.get(target, target), settings.k,
                             n_tokens=settings.k * settings.rounds)
        for batching in settings.batchings:
            rows += measure_cloud(settings, target, batching, edges)
    rows.sort(key=lambda r: (r.target, r.context, r.edges, r.engine, not r.batching))
    folder.write_results(settings, rows=rows)
    table = folder.write_table(format_table(rows))
    plot(rows, folder.path("verified_tokens_per_s.png"))
    return table
