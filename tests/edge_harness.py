"""The edge daemon in this process for tests: the real app over a real EdgeNode, served by uvicorn on loopback.

`EdgeDaemonThread` runs `create_app` (edge/api/app.py) on an EdgeNode with the tiny draft, on its own
event loop in a background thread (the node's gRPC channel belongs to that loop). Clients talk
HTTP to it exactly as to `sprinter edge serve`: the openai client, httpx, or a raw socket.

`ScriptedCloud` is a real gRPC server on loopback whose TargetService answers from a script: for
behaviours the real cloud shows only under load or a fault that a test cannot make on cue (a full
session table, a hung Generate).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import grpc
import uvicorn

from common.spec.tree.draft_tree import DraftTree
from common.model.loading import LoadedModel, vocab_fingerprint
from edge.node import EdgeNode, EdgeNodeSettings
from sim.processes import free_port
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc


class EdgeDaemonThread:
    """`with EdgeDaemonThread(draft, cloud_address, mode="sd") as edge:` then HTTP to `edge.base`."""

    def __init__(self, draft: LoadedModel, cloud: str | None, make_app: Callable[[EdgeNode], Any],
                 node_settings: dict[str, Any] | None = None) -> None:
        self.draft = draft
        self.node_settings = EdgeNodeSettings(draft=draft.spec, cloud=cloud, draft_runtime="torch", dtype="float32",
                                              verifier="confidence:0.3", **(node_settings or {}))
        self.make_app = make_app
        self.port = free_port()
        self.node: EdgeNode | None = None
        self.server: uvicorn.Server | None = None
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="edge-daemon", daemon=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "EdgeDaemonThread":
        self._thread.start()
        if not self._ready.wait(60) or self._error is not None:
            raise RuntimeError(f"edge daemon did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self._thread.join(30)
        assert not self._thread.is_alive(), "the edge daemon did not stop"

    def call(self, coroutine: Any, timeout_s: float = 30) -> Any:
        """Run a coroutine on the daemon's loop (e.g. the node's own calls) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as err:  # surfaced by __enter__
            self._error = err
            self._ready.set()

    async def _main(self) -> None:
        async with EdgeNode(self.node_settings, self.draft) as node:
            self.node = node
            config = uvicorn.Config(self.make_app(node), host="127.0.0.1", port=self.port, log_level="warning",
                                    lifespan="off")
            self.server = uvicorn.Server(config)
            serving = asyncio.create_task(self.server.serve())
            while not self.server.started and not serving.done():
                await asyncio.sleep(0.01)
            self._ready.set()
            await serving


# --- a cloud that answers from a script ----------------------------------------------------------


@dataclass
class Script:
    """What the scripted cloud answers. Opens: refusals before the session opens; verify: accept all."""

    tokenizer_fingerprint: str
    open_refusals: list[pb.Error] = field(default_factory=list)  # answered to the first opens, in order
    verify_refusals_after: int | None = None  # verify: refuse every frame after this many verdicts
    verify_refusal: pb.Error | None = None
    generate_hangs_after: int | None = None  # Generate: stream this many tokens, then go silent
    generate_fails_after: int | None = None  # Generate: stream this many tokens, then fail UNAVAILABLE (a kill)
    generate_busy: int = 0  # Generate: refuse this many calls RESOURCE_EXHAUSTED (retry hint 50 ms), then serve
    generates: int = 0
    open_delay_s: float = 0.0  # how long an open takes (a long prompt's prefill)
    next_token: int = 5
    opens: int = 0
    verifies: int = 0
    max_tree_tokens: int = 0  # the limit announced (0: chains only); a tree frame's verdict keeps its last node's path
    frames: list[pb.VerifyBlock] = field(default_factory=list)  # every verify frame received


class ScriptedServicer(pb_grpc.TargetServiceServicer):
    def __init__(self, script: Script) -> None:
        self.script = script

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.ServiceInfo:
        return pb.ServiceInfo(model_id="scripted", vocab_fingerprint=self.script.tokenizer_fingerprint,
                              limits=pb.Limits(max_block=32, max_context=4096, max_sparse_support=4096,
                                               max_tree_tokens=self.script.max_tree_tokens))

    async def Session(self, requests: AsyncIterator[pb.EdgeFrame],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CloudFrame]:
        async for frame in requests:
            kind = frame.WhichOneof("frame")
            if kind == "open":
                self.script.opens += 1
                await asyncio.sleep(self.script.open_delay_s)
                if self.script.open_refusals:
                    yield pb.CloudFrame(error=self.script.open_refusals.pop(0))
                else:
                    yield pb.CloudFrame(opened=pb.SessionOpened(session_id="s", limits=pb.Limits(
                        max_block=32, max_tree_tokens=self.script.max_tree_tokens)))
            elif kind == "verify":
                after = self.script.verify_refusals_after
                if after is not None and self.script.verifies >= after:
                    yield pb.CloudFrame(error=self.script.verify_refusal)
                    continue
                self.script.verifies += 1
                self.script.frames.append(frame.verify)
                yield pb.CloudFrame(verdict=_accept_all(frame.verify, self.script.next_token))
            else:
                return

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        self.script.generates += 1
        if self.script.generates <= self.script.generate_busy:
            context.set_trailing_metadata((("retry-after-ms", "50"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the KV cache budget is held; retry shortly")
        if self.script.generate_fails_after is not None:
            for _ in range(self.script.generate_fails_after):
                yield pb.GenerateChunk(token_ids=[self.script.next_token])
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica went away")
        if self.script.generate_hangs_after is None:  # serve the whole request
            for _ in range(request.max_new_tokens):
                yield pb.GenerateChunk(token_ids=[self.script.next_token])
            return
        for _ in range(self.script.generate_hangs_after or 0):
            yield pb.GenerateChunk(token_ids=[self.script.next_token])
        await asyncio.sleep(3600)  # a cloud that hangs: no chunk, no end


def _accept_all(block: pb.VerifyBlock, next_token: int) -> pb.Verdict:
    """A chain kept whole; a tree's path to its last node (a side path when the tree branched) kept whole."""
    if not block.parents:
        return pb.Verdict(n_accepted=len(block.draft_tokens), next_token=next_token)
    path = DraftTree(list(block.draft_tokens), list(block.parents)).path_to(len(block.draft_tokens) - 1)
    return pb.Verdict(n_accepted=len(path), next_token=next_token, path=path)


class ScriptedCloud:
    """`with ScriptedCloud(script) as cloud:` a real gRPC server on loopback, on its own loop and thread."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._server: grpc.aio.Server | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self.loop.run_forever, name="scripted-cloud", daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> "ScriptedCloud":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        pb_grpc.add_TargetServiceServicer_to_server(ScriptedServicer(self.script), self._server)
        self._server.add_insecure_port(self.address)
        await self._server.start()

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def scripted(draft: LoadedModel, **kw: Any) -> Script:
    return Script(tokenizer_fingerprint=vocab_fingerprint(draft.tokenizer), **kw)


async def on_edge(address: str, draft: LoadedModel, work: Callable[[EdgeNode], Any], runtime: str = "torch") -> Any:
    """`work(node)` on an EdgeNode drafting with `draft` in float32 (the baseline verifier) against the cloud at
    `address`: the statistical and identity tests' edge."""
    settings = EdgeNodeSettings(draft=draft.spec, cloud=address, draft_runtime=runtime, dtype="float32",
                                verifier="confidence:0.3")
    async with EdgeNode(settings, draft) as node:
        return await work(node)
