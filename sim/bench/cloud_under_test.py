"""The cloud process an engine bench measures: its `cloud serve` flags, cores, threads and checkout, its metrics,
and a timed Generate against it.

    cloud = CloudUnderTest("smollm2-135m", dtype="float32", cpus=(0,), extra=("--no-prefix-cache",))
    with cloud.running(out / "cloud.log") as running:      # running.address, running.pid, running.scrape()
        timing = asyncio.run(generate_at(running.address, prompt, 16))

bench cloud, prefill, prefix and llama-cpp each describe their cloud here rather than spell its command line.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from common import wire
from common.sampling.params import SamplingParams
from sim.bench.load import scrape_metrics
from sim.cores import thread_env
from sim.processes import CloudProcess, free_port
from sprinter.v1 import decoding_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class CloudUnderTest:
    """`sprinter cloud serve` for one target; a None flag is left to the cloud's own default."""

    target: str
    dtype: str | None = "bfloat16"
    engine: str | None = None
    device: str = "auto"  # passed only when set: an older checkout's cloud may predate --device
    max_context: int | None = 4096
    max_batch: int | None = None
    max_sessions: int | None = None
    kv_budget_mb: int | None = None
    batch_window_ms: float | None = None
    extra: tuple[str, ...] = ()  # more `cloud serve` flags, as given
    cpus: tuple[int, ...] = ()  # pinned to these cores, its torch pool sized to them
    pythonpath: str | None = None  # another checkout's cloud
    metrics: bool = False  # serve Prometheus metrics (RunningCloud.scrape)

    def serve_args(self, metrics_port: int | None) -> list[str]:
        flags = {"--engine": self.engine, "--target": self.target, "--dtype": self.dtype,
                 "--device": None if self.device == "auto" else self.device, "--max-context": self.max_context,
                 "--max-batch": self.max_batch, "--max-sessions": self.max_sessions,
                 "--kv-budget-mb": self.kv_budget_mb, "--batch-window-ms": self.batch_window_ms,
                 "--metrics-port": metrics_port}
        return [part for flag, value in flags.items() if value is not None for part in (flag, str(value))] + [
            *self.extra]

    def env(self) -> dict[str, str]:
        env = thread_env(len(self.cpus))
        if self.pythonpath:  # its packages and stubs first, and `python -m` must not put this checkout (the cwd)
            env |= {"PYTHONPATH": self.pythonpath, "PYTHONSAFEPATH": "1"}  # before them
        return env

    @contextmanager
    def running(self, log_path: Path) -> Iterator[RunningCloud]:
        """Started (a fresh log at `log_path`) and SERVING; SIGTERM on exit."""
        metrics_port = free_port() if self.metrics else None
        log_path.write_text("")
        with CloudProcess(*self.serve_args(metrics_port), log_path=log_path, cpus=set(self.cpus) or None,
                          env=self.env()) as process:
            yield RunningCloud(process.address, process.pid, metrics_port)


@dataclass(frozen=True)
class RunningCloud:
    address: str
    pid: int | None
    metrics_port: int | None

    def scrape(self) -> dict[str, float]:
        return scrape_metrics(self.metrics_port) if self.metrics_port else {}


@asynccontextmanager
async def target_stub(address: str) -> AsyncIterator[tuple[pb_grpc.TargetServiceStub, int]]:
    """A stub of the cloud at `address`, and its target's vocabulary size."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TargetServiceStub(channel)
        yield stub, (await stub.GetInfo(wire.info_request())).vocab_size


@dataclass
class GenerateTiming:
    token_ids: list[int]
    first_s: float  # to the first chunk with tokens (prefill and the first token)
    wall_s: float
    cached_tokens: int  # prompt tokens the cloud took from its prefix cache

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time after it."""
        decode_s = self.wall_s - self.first_s
        return (len(self.token_ids) - 1) / decode_s if decode_s > 0 else 0.0

    def record(self) -> dict:
        return {"tokens": len(self.token_ids), "first_s": self.first_s, "wall_s": self.wall_s,
                "token_ids": self.token_ids, "cached_tokens": self.cached_tokens}


async def timed_generate(stub: pb_grpc.TargetServiceStub, prompt: list[int], max_new: int) -> GenerateTiming:
    """One greedy Generate, streamed."""
    started, first, tokens, cached = time.perf_counter(), None, [], 0
    async for chunk in stub.Generate(wire.generate_request(prompt, SamplingParams(), max_new)):
        if first is None and chunk.token_ids:
            first, cached = time.perf_counter(), wire.chunk_cached_tokens(chunk)
        tokens += list(chunk.token_ids)
    ended = time.perf_counter()
    return GenerateTiming(tokens, (first or ended) - started, ended - started, cached)


async def generate_at(address: str, prompt: list[int], max_new: int) -> GenerateTiming:
    async with grpc.aio.insecure_channel(address) as channel:
        return await timed_generate(pb_grpc.TargetServiceStub(channel), prompt, max_new)
