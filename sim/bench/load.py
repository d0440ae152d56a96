"""What the load and fault benchmarks (soak, chaos) share: one request through the edge's OpenAI API,
judged strictly, and a sampler of the processes' memory and the cloud's Prometheus metrics.

Requests go over plain HTTP (httpx) rather than the `openai` client: the client retries, wraps
statuses and ends a stream quietly when the connection closes, and here we want to see each of those
as it happened (the exact status, a stream that stopped before its final event).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from common.stats import percentile

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: str
    chat: bool
    mode: str | None  # None: the edge's default mode
    max_tokens: int
    stream: bool
    temperature: float = 0.0
    seed: int = 0
    messages: tuple[dict[str, str], ...] = ()  # a chat's whole conversation, in place of `prompt` alone


@dataclass
class RequestOutcome:
    """How one request ended. `ok`: HTTP 200 and a complete answer (a stream up to its final event)."""

    index: int
    mode: str
    stream: bool
    ok: bool
    status: int | None  # HTTP status; None when no response arrived
    error: str | None  # what went wrong, as the client saw it
    started_s: float  # monotonic
    latency_s: float
    ttft_s: float | None  # streams: first content
    tokens: int = 0
    degraded: bool = False
    degraded_reason: str | None = None  # the edge's: cloud_unreachable, deadline, no_cloud
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # the answer's, from its `sprinter` object
    sprinter: dict[str, Any] | None = None  # the rest of that object: time in line, reopens, calls, stats
    text: str = ""  # the answer's content (a stream's as it came)
    prompt_tokens: int | None = None  # the usage's

    @property
    def ended_s(self) -> float:
        return self.started_s + self.latency_s


def request_body(spec: RequestSpec) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of the request: chat prompts to /v1/chat/completions, others to /v1/completions."""
    body: dict[str, Any] = {"model": "sprinter", "max_tokens": spec.max_tokens, "temperature": spec.temperature,
                            "seed": spec.seed, "stream": spec.stream}
    if spec.mode is not None:
        body["mode"] = spec.mode
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.chat:
        messages = list(spec.messages) or [{"role": "user", "content": spec.prompt}]
        return "/v1/chat/completions", {**body, "messages": messages}
    return "/v1/completions", {**body, "prompt": spec.prompt}


async def send_request(client: httpx.AsyncClient, base: str, spec: RequestSpec) -> RequestOutcome:
    """One request; never raises: whatever happened is in the outcome."""
    path, body = request_body(spec)
    started = time.monotonic()
    outcome = RequestOutcome(spec.index, spec.mode, spec.stream, False, None, None, started, 0.0, None)
    try:
        if spec.stream:
            await _streamed(client, base + path, body, outcome)
        else:
            response = await client.post(base + path, json=body)
            outcome.status = response.status_code
            if response.status_code == 200:
                _read_final(response.json(), outcome)
                outcome.ok = True
            else:
                outcome.error = f"HTTP {response.status_code}: {response.text[:300]}"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError) as err:
        outcome.error = f"{type(err).__name__}: {err}"
    outcome.latency_s = time.monotonic() - started
    return outcome


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any] | None]:
    """The JSON events of a streamed OpenAI answer, in order; None last when the stream ended with [DONE]."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):].strip()
        if payload == "[DONE]":
            yield None
            return
        yield json.loads(payload)


async def _streamed(client: httpx.AsyncClient, url: str, body: dict[str, Any], outcome: RequestOutcome) -> None:
    done = final = False
    async with client.stream("POST", url, json=body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            outcome.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
            return
        async for event in sse_events(response):
            if event is None:
                done = True
                break
            if "error" in event:
                outcome.error = f"error event in the stream: {event['error']}"
                return
            choice = event["choices"][0] if event.get("choices") else {}
            content = choice.get("text") or (choice.get("delta") or {}).get("content")
            if content and outcome.ttft_s is None:
                outcome.ttft_s = time.monotonic() - outcome.started_s
            outcome.text += content or ""
            if choice.get("finish_reason"):  # the final chunk (degraded ones before it carry a partial `sprinter`)
                _read_final(event, outcome)
                final = True
            if event.get("usage"):  # after it, a chunk of its own (stream_options.include_usage)
                outcome.tokens, outcome.prompt_tokens = (event["usage"][k] for k in ("completion_tokens", "prompt_tokens"))
    if not (final and done):
        outcome.error = f"cut stream: {'no final event' if not final else 'no [DONE]'} (HTTP 200)"
        return
    outcome.ok = True


def _read_final(answer: dict[str, Any], outcome: RequestOutcome) -> None:
    if answer.get("usage"):  # a whole (not streamed) answer
        outcome.tokens, outcome.prompt_tokens = (answer["usage"][k] for k in ("completion_tokens", "prompt_tokens"))
        choice = answer["choices"][0]
        outcome.text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
    outcome.degraded = bool(answer["sprinter"]["degraded"])
    outcome.degraded_reason = answer["sprinter"].get("degraded_reason")
    outcome.token_ids = answer["sprinter"].get("token_ids")
    outcome.sprinter = {k: v for k, v in answer["sprinter"].items() if k != "token_ids"}
    outcome.finish_reason = answer["choices"][0].get("finish_reason") if answer.get("choices") else None


def rss_bytes(pid: int | None, field: str = "VmRSS") -> int | None:
    """Resident set size of a live process (VmRSS in /proc/PID/status; VmHWM: its peak); None when it is gone."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time a live process has used (/proc/PID/stat); None when it is gone."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)
    except (OSError, ValueError, IndexError):
        return None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {sample name with labels: value} (comments skipped)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            values[name] = float(value)
        except ValueError:
            continue
    return values


def scrape_metrics(port: int, timeout_s: float = 10) -> dict[str, float]:
    """The Prometheus endpoint of a process on this machine (http://127.0.0.1:PORT/metrics), parsed."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as response:
        return parse_metrics(response.read().decode())


@dataclass
class Sample:
    at_s: float  # since the sampler started
    cloud_rss: int | None
    edge_rss: int | None
    cloud_cpu_s: float | None  # CPU time used so far (a restarted cloud starts again from 0)
    edge_cpu_s: float | None
    kv_cache_bytes: float | None
    sessions_open: float | None
    sessions_evicted: float | None


@dataclass
class ProcessSampler:
    """Every `interval_s`: both processes' RSS and the cloud's metrics, until `stop()`."""

    cloud_pid: Callable[[], int | None]  # a callable: a restarted cloud has a new pid
    edge_pid: int | None
    metrics_port: int | None  # the cloud's (scrape_metrics)
    interval_s: float = 0.5
    samples: list[Sample] = field(default_factory=list)
    scrape_failures: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _started: float = field(default_factory=time.monotonic)

    async def run(self) -> None:
        while not self._stop.is_set():
            await self.sample()
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
        await self.sample()  # the state at the end

    async def sample(self) -> None:
        metrics: dict[str, float] = {}
        if self.metrics_port:
            try:
                metrics = await asyncio.to_thread(scrape_metrics, self.metrics_port, 5)
            except (OSError, http.client.HTTPException):
                self.scrape_failures += 1  # a cloud that is down or restarting has no metrics to give
        self.samples.append(Sample(
            time.monotonic() - self._started, rss_bytes(self.cloud_pid()), rss_bytes(self.edge_pid),
            cpu_seconds(self.cloud_pid()), cpu_seconds(self.edge_pid),
            metrics.get("sprinter_cloud_kv_cache_bytes"), metrics.get("sprinter_cloud_sessions_open"),
            metrics.get("sprinter_cloud_sessions_evicted_total")))

    def stop(self) -> None:
        self._stop.set()

    def maximum(self, name: str) -> float | None:
        values = [getattr(s, name) for s in self.samples if getattr(s, name) is not None]
        return max(values) if values else None

    def last(self, name: str) -> float | None:
        values = [getattr(s, name) for s in self.samples if getattr(s, name) is not None]
        return values[-1] if values else None

    def used(self, name: str) -> float | None:
        """How much a counter (CPU seconds) grew from the first sample to the last."""
        values = [getattr(s, name) for s in self.samples if getattr(s, name) is not None]
        return values[-1] - values[0] if values else None

    def growth(self, name: str, half_s: float) -> float | None:
        """How much the largest value after `half_s` exceeds the largest before it (RSS creeping up)."""
        known = [s for s in self.samples if getattr(s, name) is not None]
        before = [getattr(s, name) for s in known if s.at_s < half_s]
        after = [getattr(s, name) for s in known if s.at_s >= half_s]
        return max(after) - max(before) if before and after else None


def latency_summary(outcomes: Sequence[RequestOutcome]) -> dict[str, float | None]:
    latencies = [o.latency_s for o in outcomes if o.ok]
    ttfts = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None]
    p = percentile
    return {"latency_s_p50": p(latencies, 0.5), "latency_s_p90": p(latencies, 0.9), "latency_s_p99": p(latencies, 0.99),
            "latency_s_max": max(latencies, default=None), "ttft_s_p50": p(ttfts, 0.5), "ttft_s_p99": p(ttfts, 0.99)}


def http_client(concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0), limits=limits)


def mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def failure_lines(outcomes: Sequence[RequestOutcome], limit: int = 10) -> list[str]:
    """The failed requests, one line each (the first `limit`), for the report."""
    failed = [o for o in outcomes if not o.ok]
    lines = [f"request {o.index} ({o.mode}, {'stream' if o.stream else 'whole'}): {o.error}" for o in failed[:limit]]
    if len(failed) > limit:
        lines.append(f"... and {len(failed) - limit} more (see the JSON)")
    return lines
