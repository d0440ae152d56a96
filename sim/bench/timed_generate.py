"""A timed Generate against a cloud process (sim/cloud_under_test.py): the engine benches' client.

    with cloud.running(out / "cloud.log") as running:
        timing = asyncio.run(generate_at(running.address, prompt, 16))   # timing.first_s, timing.wall_s, ...

bench cloud, prefill, prefix and llama-cpp read their cloud's answers and times through it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from common import wire
from common.sampling.params import SamplingParams
from sprinter.v1 import decoding_pb2_grpc as pb_grpc


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
