"""The measuring half of `sprinter simulate`: processes, the emulated link, streamed requests, results.jsonl.

One `SweepSystem` holds the cloud process, a `LinkProxy` in this event loop and the edge daemon,
whose `--cloud` is the proxy. Changing the RTT replaces the proxy by a new one on the same port:
the edge's gRPC channel sees its connection drop and reconnects through the new link, so one unrecorded
warm-up request follows every switch (it also lets the edge's cost model learn the new round trip).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from contextlib import AsyncExitStack
from typing import Any

import httpx
from tqdm import tqdm

from common.spec.modes import mode_of
from common.lab.prompt_sets import PromptRecord
from sim.link.proxy import LinkProxy
from sim.link.shaping import LinkSettings
from sim.processes import cloud_process, edge_daemon_async, free_port
from sim.sweep.baselines import LocalBaselines
from sim.sweep.results import ResultStore
from sim.sweep.settings import SimulateSettings, is_baseline, run_label
from sim.sweep.telemetry import TELEMETRY_FILE, TelemetryRecorder, cloud_fleet_args, edge_fleet_args, sweep_broker

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 1800.0  # one generation on a slow CPU at a long RTT; a hung daemon still ends
WARM_UP_TRIES = 5


def cpu_plan(settings: SimulateSettings) -> tuple[set[int] | None, set[int] | None]:
    """(cloud cores, edge cores): one core each when pinning, else unpinned."""
    cores = sorted(os.sched_getaffinity(0))
    if not settings.pin_cpus or len(cores) < 2:
        if settings.pin_cpus:
            log.warning("--pin-cpus needs 2 cores, this process may use %d: not pinning", len(cores))
        return None, None
    return {cores[0]}, {cores[1]}


def thread_env(threads: int | None) -> dict[str, str]:
    # torch sizes its pool from the machine, not the affinity mask: a pinned process must be told.
    return {"OMP_NUM_THREADS": str(threads)} if threads else {}


def link_settings(settings: SimulateSettings, rtt_ms: float) -> LinkSettings:
    return LinkSettings(delay_ms=rtt_ms / 2, jitter_ms=settings.jitter_ms,
                        jitter_distribution=settings.jitter_distribution,  # type: ignore[arg-type]
                        bandwidth_mbps=settings.bandwidth_mbps, loss=settings.loss, seed=settings.seed)


class SweepSystem:
    """Cloud process <- LinkProxy (this event loop) <- edge daemon process, with the RTT switchable.

    With `mqtt_url` both processes also report to that fleet plane broker (sim.sweep.telemetry).
    """

    def __init__(self, settings: SimulateSettings, mqtt_url: str | None = None) -> None:
        self.settings = settings
        self.mqtt_url = mqtt_url
        self.port = free_port()
        self.link: LinkProxy | None = None
        self.rtt_ms: float | None = None
        self.upstream: tuple[str, int] | None = None
        self.base = ""
        self.baselines: LocalBaselines | None = None  # llama-server processes, with --baselines
        self._stack = AsyncExitStack()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0))

    async def __aenter__(self) -> SweepSystem:
        s = self.settings
        cloud_cpus, edge_cpus = cpu_plan(s)
        threads_cloud = s.threads or (len(cloud_cpus) if cloud_cpus else None)
        threads_edge = s.threads or (len(edge_cpus) if edge_cpus else None)
        self._stack.push_async_callback(self.client.aclose)
        try:
            # Blocking while the cloud loads is fine: nothing else runs in this loop yet.
            # the cloud drafts too only where a mode asks it to (cloud-sd): the draft's weights cost its memory
            drafts = ["--draft", s.draft] if any(mode_of(m).cloud_drafts for m in s.modes) else []
            # llama.cpp runs the GGUF in its own types, on the CPU, a thread per core it is pinned to
            engine = ["--engine", "llama.cpp"] if s.engine == "llama.cpp" else ["--dtype", s.dtype, "--device", s.device]
            address = self._stack.enter_context(cloud_process(
                "--target", s.target, *engine, "--drain-s", "2", *drafts,
                *cloud_fleet_args(self.mqtt_url),
                log_path=s.out / "cloud.log",
                startup_timeout_s=900, cpus=cloud_cpus, env=thread_env(threads_cloud)))
            host, _, port = address.rpartition(":")
            self.upstream = (host, int(port))
            self._stack.push_async_callback(self._close_link)
            await self.set_rtt(s.rtt_ms[0])
            edge_args = ["--draft", s.draft, "--verifier", s.verifier, "--cloud", f"127.0.0.1:{self.port}",
                         "--mode", "sprinter-exact", "--dtype", s.dtype, "--model-name", f"{s.draft}+{s.target}"]
            edge_args += ["--policy", s.policy] if s.policy else []
            edge_args += ["--proposer", s.proposer]
            edge_args += ["--threads", str(threads_edge)] if threads_edge else []
            edge_args += edge_fleet_args(self.mqtt_url)
            # The edge asks the cloud (through the link, in this loop) while it starts: wait without blocking.
            self.base = await self._stack.enter_async_context(edge_daemon_async(
                edge_args, free_port(), s.out / "edge.log", cpus=edge_cpus, env=thread_env(threads_edge)))
            if s.baselines:
                self.baselines = self._stack.enter_context(LocalBaselines(s.baselines, s.target, s.draft, s.out,
                                                                          cloud_cpus, edge_cpus))
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _close_link(self) -> None:
        if self.link is not None:
            await self.link.close()
            self.link = None

    async def set_rtt(self, rtt_ms: float) -> None:
        """Replace the link by one with this RTT, on the same port (the edge keeps its --cloud)."""
        if self.rtt_ms == rtt_ms and self.link is not None:
            return
        await self._close_link()
        self.link = LinkProxy(link_settings(self.settings, rtt_ms), self.upstream, listen=("127.0.0.1", self.port))
        await self.link.__aenter__()
        self.rtt_ms = rtt_ms
        log.info("link: rtt %.0f ms", rtt_ms)

    async def healthz(self) -> dict[str, Any]:
        response = await self.client.get(f"{self.base}/healthz", timeout=30)
        response.raise_for_status()
        return response.json()

    async def warm_up(self, prompt: PromptRecord) -> None:
        """Reconnect through the new link and let the cost model see its round trips; not recorded."""
        for attempt in range(WARM_UP_TRIES):
            if (await self.healthz()).get("cloud") == "reachable":
                record = await stream_request(self.client, self.base, prompt, "sd", self.settings,
                                              max_tokens=min(16, self.settings.max_new_tokens))
                if not record["degraded"]:
                    return
            await asyncio.sleep(0.5 * (attempt + 1))
        log.warning("the cloud stayed unreachable through the link at rtt %s ms: results may be degraded", self.rtt_ms)

    async def request(self, prompt: PromptRecord, mode: str, pipeline: str = "off") -> dict[str, Any]:
        s = self.settings
        if is_baseline(mode):
            record = await self.baselines.request(self.client, prompt, mode, s.max_new_tokens, s.temperature, s.seed)
        else:
            record = await stream_request(self.client, self.base, prompt, mode, s, pipeline=pipeline)
            record["engine"] = "llama.cpp" if s.engine == "llama.cpp" else f"resident ({s.dtype})"
        return {"rtt_ms": float(self.rtt_ms), **record}


async def stream_request(client: httpx.AsyncClient, base: str, prompt: PromptRecord, mode: str,
                         settings: SimulateSettings, max_tokens: int | None = None,
                         pipeline: str = "off") -> dict[str, Any]:
    """One streamed generation through the OpenAI API, timed at the client."""
    body: dict[str, Any] = {"model": "sprinter", "max_tokens": max_tokens or settings.max_new_tokens,
                            "temperature": settings.temperature, "seed": settings.seed, "stream": True,
                            "stream_options": {"include_usage": True}, "mode": mode.partition("@")[0],
                            "pipeline": pipeline}
    if "@" in mode:  # a method like sprinter-exact@fixed:3: the mode with that call policy
        body["policy"] = mode.partition("@")[2]
    if prompt.chat:  # the daemon applies the chat template, as common.model.prompting.encode_prompt(chat=True) does
        url, body["messages"] = f"{base}/v1/chat/completions", [{"role": "user", "content": prompt.prompt}]
    else:
        url, body["prompt"] = f"{base}/v1/completions", prompt.prompt
    text, event_ms, final, usage, finish = [], [], None, {}, None
    ttft_ms = None
    started = time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:500]
            raise RuntimeError(f"{run_label(mode, pipeline)} request for prompt {prompt.id} failed: HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload.strip() == "[DONE]":
                break
            event = json.loads(payload)
            now_ms = (time.perf_counter() - started) * 1e3
            if not event["choices"]:  # the last chunk of its own: the usage (stream_options.include_usage)
                usage = event["usage"]
                continue
            choice = event["choices"][0]
            delta = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if delta:
                ttft_ms = now_ms if ttft_ms is None else ttft_ms
                event_ms.append(now_ms)
                text.append(delta)
            finish = choice.get("finish_reason") or finish
            if "sprinter" in event:
                final = event["sprinter"]
    wall_ms = (time.perf_counter() - started) * 1e3
    if final is None:
        raise RuntimeError(f"{run_label(mode, pipeline)} request for prompt {prompt.id}: the stream ended without its final event")
    return {"mode": mode, "pipeline": pipeline, "prompt_id": prompt.id, "category": prompt.category, "chat": prompt.chat,
            "ttft_ms": ttft_ms, "wall_ms": wall_ms, "text": "".join(text),
            "token_ids": final.get("token_ids"),  # None until the daemon sends them: quality then tokenizes
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens", 0),
            "finish_reason": finish, "degraded": bool(final.get("degraded")), "client_event_ms": event_ms,
            "sprinter": final}


async def run_sweep(settings: SimulateSettings, prompts: list[PromptRecord], progress: bool = True) -> int:
    """Every (rtt, method, pipeline, prompt) not yet in OUT/results.jsonl; returns how many ran."""
    store = ResultStore(settings.out / "results.jsonl")
    done = store.done()
    todo = {rtt: [(m, pipeline, p) for m, pipeline in settings.runs() for p in prompts
                  if (float(rtt), m, pipeline, p.id) not in done]
            for rtt in settings.rtt_ms}
    total = sum(map(len, todo.values()))
    if total == 0:
        log.info("every (rtt, mode, pipeline, prompt) is already in %s: nothing to measure", store.path)
        return 0
    log.info("measuring %d requests (%d already done); starting the cloud and the edge", total, len(done))
    # The broker starts before the processes that report to it; the recorder once they are up
    # (the cloud's start blocks this loop, which would starve a connection's keepalive).
    with sweep_broker(settings.mqtt, settings.out / "broker") as mqtt_url, \
            tqdm(total=total, desc="simulate", unit="req", disable=not progress) as bar:
        async with SweepSystem(settings, mqtt_url) as system, \
                TelemetryRecorder(mqtt_url, settings.out / TELEMETRY_FILE) as recorder:
            for rtt, combos in todo.items():
                if combos:
                    await measure_rtt(system, recorder, store, rtt, combos, prompts[0], bar)
    return total


async def measure_rtt(system: SweepSystem, recorder: TelemetryRecorder, store: ResultStore, rtt: float,
                      combos: list[tuple[str, str, PromptRecord]], warm_up_prompt: PromptRecord, bar: tqdm) -> None:
    """One RTT's (method, pipeline, prompt) requests, each (method, pipeline)'s cost model snapshot after its
    last one. The fleet plane's phases are labelled by run_label ('sd-block/send-ahead')."""
    recorder.phase = None  # the switch and the warm-up are no method's
    await system.set_rtt(rtt)
    await system.warm_up(warm_up_prompt)
    for i, (mode, pipeline, prompt) in enumerate(combos):
        label = run_label(mode, pipeline)
        bar.set_postfix_str(f"rtt {rtt:g} ms, {label}")
        recorder.phase = (float(rtt), label)
        record = await system.request(prompt, mode, pipeline)
        if record["degraded"]:
            log.warning("degraded response: rtt %g ms, %s, prompt %s", rtt, label, prompt.id)
        store.append(record)
        bar.update()
        if i + 1 == len(combos) or combos[i + 1][:2] != (mode, pipeline):  # the run's last request at this RTT
            snapshot = {"rtt_ms": float(rtt), "mode": mode, "pipeline": pipeline,
                        "cost_model": (await system.healthz()).get("cost_model")}
            store.append(snapshot, system.settings.out / "cost_model.jsonl")
    recorder.phase = None
