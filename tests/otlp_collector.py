"""An OTLP trace collector in the test's process: the OTLP gRPC TraceService (opentelemetry-proto's stubs) on a free
loopback port, keeping every span it is sent, flattened, for a test to read the span tree from."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    service: str  # resource attribute service.name
    instance: str  # resource attribute service.instance.id
    attributes: dict[str, Any] = field(default_factory=dict)
    error: bool = False


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: OtlpCollector) -> None:
        self.collector = collector

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(span.name, span.trace_id.hex(), span.span_id.hex(),
                                                 span.parent_span_id.hex(), resource.get("service.name", ""),
                                                 resource.get("service.instance.id", ""), _attributes(span.attributes),
                                                 span.status.code == span.status.STATUS_CODE_ERROR))
        with self.collector.lock:
            self.collector.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpCollector:
    """`with OtlpCollector() as collector:` then `--otlp-traces-endpoint collector.endpoint`."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpCollector:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(None)

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, condition: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The spans once `condition` holds of them (the exporters batch: spans come a little after they end)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if condition(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"the collector never saw what was waited for; it has {names}")
            time.sleep(0.05)
