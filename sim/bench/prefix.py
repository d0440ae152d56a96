"""bench prefix: what the cloud's prefix cache saves (conversations, shared system prompts, n choices).

    sprinter bench prefix --target qwen2.5-coder-1.5b --history-tokens 1000 --out results/bench-prefix

Clients speak gRPC to a `sprinter cloud serve` process (resident engine, pinned to `--cloud-cpus`), so the
figures are the cloud's own, without an edge's drafting in the way:

- conversation: turn 1 is a Generate of `--answer-tokens` after a history of `--history-tokens`; turn 2 sends
  the history, that answer and `--new-tokens` more. Its time to first token (the first chunk) and its decode
  tokens/s, against the same turn on a cloud started with `--no-prefix-cache`.
- shared prompts: `--edges` clients (edges without bearer tokens: one identity) open `--rounds` sessions
  each (with the target's first token, as an edge's first open), concurrently, of one of 2 system prompts
  of `--system-tokens` and a question of their own. Of the prompt tokens a cached prefix covers (the
  whole pages of a system prompt already sent), the share not prefilled again; and whether the KV budget
  held (`sprinter_cloud_kv_over_budget_total` stays 0).
- n choices: the time until `--choices` sessions of one fresh prompt are open (the cloud's first token
  each), over the time one takes.

Tokens are synthetic (the models' vocabulary, deterministic); greedy.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, replace

from common import wire
from sim.bench.run_folder import RunFolder
from sim.bench.settings.engines import PrefixBenchSettings
from sim.bench.timed_generate import target_stub, timed_generate
from sim.cloud_under_test import CloudUnderTest
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

PAGE = 64  # the per-session layout's page: the cache's block on a CPU


@dataclass
class PrefixBenchResult:
    turn2_ttft_ms: dict[str, float]  # "cached", "cold"
    turn2_tokens_per_s: dict[str, float]
    turn2_cached_tokens: int
    turn2_prompt_tokens: int
    shared_cacheable_tokens: int  # prompt tokens a cached prefix covered
    shared_cached_tokens: int  # of which served from the cache
    shared_over_budget: float  # sprinter_cloud_kv_over_budget_total
    choices_ms: float  # all `choices` sessions open
    one_ms: float  # one session open


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % min(vocab - 10, 50000) + 3 for i in range(n)]  # clear of special ids


async def _conversation(stub: pb_grpc.TargetServiceStub, vocab: int,
                        s: PrefixBenchSettings) -> tuple[float, float, int, int]:
    history = _tokens(1, s.history_tokens, vocab)
    answer = (await timed_generate(stub, history, s.answer_tokens)).token_ids
    turn2 = history + answer + _tokens(2, s.new_tokens, vocab)
    second = await timed_generate(stub, turn2, s.answer_tokens)
    return second.first_s * 1e3, second.decode_tokens_per_s, second.cached_tokens, len(turn2)


async def _shared_prompts(stub: pb_grpc.TargetServiceStub, vocab: int, s: PrefixBenchSettings) -> tuple[int, int]:
    systems = [_tokens(10 + i, s.system_tokens, vocab) for i in range(2)]
    seen: set[int] = set()
    counted = {"cacheable": 0, "cached": 0}

    async def edge(index: int) -> None:
        for round_ in range(s.rounds):
            system = index % 2
            prompt = systems[system] + _tokens(100 + index * 31 + round_, 40, vocab)
            cacheable = s.system_tokens // PAGE * PAGE if system in seen else 0
            seen.add(system)
            cached = await _open(stub, prompt)
            counted["cacheable"] += cacheable
            counted["cached"] += min(cached, cacheable)

    await asyncio.gather(*(edge(i) for i in range(s.edges)))
    return counted["cacheable"], counted["cached"]


async def _open(stub: pb_grpc.TargetServiceStub, prompt: list[int]) -> int:
    """A session opened with the target's first token, then closed, as an edge's would be: its cached tokens."""
    cached = 0
    async for frame in stub.Session(iter([wire.open_frame(prompt, first_token=True), wire.close_frame()])):
        cached = wire.opened_cached_tokens(frame.opened) if frame.WhichOneof("frame") == "opened" else cached
    return cached


async def _choices(stub: pb_grpc.TargetServiceStub, vocab: int, s: PrefixBenchSettings) -> tuple[float, float]:
    started = time.perf_counter()
    await _open(stub, _tokens(50, s.system_tokens, vocab))
    one_ms = (time.perf_counter() - started) * 1e3
    prompt = _tokens(51, s.system_tokens, vocab)
    started = time.perf_counter()
    await asyncio.gather(*(_open(stub, prompt) for _ in range(s.choices)))
    return (time.perf_counter() - started) * 1e3, one_ms


async def _run(address: str, work):
    async with target_stub(address) as (stub, vocab):
        await timed_generate(stub, _tokens(99, 80, vocab), 2)  # warm the engine up
        return await work(stub, vocab)


def bench_prefix(s: PrefixBenchSettings) -> str:
    folder = RunFolder(s.out)
    cloud = CloudUnderTest(s.target, s.dtype, {"max_context": 4096, "kv_budget_mb": s.kv_budget_mb, "max_streams": 64},
                           cpus=frozenset(s.cloud_cpus) or None)
    with replace(cloud, flags={**cloud.flags, "prefix_cache": False}).running(folder.path("cloud-cold.log")) as cold:
        cold_ttft, cold_rate, _, _ = asyncio.run(_run(cold.address, lambda stub, v: _conversation(stub, v, s)))
    with replace(cloud, metrics=True).running(folder.path("cloud-cached.log")) as cached_cloud:
        ttft, rate, cached, prompt = asyncio.run(_run(cached_cloud.address, lambda stub, v: _conversation(stub, v, s)))
        cacheable, shared = asyncio.run(_run(cached_cloud.address, lambda stub, v: _shared_prompts(stub, v, s)))
        choices_ms, one_ms = asyncio.run(_run(cached_cloud.address, lambda stub, v: _choices(stub, v, s)))
        over = cached_cloud.metrics().get("sprinter_cloud_kv_over_budget_total", float("nan"))
    result = PrefixBenchResult({"cached": ttft, "cold": cold_ttft}, {"cached": rate, "cold": cold_rate}, cached, prompt,
                               cacheable, shared, over, choices_ms, one_ms)
    folder.write_results(s, **asdict(result))
    return format_result(result, s)


def format_result(r: PrefixBenchResult, s: PrefixBenchSettings) -> str:
    share = r.shared_cached_tokens / r.shared_cacheable_tokens if r.shared_cacheable_tokens else float("nan")
    rows = [
        ("conversation: turn 2 time to first token, cached / cold",
         f"{r.turn2_ttft_ms['cached']:.0f} / {r.turn2_ttft_ms['cold']:.0f} ms = "
         f"{r.turn2_ttft_ms['cached'] / r.turn2_ttft_ms['cold']:.2f}x (goal <= 0.3x)"),
        ("conversation: turn 2 prompt tokens cached", f"{r.turn2_cached_tokens} of {r.turn2_prompt_tokens}"),
        ("conversation: turn 2 decode tokens/s, cached / cold",
         f"{r.turn2_tokens_per_s['cached']:.2f} / {r.turn2_tokens_per_s['cold']:.2f}"),
        (f"shared prompts ({s.edges} edges x {s.rounds}, 2 system prompts of {s.system_tokens}): "
         "covered tokens not prefilled", f"{r.shared_cached_tokens} of {r.shared_cacheable_tokens} = {share:.1%} "
                                         "(goal >= 90%)"),
        (f"KV budget ({s.kv_budget_mb} MB) breaches", f"{r.shared_over_budget:.0f}"),
        (f"n={s.choices} choices open, over n=1", f"{r.choices_ms:.0f} / {r.one_ms:.0f} ms = "
                                                  f"{r.choices_ms / r.one_ms:.2f}x (goal <= 1.5x)"),
    ]
    return "| measure | value |\n|---|---|\n" + "\n".join(f"| {name} | {value} |" for name, value in rows)
