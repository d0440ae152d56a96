"""How a token travels, traced: the project modules one speculative round's frame and verdict pass through.

A real round on loopback (the tiny pair, the resident engine, gRPC) runs under a profiler, from the
moment the round hands its block to the cloud backend until the verdict's tokens are delivered. Every
module of the project that runs in that window, in any thread (the edge, the cloud's servicer and
batcher), is on the path. docs/architecture.md's "How a token travels" names them; this test fails when a module
on the path is missing from it, or when the path grows past the house's budget of modules.
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
from pathlib import Path


from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.spec.modes import DecodeSettings
from common.sampling.params import SamplingParams
from edge.cloud_link.cloud_target import CloudTarget
from edge.decoding.decoder import EdgeSettings
from edge.node import EdgeNode, EdgeNodeSettings

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("common", "edge", "cloud", "sprinter")
# The goal is 14; today a round passes through 31: 24 on the path, 7 observers, the request's trace spans among them
# (docs/architecture.md says which and why). This keeps it from growing.
MAX_MODULES_ON_THE_PATH = 31


class PathTracer:
    """Project modules whose functions are called while `window` is set, in every thread."""

    def __init__(self) -> None:
        self.window = threading.Event()
        self.modules: set[str] = set()
        self.functions: dict[str, set[str]] = {}

    def profile(self, frame, event, arg) -> None:
        if event == "call" and self.window.is_set():
            module = frame.f_globals.get("__name__", "")
            if module.split(".")[0] in PROJECT and not module.endswith("_pb2"):
                self.modules.add(module)
                self.functions.setdefault(module, set()).add(frame.f_code.co_qualname)

    def __enter__(self) -> "PathTracer":
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


def _readme_path_modules() -> set[str]:
    section = (ROOT / "docs" / "architecture.md").read_text().split("## How a token travels", 1)[1].split("\n## ", 1)[0]
    return {path.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for path in re.findall(r"`([a-z_/]+\.py)", section)}


def _traced_round(tiny_target, tiny_draft, monkeypatch) -> set[str]:
    tracer = PathTracer()
    verify = CloudTarget.verify

    verifies = []

    async def traced_verify(self, *args, **kwargs):
        verifies.append(1)
        if len(verifies) > 1:  # a steady round: the first takes over the open, with the prompt's prefill
            tracer.window.set()
        return await verify(self, *args, **kwargs)

    monkeypatch.setattr(CloudTarget, "verify", traced_verify)

    def delivered(released) -> None:
        tracer.window.clear()  # the verdict's tokens reached the client: the round is over

    with tracer, ServerThread(CloudSettings(target="tiny-random", batch_window_ms=1), tiny_target) as server:
        settings = EdgeNodeSettings(draft=tiny_draft.spec, cloud=server.address, draft_runtime="torch",
                                    dtype="float32")
        prompt_ids = tiny_target.tokenizer("The quick brown fox")["input_ids"]

        async def run() -> None:
            async with EdgeNode(settings, draft=tiny_draft) as node:
                await node.decoder.generate(prompt_ids, EdgeSettings(DecodeSettings(mode="sd-block", k=4,
                                                                                    max_new_tokens=24)),
                                            emit=delivered)

        asyncio.run(run())
    for module, functions in sorted(tracer.functions.items()):  # shown with -s: what each module did
        print(module, sorted(functions))
    return tracer.modules


def test_the_readme_names_every_module_a_round_passes_through(tiny_target, tiny_draft, monkeypatch):
    traced = _traced_round(tiny_target, tiny_draft, monkeypatch)
    assert {"edge.cloud_link.session", "cloud.batcher", "common.spec.acceptance_rules"} <= traced  # the trace saw both sides
    listed = _readme_path_modules()
    assert traced <= listed, f"on the path but not in docs/architecture.md's 'How a token travels': {sorted(traced - listed)}"
    assert len(traced) <= MAX_MODULES_ON_THE_PATH, sorted(traced)


def test_the_tracer_sees_a_module_called_in_its_window():
    tracer = PathTracer()
    with tracer:
        tracer.window.set()
        re.compile("x")  # not the project's: ignored
        SamplingParams(temperature=0.5)
        tracer.window.clear()
    assert tracer.modules == {"common.sampling.params"}
