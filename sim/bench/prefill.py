"""bench prefill: verify latency of busy sessions while a long prompt opens (issue 12, item 2).

    sprinter bench prefill --target smollm2-135m --sessions 8 --prompt-tokens 4000 --out results/bench-prefill

N sessions verify k-token blocks in a loop, each as fast as its verdicts come back; after a quiet
phase one more stream opens a prompt of `--prompt-tokens` tokens. Reports p50/p99 verify latency in
the quiet phase and while the open's prefill runs, the open's own time, and the cloud's peak RSS.
The cloud runs as a separate process (`sprinter cloud serve`). `--cloud-pythonpath` runs another
checkout's cloud (e.g. the commit before a fix) under the same client; `--serve-args` adds flags.
OUT/results.json keeps a row per `--label` (each with its settings), so runs of two checkouts compare.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import time
from dataclasses import asdict, dataclass

import grpc

from common import wire
from common.stats import percentile
from common.table_cells import cell
from sim.bench.load import rss_bytes
from sim.bench.run_folder import RunFolder, jsonable
from sim.bench.settings.engines import PrefillBenchSettings
from sim.bench.timed_generate import target_stub
from sim.cloud_under_test import CloudUnderTest
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass
class PrefillBenchResult:
    label: str
    quiet_verifies: int
    quiet_p50_ms: float | None
    quiet_p99_ms: float | None
    during_verifies: int  # verifies that started while the open ran
    during_p50_ms: float | None
    during_p99_ms: float | None
    during_max_ms: float | None  # None (and the p50, p99): no verify began while the open ran
    open_s: float
    cloud_peak_rss_mb: float


async def _verifier(stub: pb_grpc.TargetServiceStub, index: int, k: int, vocab: int, stop: asyncio.Event,
                    samples: list[tuple[float, float]]) -> None:
    """One busy session: (start, latency ms) of every verify until `stop`."""
    requests: asyncio.Queue[pb.EdgeFrame | None] = asyncio.Queue()

    async def frames():
        while (frame := await requests.get()) is not None:
            yield frame

    call = stub.Session(frames())
    prompt = [(index * 7 + i) % vocab for i in range(32)]
    await requests.put(wire.open_frame(prompt))
    length = (await call.read()).opened.context_length
    while not stop.is_set():
        block = [(length * 31 + i) % vocab for i in range(k)]
        started = time.perf_counter()
        await requests.put(wire.verify_frame(wire.verify_block(length, block, "block")))
        answer = await call.read()
        samples.append((started, (time.perf_counter() - started) * 1e3))
        length = answer.verdict.context_length
    await requests.put(wire.close_frame())
    await requests.put(None)
    while await call.read() is not grpc.aio.EOF:  # until the cloud ends the stream
        pass


async def _measure(address: str, settings: PrefillBenchSettings) -> tuple[list[tuple[float, float]], float, float]:
    """Verify samples, and the open's start and end (perf_counter seconds)."""
    samples: list[tuple[float, float]] = []
    stop = asyncio.Event()
    async with target_stub(address) as (stub, vocab):
        verifiers = [asyncio.create_task(_verifier(stub, i, settings.k, vocab, stop, samples))
                     for i in range(settings.sessions)]
        await asyncio.sleep(settings.quiet_s)
        prompt = [(i * 17) % vocab for i in range(settings.prompt_tokens)]
        opened_at = time.perf_counter()
        call = stub.Session(iter([wire.open_frame(prompt)]))
        answer = await call.read()
        done_at = time.perf_counter()
        assert answer.WhichOneof("frame") == "opened", answer
        call.cancel()
        await asyncio.sleep(1.0)  # a little after, so verifies queued behind the prefill are counted
        stop.set()
        await asyncio.gather(*verifiers)
    return samples, opened_at, done_at


def bench_prefill(settings: PrefillBenchSettings) -> str:
    """The run's row in OUT/results.json beside earlier runs' rows of other labels; returns this run's table."""
    folder = RunFolder(settings.out)
    cloud = CloudUnderTest(settings.target, settings.dtype, {"max_context": 4096},
                           tuple(shlex.split(settings.serve_args)), pythonpath=settings.cloud_pythonpath)
    with cloud.running(folder.path(f"cloud-{settings.label}.log")) as running:
        samples, opened_at, done_at = asyncio.run(_measure(running.address, settings))
        peak = rss_bytes(running.pid, "VmHWM")
    quiet = [ms for start, ms in samples if start < opened_at]
    during = [ms for start, ms in samples if opened_at <= start <= done_at or (start < opened_at and start + ms / 1e3 > opened_at)]
    result = PrefillBenchResult(settings.label, len(quiet), percentile(quiet, 0.5), percentile(quiet, 0.99),
                                len(during), percentile(during, 0.5), percentile(during, 0.99),
                                max(during, default=None), done_at - opened_at,
                                peak / 2**20 if peak is not None else float("nan"))
    earlier = [row for row in (folder.read_results() or {"rows": []})["rows"] if row["label"] != settings.label]
    folder.write_results(settings, rows=[*earlier, {**asdict(result), "settings": jsonable(settings)}])
    return f"{TABLE_HEADER}\n{format_result(result)}"


def format_result(r: PrefillBenchResult) -> str:
    ms = [cell(value, ".0f") for value in (r.quiet_p50_ms, r.quiet_p99_ms, r.during_p50_ms, r.during_p99_ms,
                                           r.during_max_ms)]  # "-": no verify began while the open ran
    return (f"| {r.label} | {r.quiet_verifies} | {ms[0]} | {ms[1]} | {r.during_verifies} | {ms[2]} | {ms[3]} | "
            f"{ms[4]} | {r.open_s:.1f} | {r.cloud_peak_rss_mb:.0f} |")


TABLE_HEADER = ("| run | quiet verifies | quiet p50 ms | quiet p99 ms | verifies during open | p50 ms | p99 ms | max ms "
                "| open s | cloud peak RSS MB |\n|---|---|---|---|---|---|---|---|---|---|")
