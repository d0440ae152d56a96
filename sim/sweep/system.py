"""The system a network measurement runs against: a cloud process, a link at a switchable RTT, and the edge.

    system = SystemSettings("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", out, rtt_ms=50)   # the edge in this process
    result = measure_here(system, scenario)     # `await scenario(sut)`: sut.edge_node(draft), sut.set_rtt(100), ...
    rows = measure_edge_here(system, 3, scenario)   # `await scenario(sut, draft, prompt_ids)`: the draft loaded here
    # a bench's scenario over RTTs:  for rtt in sut.at_rtts((0, 50, 200)): rows += await measure_at(node, rtt)

    SystemSettings(..., edge_flags=("--verifier", "auto"))   # the edge as a daemon: sut.base is its OpenAI API

The cloud is `sprinter cloud serve` in a process of its own, as sim/cloud_under_test.py describes and starts
every measurement's cloud. The link is a LinkProxy in this event loop (sim/link/proxy.py: half the RTT each way),
listening on a port picked before anything starts, so that the cloud can announce it (`advertise_link`) and the
edge keeps one `--cloud` while `set_rtt` changes the delay under it; `link=None` leaves it out (the edge dials the
cloud). The edge is either `sprinter edge serve` in a process of its
own or EdgeNodes in this process (edge/node.py), which then runs on the edge's cores. The cores are one CorePlan
(sim/cores.py); `cores=None` pins nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sim.bench.prompts import load_bench_prompts
from sim.cloud_under_test import CloudUnderTest
from sim.cores import CorePlan, thread_env
from sim.link.proxy import LinkProxy
from sim.link.shaping import LinkSettings
from sim.processes import edge_daemon_async, free_port
from sim.sweep.telemetry import cloud_fleet_args, edge_fleet_args

if TYPE_CHECKING:
    from common.lab.prompt_sets import PromptRecord
    from common.model.loading import LoadedModel
    from edge.decoding.decoder import EdgeResult, EdgeSettings
    from edge.node import EdgeNode

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class SystemSettings:
    target: str
    draft: str
    out: Path  # the processes' logs: cloud.log, edge.log
    dtype: str = "bfloat16"
    engine: str = "resident"  # the cloud's --engine; llama.cpp runs the GGUF in its own types, so takes no --dtype
    device: str | None = None  # the cloud's --device (None: its default)
    cloud_drafts: bool = False  # the cloud serves the draft too (`cloud serve --draft`: cloud-sd, placement cloud)
    cloud_flags: tuple[str, ...] = ()  # more `cloud serve` flags
    mqtt_url: str | None = None  # the fleet plane the cloud (and an edge daemon) report to (sim/sweep/telemetry.py)
    advertise_link: bool = False  # the cloud announces the link's address: the replica its edges dial
    link: LinkSettings | None = LinkSettings()  # its delay is the RTT's; None: no link, the edge dials the cloud
    rtt_ms: float = 0.0  # the link's RTT until set_rtt
    edge_flags: tuple[str, ...] | None = None  # the edge as a daemon: `edge serve` flags beyond --draft, --dtype,
    # --cloud and --threads; None: the edge runs in this process (edge_node)
    cores: CorePlan | None = field(default_factory=CorePlan.split)
    threads: int | None = None  # each process's torch threads (None: as many as its cores)
    startup_timeout_s: float = 300.0

    def threads_on(self, cores: frozenset[int] | None) -> int | None:
        return self.threads or (len(cores) if cores else None)


class SystemUnderTest:
    """`async with SystemUnderTest(settings) as system:` the cloud, the link and the edge daemon up, until the end."""

    def __init__(self, settings: SystemSettings) -> None:
        self.settings = settings
        # The link listens where the OS puts it (no port picked here and bound seconds later, which another
        # process may take meanwhile), except when the cloud must announce it before the link is up.
        self.link_port = free_port() if settings.advertise_link else 0
        self.link: LinkProxy | None = None
        self.rtt_ms = settings.rtt_ms
        self.cloud_address = ""
        self.base = ""  # the edge daemon's API, http://127.0.0.1:PORT
        self._stack = AsyncExitStack()

    @property
    def edge_dials(self) -> str:
        """The edge's --cloud: the link, or the cloud itself when there is none."""
        return f"127.0.0.1:{self.link_port}" if self.settings.link is not None else self.cloud_address

    def cloud(self) -> CloudUnderTest:
        """The cloud process, on the plan's cloud cores; llama.cpp runs the GGUF in its own types (no --dtype)."""
        s, llama_cpp = self.settings, self.settings.engine == "llama.cpp"
        flags = {"engine": "llama.cpp" if llama_cpp else None, "device": s.device,
                 "draft": s.draft if s.cloud_drafts else None,
                 "advertise": f"127.0.0.1:{self.link_port}" if s.advertise_link else None}
        return CloudUnderTest(s.target, None if llama_cpp else s.dtype, flags,
                              (*cloud_fleet_args(s.mqtt_url), *s.cloud_flags), cpus=s.cores.cloud if s.cores else None,
                              threads=s.threads, startup_timeout_s=s.startup_timeout_s)

    async def __aenter__(self) -> SystemUnderTest:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _start(self) -> None:
        s, cores = self.settings, self.settings.cores
        if cores is not None and s.edge_flags is None:
            self._stack.enter_context(cores.edge_here())
        # Blocking while the cloud loads is fine: nothing else runs in this loop yet.
        self.cloud_address = self._stack.enter_context(self.cloud().running(s.out / "cloud.log")).address
        if s.link is not None:
            host, _, port = self.cloud_address.rpartition(":")
            self.link = await self.hold(LinkProxy(replace(s.link, delay_ms=s.rtt_ms / 2), (host, int(port)),
                                                  listen=("127.0.0.1", self.link_port)))
            self.link_port = int(self.link.address.rpartition(":")[2])
        if s.edge_flags is not None:
            threads = s.threads_on(cores.edge if cores else None)
            flags = ["--draft", s.draft, "--dtype", s.dtype, "--cloud", self.edge_dials,
                     *(["--threads", str(threads)] if threads else []), *edge_fleet_args(s.mqtt_url), *s.edge_flags]
            # The edge asks the cloud (through the link, in this loop) while it starts: wait without blocking.
            self.base = await self.hold(edge_daemon_async(flags, free_port(), s.out / "edge.log",
                                                          cpus=set(cores.edge) if cores else None,
                                                          env=thread_env(threads)))

    async def hold(self, context: AbstractAsyncContextManager[T]) -> T:
        """Enter `context` for as long as the system runs (it closes before the system does)."""
        return await self._stack.enter_async_context(context)

    def set_rtt(self, rtt_ms: float) -> None:
        """The link's RTT from now on; the edge's connection stays open through it."""
        if self.link is None:
            raise RuntimeError("this system has no link: its RTT cannot change")
        self.link.change_delay(rtt_ms / 2)
        self.rtt_ms = rtt_ms
        log.info("link: rtt %g ms", rtt_ms)

    def at_rtts(self, rtts: Iterable[float]) -> Iterator[float]:
        """Each of `rtts` in turn, the link set to it before the caller measures there (a bench's RTT sweep)."""
        for rtt in rtts:
            self.set_rtt(rtt)
            yield rtt

    async def edge_node(self, draft: LoadedModel, **settings: Any) -> EdgeNode:
        """An edge in this process dialling the cloud through the link; it drafts as the edge daemon does (ONNX
        Runtime, int8 weights) unless `settings` say otherwise."""
        from edge.node import EdgeNode, EdgeNodeSettings  # the daemon's systems need no edge here

        s = self.settings
        node_settings = EdgeNodeSettings(**{"draft": s.draft, "cloud": self.edge_dials, "dtype": s.dtype, **settings})
        return await self.hold(EdgeNode(node_settings, draft))


def draft_label(runtime: str = "onnx", dtype: str = "bfloat16", weights: str | None = None) -> str:
    """How an edge's draft ran, for a table's headline: "onnx-int8" (the edge daemon's runtime and weights; ONNX with
    other `weights`, "onnx-<weights>"), "llama.cpp" (the GGUF as shipped) or "torch-<dtype>"."""
    if runtime == "torch":
        return f"torch-{dtype}"
    from edge.runtime.draft_choice import runtime_label

    return runtime_label(runtime, weights)


def measure_here(settings: SystemSettings, scenario: Callable[[SystemUnderTest], Awaitable[T]]) -> T:
    """Start the system, run `scenario` against it in one event loop, stop it; returns what the scenario did."""
    async def run() -> T:
        async with SystemUnderTest(settings) as system:
            return await scenario(system)
    return asyncio.run(run())


def measure_edge_here(settings: SystemSettings, prompts: int | Sequence[PromptRecord],
                      scenario: Callable[[SystemUnderTest, LoadedModel, list[list[int]]], Awaitable[T]]) -> T:
    """`measure_here` for a scenario whose edges run in this process: `scenario(system, draft, prompt_ids)`, the
    draft loaded here once in the system's dtype (the scenario's edge nodes share it) and `prompts` in its tokens,
    chat-encoded where a prompt is a chat (a count: the first bench prompts, sim/data/bench_prompts.jsonl)."""
    from common.model.loading import DTYPES, load_model
    from common.model.prompting import encode_prompt

    draft = load_model(settings.draft, DTYPES[settings.dtype])
    chosen = [(p["prompt"], p["chat"]) for p in load_bench_prompts()[:prompts]] if isinstance(prompts, int) \
        else [(record.prompt, record.chat) for record in prompts]
    ids = [encode_prompt(draft.tokenizer, text, chat) for text, chat in chosen]
    return measure_here(settings, lambda system: scenario(system, draft, ids))


async def generate(node: EdgeNode, ids: list[int], settings: EdgeSettings, what: str) -> tuple[EdgeResult, float]:
    """One generation on an edge in this process and its wall seconds here; RuntimeError naming `what` when it lost
    the cloud (a measurement of the link must not count the draft's own fallback)."""
    started = time.perf_counter()
    result = await node.decoder.generate(ids, settings)
    if result.degraded or result.error:
        raise RuntimeError(f"{what} lost the cloud: {result.degraded_reason or result.error}")
    return result, time.perf_counter() - started
