"""bench prefill: verify latency of busy sessions while a long prompt opens (issue 12, item 2).

    sprinter bench prefill --target smollm2-135m --sessions 8 --prompt-tokens 4000 --out results/bench-prefill

N sessions verify k-token blocks in a loop, each as fast as its verdicts come back; after a quiet
phase one more stream opens a prompt of `--prompt-tokens` tokens. Reports p50/p99 verify latency in
the quiet phase and while the open's prefill runs, the open's own time, and the cloud's peak RSS.
The cloud runs as a separate process (`sprinter cloud serve`). `--cloud-pythonpath` runs another
checkout's cloud (e.g. the commit before a fix) under the same client; `--serve-args` adds flags.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from common import wire
from common.stats import percentile
from sim.bench.settings import PrefillBenchSettings
from sim.processes import cloud_process
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass
class PrefillBenchResult:
    label: str
    quiet_verifies: int
    quiet_p50_ms: float
    quiet_p99_ms: float
    during_verifies: int  # verifies that started while the open ran
    during_p50_ms: float
    during_p99_ms: float
    during_max_ms: float
    open_s: float
    cloud_peak_rss_mb: float
    settings: dict = field(default_factory=dict)


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
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TargetServiceStub(channel)
        vocab = (await stub.GetInfo(wire.info_request())).vocab_size
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


def _peak_rss_mb(pid: int | None) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, TypeError):
        return float("nan")
    return next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmHWM")), float("nan"))


def bench_prefill(settings: PrefillBenchSettings, label: str) -> PrefillBenchResult:
    settings.out.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": settings.cloud_pythonpath} if settings.cloud_pythonpath else None
    serve = ["--target", settings.target, "--dtype", settings.dtype, "--max-context", "4096", *settings.serve_args]
    with cloud_process(*serve, env=env, log_path=settings.out / f"cloud-{label}.log") as address:
        samples, opened_at, done_at = asyncio.run(_measure(address, settings))
        rss = _peak_rss_mb(_cloud_pid(address))
    quiet = [ms for start, ms in samples if start < opened_at]
    during = [ms for start, ms in samples if opened_at <= start <= done_at or (start < opened_at and start + ms / 1e3 > opened_at)]
    result = PrefillBenchResult(label, len(quiet), percentile(quiet, 0.5), percentile(quiet, 0.99), len(during),
                                percentile(during, 0.5), percentile(during, 0.99), max(during, default=float("nan")),
                                done_at - opened_at, rss, {**asdict(settings), "out": str(settings.out)})
    with open(settings.out / "results.jsonl", "a") as f:
        f.write(json.dumps(asdict(result)) + "\n")
    return result


def _cloud_pid(address: str) -> int | None:
    """The `cloud serve` process this bench started on `address`'s port (its command line names the port)."""
    wanted = ["--port", address.rsplit(":", 1)[1]]
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode().split("\0") if proc.name.isdigit() else []
        except OSError:
            continue
        if "serve" in argv and any(argv[i:i + 2] == wanted for i in range(len(argv) - 1)):
            return int(proc.name)
    return None


def format_result(r: PrefillBenchResult) -> str:
    return (f"| {r.label} | {r.quiet_verifies} | {r.quiet_p50_ms:.0f} | {r.quiet_p99_ms:.0f} | {r.during_verifies} | "
            f"{r.during_p50_ms:.0f} | {r.during_p99_ms:.0f} | {r.during_max_ms:.0f} | {r.open_s:.1f} | {r.cloud_peak_rss_mb:.0f} |")


TABLE_HEADER = ("| run | quiet verifies | quiet p50 ms | quiet p99 ms | verifies during open | p50 ms | p99 ms | max ms "
                "| open s | cloud peak RSS MB |\n|---|---|---|---|---|---|---|---|---|---|")
