"""bench prefix-fleet: what the prefix caches save from end to end, through edge daemons (issue 44's goals).

    sprinter bench prefix-fleet --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out results/bench-prefix-fleet

Every request is a greedy streamed chat completion through an edge daemon's OpenAI API (`sprinter edge serve`,
in mode sprinter-exact), to `sprinter cloud serve` processes; all processes are pinned to `--cpus`.

- conversation: turn 1 sends a user message of about `--history-tokens` minus `--answer-tokens` tokens and gets
  an answer of up to `--answer-tokens`; turn 2 sends that history, the answer and a new message of
  `--new-tokens`, for `--max-tokens`. Turn 2's time to first token (the first content chunk) on a cloud and an
  edge as served (prefix cache, `--draft-cache-mb` default), against the same turn on fresh processes with both
  caches off (`cloud serve --no-prefix-cache`, `edge serve --draft-cache-mb 0`); the cloud's cached tokens and the
  edge's reused draft tokens of turn 2 (`sprinter.stats`). `--conversations` of their own text per configuration.
- fleet: `--replicas` cloud processes and `--edges` edge daemons given all of them (`--cloud a,b`, no broker:
  each session's replica is the rendezvous winner of its prompt's leading block). Edge i asks `--rounds`
  questions of its own under system prompt i mod 2 (2 system prompts of `--system-tokens`). The first request of
  each system prompt goes alone (which replica's lookups it raised says where that prompt landed); then every
  edge sends the rest at once. Shareable: the whole 64-token pages of the prefix that a system prompt's requests
  share, in every request but the fleet's first of that prompt (a replica that meets it for its first time is a
  miss); served: of those, the tokens the cloud reported cached.

Texts are synthetic (plain words from a seed, sim/bench/edge_chat.py). Writes OUT/results.json and table.md.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field

import httpx

from sim.bench.edge_chat import ChatReply, stream_chat, synthetic_text
from sim.bench.load import scrape_metrics
from sim.bench.prompts import bench_prompt_ids
from sim.bench.run_folder import RunFolder
from sim.bench.settings.capacity import PrefixFleetSettings
from sim.cloud_under_test import CloudUnderTest, RunningCloud, replicas_started
from sim.cores import thread_env
from sim.processes import edge_daemon_process, free_port

log = logging.getLogger(__name__)

PAGE = 64  # the cloud's cache block on a CPU (per-session layout)
QUERIES = "sprinter_cloud_prefix_cache_queries_total"
CACHED = "sprinter_cloud_prefix_cache_cached_tokens_total"


@dataclass
class Turn:
    config: str  # "cached" or "cold"
    conversation: int
    turn1: ChatReply
    turn2: ChatReply


@dataclass
class FleetRequest:
    edge: int
    system: int
    round: int
    first: bool  # the fleet's first request of its system prompt
    reply: ChatReply


@dataclass
class PrefixFleetResult:
    turns: list[Turn] = field(default_factory=list)
    fleet: list[FleetRequest] = field(default_factory=list)
    shared_prefix_tokens: list[int] = field(default_factory=list)  # per system prompt: what its requests share
    landed: dict[str, list[int]] = field(default_factory=dict)  # system prompt -> replicas its first request raised
    replica_queries: list[float] = field(default_factory=list)  # per replica, the fleet phase's lookups
    replica_cached: list[float] = field(default_factory=list)  # per replica, the fleet phase's cached tokens
    startup_s: dict[str, float] = field(default_factory=dict)


def shareable_pages(tokens: int) -> int:
    return tokens // PAGE * PAGE


def shared_share(requests: list[FleetRequest], shared_prefix_tokens: list[int]) -> tuple[int, int]:
    """(shareable, served): over every request but the fleet's first of its system prompt, the whole pages of the
    prefix its system prompt's requests share, and of those the tokens the cloud reported cached."""
    shareable = served = 0
    for request in requests:
        if request.first:
            continue
        pages = shareable_pages(shared_prefix_tokens[request.system])
        shareable += pages
        served += min(request.reply.cached_tokens, pages)
    return shareable, served


def _clouds(stack: ExitStack, s: PrefixFleetSettings, name: str, replicas: int, *extra: str) -> list[RunningCloud]:
    cloud = CloudUnderTest(s.target, s.dtype, {"max_context": 4096, "max_streams": 64}, extra, metrics=True)
    return stack.enter_context(replicas_started(cloud, s.out, name, [frozenset(s.cpus)] * replicas))


def _edge_args(s: PrefixFleetSettings, clouds: list[str]) -> list[str]:
    # Everything shares the pinned cores, so a verdict may wait behind other processes' prefills: a generous
    # deadline keeps a slow answer from counting as a replica failure (which would move the session elsewhere).
    return ["--draft", s.draft, "--dtype", s.dtype, "--draft-runtime", s.draft_runtime, "--cloud", ",".join(clouds),
            "--cloud-deadline-s", "600", "--mode", "sprinter-exact"]


def _start_edge(stack: ExitStack, s: PrefixFleetSettings, name: str, clouds: list[str], *extra: str) -> str:
    edge = stack.enter_context(edge_daemon_process([*_edge_args(s, clouds), *extra], free_port(),
                                                   s.out / f"{name}.log", cpus=set(s.cpus),
                                                   env=thread_env(len(s.cpus))))
    return edge.base


async def _warm_up(base: str) -> None:
    async with httpx.AsyncClient(timeout=1800) as client:
        await stream_chat(client, base, [{"role": "user", "content": "Say hello to the team."}], 4)


def _conversation_texts(s: PrefixFleetSettings, tokenizer, index: int) -> tuple[str, str]:
    first = synthetic_text(1000 + index, s.history_tokens - s.answer_tokens, tokenizer)
    return "Summarise these notes:\n" + first, "Now list three questions about them: " + \
        synthetic_text(2000 + index, s.new_tokens, tokenizer)


async def _conversations(base: str, config: str, s: PrefixFleetSettings, tokenizer) -> list[Turn]:
    turns = []
    async with httpx.AsyncClient(timeout=1800) as client:
        for index in range(s.conversations):
            first, second = _conversation_texts(s, tokenizer, index)
            history = [{"role": "user", "content": first}]
            turn1 = await stream_chat(client, base, history, s.answer_tokens)
            messages = [*history, {"role": "assistant", "content": turn1.text}, {"role": "user", "content": second}]
            turn2 = await stream_chat(client, base, messages, s.max_tokens)
            log.info("%s conversation %d: turn 2 of %d prompt tokens, first token in %.0f ms, %d cached, "
                     "%d draft reused", config, index, turn2.prompt_tokens, turn2.ttft_ms, turn2.cached_tokens,
                     turn2.draft_reused_tokens)
            turns.append(Turn(config, index, turn1, turn2))
    return turns


def measure_conversations(s: PrefixFleetSettings, result: PrefixFleetResult) -> None:
    tokenizer = bench_prompt_ids(s.target)[1]
    for config, cloud_extra, edge_extra in (("cold", ("--no-prefix-cache",), ("--draft-cache-mb", "0")),
                                            ("cached", (), ())):
        started = time.perf_counter()
        with ExitStack() as stack:
            (cloud,) = _clouds(stack, s, f"conversation-{config}-cloud", 1, *cloud_extra)
            base = _start_edge(stack, s, f"conversation-{config}-edge", [cloud.address], *edge_extra)
            result.startup_s[f"conversation-{config}"] = time.perf_counter() - started
            log.info("%s: cloud and edge up in %.0f s", config, result.startup_s[f"conversation-{config}"])
            asyncio.run(_warm_up(base))
            result.turns += asyncio.run(_conversations(base, config, s, tokenizer))


def _metrics(replicas: list[RunningCloud], name: str) -> list[float]:
    """Each replica's unlabelled sample `name`; 0 where a replica does not expose it. (A long timeout: every
    process shares the pinned cores, a scrape may wait behind a prefill.)"""
    return [scrape_metrics(replica.metrics_port, timeout_s=30).get(name, 0.0) for replica in replicas]


def _fleet_messages(s: PrefixFleetSettings, tokenizer, systems: list[str], edge: int, round_: int) -> list[dict]:
    question = synthetic_text(5000 + edge * 101 + round_, s.question_tokens, tokenizer)
    return [{"role": "system", "content": systems[edge % 2]},
            {"role": "user", "content": f"Question {edge}.{round_}: {question}?"}]


def shared_prefix(tokenizer, system: str) -> int:
    """Tokens that two requests under `system` with different questions share (the chat template's prompt)."""
    from common.model.prompting import encode_chat

    a, b = (encode_chat(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q}])
            for q in ("Question 1: why?", "Question 2: how?"))
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def _fleet_requests(bases: list[str], replicas: list[RunningCloud], s: PrefixFleetSettings, tokenizer,
                          result: PrefixFleetResult) -> None:
    systems = [synthetic_text(100 + i, s.system_tokens, tokenizer) for i in range(2)]
    result.shared_prefix_tokens = [shared_prefix(tokenizer, system) for system in systems]
    async with httpx.AsyncClient(timeout=3600) as client:
        for system in range(2):  # each system prompt's first request alone: where it lands is plain
            before = _metrics(replicas, QUERIES)
            reply = await stream_chat(client, bases[system], _fleet_messages(s, tokenizer, systems, system, 0),
                                      s.max_tokens)
            raised = [i for i, (a, b) in enumerate(zip(before, _metrics(replicas, QUERIES))) if b > a]
            result.landed[str(system)] = raised
            result.fleet.append(FleetRequest(system, system, 0, True, reply))
            log.info("system prompt %d: first request landed on replica(s) %s", system, raised)

        async def edge(index: int) -> None:
            for round_ in range(1 if index < 2 else 0, s.rounds):
                reply = await stream_chat(client, bases[index], _fleet_messages(s, tokenizer, systems, index, round_),
                                          s.max_tokens)
                result.fleet.append(FleetRequest(index, index % 2, round_, False, reply))
                log.info("edge %d round %d: %d cached, %d draft reused, first token in %.0f ms", index, round_,
                         reply.cached_tokens, reply.draft_reused_tokens, reply.ttft_ms)

        await asyncio.gather(*(edge(i) for i in range(len(bases))))


def measure_fleet(s: PrefixFleetSettings, result: PrefixFleetResult) -> None:
    tokenizer = bench_prompt_ids(s.target)[1]
    started = time.perf_counter()
    with ExitStack() as stack:
        replicas = _clouds(stack, s, "fleet-cloud", s.replicas)
        log.info("%d replicas up (%.0f s)", s.replicas, time.perf_counter() - started)
        bases = []
        for index in range(s.edges):  # one at a time: each loads its draft alone
            bases.append(_start_edge(stack, s, f"fleet-edge-{index}", [r.address for r in replicas]))
            log.info("edge %d up (%.0f s)", index, time.perf_counter() - started)
        result.startup_s["fleet"] = time.perf_counter() - started
        for base in bases:
            asyncio.run(_warm_up(base))
        queries, cached = _metrics(replicas, QUERIES), _metrics(replicas, CACHED)
        asyncio.run(_fleet_requests(bases, replicas, s, tokenizer, result))
        result.replica_queries = [b - a for a, b in zip(queries, _metrics(replicas, QUERIES))]
        result.replica_cached = [b - a for a, b in zip(cached, _metrics(replicas, CACHED))]


def bench_prefix_fleet(s: PrefixFleetSettings) -> str:
    """Each part measured; OUT/results.json rewritten after each (a later part's failure keeps it); the table."""
    folder, result = RunFolder(s.out), PrefixFleetResult()
    for part, measure in (("conversation", measure_conversations), ("fleet", measure_fleet)):
        if part in s.parts:
            measure(s, result)
            folder.write_results(s, **asdict(result))
    return folder.write_table(format_result(result, s))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _turn2(r: PrefixFleetResult, config: str, value) -> float:
    return _median([value(t.turn2) for t in r.turns if t.config == config])


def conversation_rows(r: PrefixFleetResult, s: PrefixFleetSettings) -> tuple[tuple[str, str, str], list]:
    cached, cold = (_turn2(r, c, lambda t: t.ttft_ms) for c in ("cached", "cold"))
    ratio = cached / cold
    goal = (f"conversation: turn 2's time to first token <= 0.2x cold ({s.conversations} conversation(s), median)",
            f"{cached:.0f} / {cold:.0f} ms = {ratio:.3f}x", "yes" if ratio <= 0.2 else f"no ({ratio / 0.2:.2f}x the goal)")

    def both(value) -> str:
        return " / ".join(f"{_turn2(r, c, value):.0f}" for c in ("cached", "cold"))

    rows = [("turn 2 prompt tokens", both(lambda t: t.prompt_tokens)),
            ("turn 2 prompt tokens from the cloud's cache, cached / cold", both(lambda t: t.cached_tokens)),
            ("turn 2 prompt tokens from the edge's draft cache, cached / cold", both(lambda t: t.draft_reused_tokens)),
            ("turn 2 whole response (ms), cached / cold", both(lambda t: t.total_ms)),
            ("turn 1 time to first token (ms, nothing cached), cached / cold processes",
             " / ".join(f"{_median([t.turn1.ttft_ms for t in r.turns if t.config == c]):.0f}"
                        for c in ("cached", "cold")))]
    return goal, rows


def fleet_rows(r: PrefixFleetResult, s: PrefixFleetSettings) -> tuple[tuple[str, str, str], list]:
    shareable, served = shared_share(r.fleet, r.shared_prefix_tokens)
    share = served / shareable if shareable else float("nan")
    goal = (f"fleet ({s.replicas} replicas, {s.edges} edges x {s.rounds}, 2 system prompts): shareable prompt "
            "tokens served from a cache >= 90% (fleet-wide)", f"{served} of {shareable} = {share:.1%}",
            "yes" if share >= 0.9 else f"no ({0.9 - share:.1%} short)")
    later = [q.reply for q in r.fleet if not q.first]
    rows = [("system prompts' shared prefix (tokens; whole pages)",
             ", ".join(f"{n} ({shareable_pages(n)})" for n in r.shared_prefix_tokens)),
            ("replica each system prompt's first request landed on", ", ".join(
                f"prompt {system}: {'+'.join(map(str, replicas)) or '?'}" for system, replicas in r.landed.items())),
            ("lookups / cached tokens per replica", ", ".join(
                f"replica {i}: {q:.0f} / {c:.0f}" for i, (q, c) in enumerate(zip(r.replica_queries, r.replica_cached)))),
            ("edges' draft tokens reused (all requests)", f"{sum(q.reply.draft_reused_tokens for q in r.fleet)}"),
            ("time to first token (ms, median): first requests / the rest",
             f"{_median([q.reply.ttft_ms for q in r.fleet if q.first]):.0f} / {_median([q.ttft_ms for q in later]):.0f}")]
    return goal, rows


def format_result(r: PrefixFleetResult, s: PrefixFleetSettings) -> str:
    goals, details = [], []
    for present, rows in ((r.turns, conversation_rows), (r.fleet, fleet_rows)):
        if present:
            goal, more = rows(r, s)
            goals.append(goal)
            details += more
    details.append(("processes' start (s)", ", ".join(f"{name} {v:.0f}" for name, v in r.startup_s.items())))
    return ("| goal | measured | met |\n|---|---|---|\n" + "\n".join(f"| {g} | {m} | {y} |" for g, m, y in goals)
            + "\n\n| measure | value |\n|---|---|\n" + "\n".join(f"| {n} | {v} |" for n, v in details))
