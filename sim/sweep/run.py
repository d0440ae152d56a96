"""The measuring half of `sprinter simulate`: processes, the emulated link, streamed requests, results.jsonl.

One `SweepSystem` holds the system under test (sim/sweep/system.py): the cloud process, a `LinkProxy` in this
event loop and the edge daemon, whose `--cloud` is the proxy. Changing the RTT changes the link's delay under the
edge's open connection; one unrecorded warm-up request follows every switch, so that the edge's cost model learns
the new round trip.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import AsyncExitStack
from typing import Any

import httpx
from tqdm import tqdm

from common.spec.modes import mode_of
from common.lab.prompt_sets import PromptRecord
from sim.cores import CorePlan, my_cores
from sim.link.shaping import LinkSettings
from sim.sweep.baselines import LocalBaselines
from sim.sweep.results import ResultStore
from sim.sweep.settings import SimulateSettings, is_baseline, run_label
from sim.sweep.system import SystemSettings, SystemUnderTest
from sim.sweep.telemetry import TELEMETRY_FILE, TelemetryRecorder, sweep_broker

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 1800.0  # one generation on a slow CPU at a long RTT; a hung daemon still ends
WARM_UP_TRIES = 5


def sweep_cores(settings: SimulateSettings) -> CorePlan | None:
    """One core each for the cloud and the edge when pinning, else nothing pinned."""
    cores = my_cores()
    if not settings.pin_cpus or len(cores) < 2:
        if settings.pin_cpus:
            log.warning("--pin-cpus needs 2 cores, this process may use %d: not pinning", len(cores))
        return None
    return CorePlan.split(cores[:2])


def system_settings(settings: SimulateSettings, mqtt_url: str | None) -> SystemSettings:
    """The sweep's system: the edge a daemon; the cloud drafts too only where a mode asks it to (cloud-sd): the
    draft's weights cost its memory."""
    s = settings
    link = LinkSettings(jitter_ms=s.jitter_ms, jitter_distribution=s.jitter_distribution,  # type: ignore[arg-type]
                        bandwidth_mbps=s.bandwidth_mbps, loss=s.loss, seed=s.seed)
    edge = ("--verifier", s.verifier, "--mode", "sprinter-exact", "--model-name", f"{s.draft}+{s.target}",
            *(("--policy", s.policy) if s.policy else ()), "--proposer", s.proposer)
    return SystemSettings(s.target, s.draft, s.out, dtype=s.dtype, engine=s.engine, device=s.device,
                          cloud_drafts=any(mode_of(m).cloud_drafts for m in s.modes), cloud_flags=("--drain-s", "2"),
                          mqtt_url=mqtt_url, link=link, rtt_ms=s.rtt_ms[0], edge_flags=edge, cores=sweep_cores(s),
                          threads=s.threads, startup_timeout_s=900)


class SweepSystem:
    """The system under test (sim/sweep/system.py) with the edge a daemon, and the sweep's client and baselines.

    With `mqtt_url` both processes also report to that fleet plane broker (sim.sweep.telemetry).
    """

    def __init__(self, settings: SimulateSettings, mqtt_url: str | None = None) -> None:
        self.settings = settings
        self.system = SystemUnderTest(system_settings(settings, mqtt_url))
        self.baselines: LocalBaselines | None = None  # llama-server processes, with --baselines
        self._stack = AsyncExitStack()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0))

    async def __aenter__(self) -> SweepSystem:
        s, cores = self.settings, self.system.settings.cores
        self._stack.push_async_callback(self.client.aclose)
        try:
            await self._stack.enter_async_context(self.system)
            if s.baselines:
                self.baselines = self._stack.enter_context(LocalBaselines(
                    s.baselines, s.target, s.draft, s.out, set(cores.cloud) if cores else None,
                    set(cores.edge) if cores else None))
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    @property
    def base(self) -> str:
        return self.system.base

    @property
    def rtt_ms(self) -> float:
        return self.system.rtt_ms

    def set_rtt(self, rtt_ms: float) -> None:
        self.system.set_rtt(rtt_ms)

    async def healthz(self) -> dict[str, Any]:
        response = await self.client.get(f"{self.base}/healthz", timeout=30)
        response.raise_for_status()
        return response.json()

    async def warm_up(self, prompt: PromptRecord) -> None:
        """Let the edge's cost model see the new RTT's round trips (waiting while the cloud is unreachable); not recorded."""
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
    system.set_rtt(rtt)
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
