"""bench cloud: how much verification one cloud process serves to N concurrent edges, batching on vs off.

    sprinter bench cloud --targets smollm2-135m,qwen2.5-coder-1.5b --edges 1,2,4,8,16 --out results/bench-cloud

Each synthetic edge replays draft blocks recorded from the pair's draft model (greedy, k tokens per
block) over its own Session stream, as fast as verdicts come back. The cloud runs as a separate
process (`sprinter cloud serve`), once with batching on and once with `--max-batch 1`.
Reports verified tokens/s and p50/p99 verify latency; writes results.json, table.md and a plot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
from tqdm import tqdm

from common.decoding.local_engine import LocalEngine
from common.decoding.modes import DecodeSettings
from common.models import load_model
from common.plots import pyplot
from common.prompting import encode_prompt
from sim.bench.prompts import load_bench_prompts
from sim.processes import cloud_process
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
DEFAULT_DRAFTS = {"smollm2-135m": "smollm2-135m:layers=8", "qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}


@dataclass(frozen=True)
class CloudBenchSettings:
    targets: tuple[str, ...] = ("smollm2-135m", "qwen2.5-coder-1.5b")
    edges: tuple[int, ...] = (1, 2, 4, 8, 16)
    rounds: int = 8  # verify calls per edge
    k: int = 5  # draft tokens per block
    batch_window_ms: float = 5.0
    max_batch: int = 16
    dtype: str = "bfloat16"
    out: Path = Path("results/bench-cloud")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "out": str(self.out)}


@dataclass(frozen=True)
class RecordedEdge:
    prompt_ids: list[int]
    blocks: list[list[int]]


@dataclass
class BenchRow:
    target: str
    edges: int
    batching: bool
    verified_tokens_per_s: float
    verify_p50_ms: float
    verify_p99_ms: float
    cloud_batch_size_mean: float
    verify_calls: int


def record_edges(target: str, draft: str, k: int, n_tokens: int) -> list[RecordedEdge]:
    """Draft continuations of the shipped bench prompts, cut into k-token blocks."""
    model = load_model(draft)
    engine = LocalEngine(None, model)
    recorded = []
    for prompt in load_bench_prompts():
        ids = encode_prompt(model.tokenizer, prompt["prompt"], prompt["chat"])
        tokens = engine.generate(ids, DecodeSettings(mode="draft", max_new_tokens=n_tokens)).token_ids
        tokens += [tokens[-1]] * (n_tokens - len(tokens))  # an early EOS still leaves blocks to replay
        recorded.append(RecordedEdge(ids, [tokens[i:i + k] for i in range(0, n_tokens - k + 1, k)]))
    return recorded


async def run_edge(stub: pb_grpc.TargetServiceStub, edge: RecordedEdge, rounds: int, start: asyncio.Event,
                   latencies_ms: list[float], batch_sizes: list[int]) -> int:
    call = stub.Session()
    await call.write(pb.EdgeFrame(open=pb.OpenSession(prompt_ids=edge.prompt_ids)))
    opened = await call.read()
    context_length = opened.opened.context_length
    await start.wait()
    verified = 0
    for i in range(rounds):
        block = edge.blocks[i % len(edge.blocks)]
        sent = time.perf_counter()
        await call.write(pb.EdgeFrame(verify=pb.VerifyBlock(start_position=context_length, draft_tokens=block,
                                                            method=pb.METHOD_BLOCK)))
        frame = await call.read()
        if frame.WhichOneof("frame") != "verdict":
            raise RuntimeError(f"cloud refused a replayed block: {frame}")
        latencies_ms.append((time.perf_counter() - sent) * 1e3)
        batch_sizes.append(frame.verdict.cloud_batch_size)
        context_length = frame.verdict.context_length
        verified += len(block)
    await call.write(pb.EdgeFrame(close=pb.CloseSession()))
    await call.done_writing()
    status = await call.code()  # the stream's final status
    if status != grpc.StatusCode.OK:
        raise RuntimeError(f"session stream ended with {status}: {await call.details()}")
    return verified


async def measure(address: str, edges: list[RecordedEdge], n_edges: int, rounds: int) -> tuple[float, list[float], list[int]]:
    latencies_ms: list[float] = []
    batch_sizes: list[int] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TargetServiceStub(channel)
        start = asyncio.Event()
        tasks = [asyncio.create_task(run_edge(stub, edges[i % len(edges)], rounds, start, latencies_ms, batch_sizes))
                 for i in range(n_edges)]
        await asyncio.sleep(0.5)  # let every session open (and prefill) before the clock starts
        started = time.perf_counter()
        start.set()
        verified = sum(await asyncio.gather(*tasks))
        return verified / (time.perf_counter() - started), latencies_ms, batch_sizes


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def format_table(rows: list[BenchRow]) -> str:
    lines = ["| target | edges | batching | verified tokens/s | speedup | p50 ms | p99 ms | mean batch |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        off = next((r for r in rows if r.target == row.target and r.edges == row.edges and not r.batching), None)
        speedup = row.verified_tokens_per_s / off.verified_tokens_per_s if off else float("nan")
        lines.append(f"| {row.target} | {row.edges} | {'on' if row.batching else 'off'} | {row.verified_tokens_per_s:.1f} | "
                     f"{speedup:.2f}x | {row.verify_p50_ms:.0f} | {row.verify_p99_ms:.0f} | {row.cloud_batch_size_mean:.2f} |")
    return "\n".join(lines)


def plot(rows: list[BenchRow], path: Path) -> None:
    plt = pyplot()
    targets = list(dict.fromkeys(r.target for r in rows))
    fig, axes = plt.subplots(1, len(targets), figsize=(5 * len(targets), 4), squeeze=False)
    for ax, target in zip(axes[0], targets):
        for batching in (True, False):
            series = [r for r in rows if r.target == target and r.batching == batching]
            ax.plot([r.edges for r in series], [r.verified_tokens_per_s for r in series], marker="o",
                    label=f"batching {'on' if batching else 'off'}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent edges")
        ax.set_ylabel("verified tokens/s")
        ax.set_title(target)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def measure_cloud(settings: CloudBenchSettings, target: str, batching: bool, edges: list[RecordedEdge]) -> list[BenchRow]:
    """One cloud process for `target`, batching on or off (`--max-batch 1`); a row per edge count."""
    serve_args = ["--target", target, "--dtype", settings.dtype, "--max-sessions", str(max(settings.edges) + 4),
                  "--batch-window-ms", str(settings.batch_window_ms),
                  "--max-batch", str(settings.max_batch if batching else 1)]
    log_path = settings.out / f"cloud-{target}-{'batched' if batching else 'unbatched'}.log"
    rows = []
    with cloud_process(*serve_args, log_path=log_path) as address:
        asyncio.run(measure(address, edges, 1, 2))  # warm-up
        for n_edges in tqdm(settings.edges, desc=f"{target} batching {'on' if batching else 'off'}"):
            tokens_per_s, latencies, batch_sizes = asyncio.run(measure(address, edges, n_edges, settings.rounds))
            rows.append(BenchRow(target, n_edges, batching, tokens_per_s, statistics.median(latencies),
                                 percentile(latencies, 0.99), statistics.fmean(batch_sizes), len(latencies)))
    return rows


def bench_cloud(settings: CloudBenchSettings) -> str:
    """Every target, batching on and off, every edge count; writes OUT, returns the table."""
    settings.out.mkdir(parents=True, exist_ok=True)
    rows: list[BenchRow] = []
    for target in settings.targets:
        edges = record_edges(target, DEFAULT_DRAFTS.get(target, target), settings.k,
                             n_tokens=settings.k * settings.rounds)
        for batching in (True, False):
            rows += measure_cloud(settings, target, batching, edges)
    rows.sort(key=lambda r: (r.target, r.edges, not r.batching))
    table = format_table(rows)
    (settings.out / "results.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                           "args": settings.to_dict(),
                                                           "rows": [asdict(r) for r in rows]}, indent=1))
    (settings.out / "table.md").write_text(table + "\n")
    plot(rows, settings.out / "verified_tokens_per_s.png")
    return table
