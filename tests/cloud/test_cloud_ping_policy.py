"""The cloud's ping policy takes effect: a client pinging no faster than the cloud allows keeps a quiet stream.

gRPC ignores a channel option it does not know; under a misspelt name its default (5 minutes between pings while
the server sends nothing) cut off edges pinging every 20 s, with GOAWAY too_many_pings, failing sessions that
waited in a queue (docs/benchmarks/cloud.md, End to end, through edges). Real CloudServer on loopback, the
allowed interval scaled from 10 s down to 0.5 s so that the test takes seconds.
"""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cloud import server as cloud_server
from cloud.server import CloudSettings
from cloud_harness import ServerThread

ALLOWED_MS = 500


def test_pings_spaced_as_the_cloud_allows_keep_a_quiet_stream_open(tiny_target, monkeypatch):
    real = cloud_server.CloudServer._channel_options

    def scaled(self) -> list[tuple[str, int]]:
        options = dict(real(self))
        assert options[cloud_server.MIN_PING_INTERVAL_OPTION] == 10_000
        return list({**options, cloud_server.MIN_PING_INTERVAL_OPTION: ALLOWED_MS}.items())

    monkeypatch.setattr(cloud_server.CloudServer, "_channel_options", scaled)
    # Pings every second, twice the allowed interval, and without the client's own cap on pings without data
    # (an edge sending requests lifts it as it goes): under gRPC's default the third ping would end the stream.
    client_options = [("grpc.keepalive_time_ms", 2 * ALLOWED_MS), ("grpc.keepalive_timeout_ms", 5_000),
                      ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
    with ServerThread(CloudSettings(batch_window_ms=1), tiny_target) as server, \
            grpc.insecure_channel(server.address, options=client_options) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING  # then the server says nothing
        time.sleep(12 * ALLOWED_MS / 1000)  # about 6 pings
        assert not watch.done(), f"the quiet stream ended: {watch.code()} {watch.details()}"
        watch.cancel()
