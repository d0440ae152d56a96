"""A real cloud service on loopback for tests: CloudServer in a thread of its own, sync gRPC clients."""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import replace
from typing import Iterator

import grpc

from cloud.server import CloudServer, CloudSettings
from common.model.loading import LoadedModel
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc


class ServerThread:
    """Runs `CloudServer` on its own event loop in a background thread (port 0: any free port).

    With `wait_ready=False` it is usable as soon as the port is bound, before the model is loaded.
    The cost table (cloud/cost_table.py: 36 forwards timed before serving, about 7 s for SmolLM2 on one core) is
    timed only when a test asks for it (`cost_table=True`): only `--mode auto` reads it, and most tests start a cloud.
    """

    def __init__(self, settings: CloudSettings, target: LoadedModel | None, wait_ready: bool = True,
                 draft: LoadedModel | None = None, cost_table: bool = False) -> None:
        settings = settings if cost_table else replace(settings, cost_table="off")
        self.settings = replace(settings, port=0) if settings.port == 50051 else settings
        self.target = target
        self.draft = draft  # the cloud's own (settings.draft names it): cloud-sd
        self.wait_ready = wait_ready
        self.server: CloudServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="cloud-server", daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        if not self._ready.wait(60) or self._error:
            raise RuntimeError(f"cloud server did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self._loop.call_soon_threadsafe(self.server.stop)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the server did not stop"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as err:  # surfaced by __enter__
            self._error = err
            self._ready.set()

    async def _main(self) -> None:
        async with CloudServer(self.settings, self.target, self.draft) as server:
            self.server = server
            if self.wait_ready:
                await server.wait_ready()
            self._ready.set()
            await server.wait_stopped()


class SessionStream:
    """One Session stream driven synchronously: `send(frame)` returns the cloud's answer frame."""

    def __init__(self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] | None = None) -> None:
        self._requests: queue.Queue[pb.EdgeFrame | None] = queue.Queue()
        self.call = pb_grpc.TargetServiceStub(channel).Session(iter(self._requests.get, None), metadata=metadata)
        self._responses: Iterator[pb.CloudFrame] = iter(self.call)

    def send(self, frame: pb.EdgeFrame) -> pb.CloudFrame:
        self._requests.put(frame)
        return next(self._responses)

    def open(self, prompt_ids: list[int], **kw) -> pb.CloudFrame:
        return self.send(pb.EdgeFrame(open=pb.OpenSession(prompt_ids=prompt_ids, **kw)))

    def verify(self, start_position: int, draft_tokens: list[int], method: int = pb.METHOD_BLOCK, **kw) -> pb.CloudFrame:
        return self.send(pb.EdgeFrame(verify=pb.VerifyBlock(start_position=start_position, draft_tokens=draft_tokens,
                                                            method=method, **kw)))

    def close(self) -> None:
        self._requests.put(pb.EdgeFrame(close=pb.CloseSession()))
        self._requests.put(None)
        for _ in self._responses:  # drain until the server ends the stream
            pass

    def abandon(self) -> None:
        """End the stream without a close frame (an edge that went away)."""
        self._requests.put(None)
        self.call.cancel()
