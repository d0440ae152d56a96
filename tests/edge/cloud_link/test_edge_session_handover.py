"""A stream the edge gives up on (a deadline, a broken connection) must not leave its session on the cloud.

Found by the full-size soak (issue 12): under overload a verify outlived the edge's deadline, the edge
reopened on a fresh stream, and the cloud kept the old session until its idle timeout, until the
session limit refused everyone (RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import asyncio

from cloud.server import CloudSettings
from cloud_harness import ServerThread
from common.sampling.distributions import SamplingParams
from common.model.loading import vocab_fingerprint
from edge.cloud_link.client import CloudEndpoint
from edge.cloud_link.replicas import ReplicaSet
from sprinter.v1 import decoding_pb2 as pb


def test_a_reopen_after_a_broken_stream_closes_the_session_left_behind(tiny_target) -> None:
    prompt = tiny_target.tokenizer("the session left behind")["input_ids"]

    async def scenario(address: str) -> list[int]:
        open_sessions = []
        fingerprint = vocab_fingerprint(tiny_target.tokenizer)
        async with ReplicaSet([address], lambda a, _: CloudEndpoint(a), fingerprint) as cloud:
            session = cloud.session(SamplingParams())
            verdict = await session.verify(prompt, [5, 6], pb.METHOD_BLOCK)
            context = prompt + [5, 6][: verdict.n_accepted] + [verdict.next_token]
            open_sessions.append(len(server.server.servicer.host.store))
            await session._reset()  # what a deadline or a broken connection does to the stream
            await asyncio.sleep(0.2)
            open_sessions.append(len(server.server.servicer.host.store))  # kept: it could be resumed
            await session.verify(context, [7], pb.METHOD_BLOCK)
            open_sessions.append(len(server.server.servicer.host.store))
            await session.close()
        return open_sessions

    with ServerThread(CloudSettings(), tiny_target) as server:
        assert asyncio.run(scenario(server.address)) == [1, 1, 1]
