"""The OpenTelemetry backend of common/tracing.py: the SDK's tracer provider, a batch span processor and the OTLP
gRPC exporter. Imported only by `Tracer.enable`, so a process without `--otlp-traces-endpoint` never loads it.

The provider is this process's own (not the global one): a library in the same process that sets up
OpenTelemetry for itself neither receives our spans nor changes where they go.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator


def _attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """OpenTelemetry takes str, bool, int, float (or lists of one): None is dropped, anything else named."""
    return {key: value if isinstance(value, (str, bool, int, float)) else str(value)
            for key, value in attributes.items() if value is not None}


class _Handle:
    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def set(self, **attributes: Any) -> None:
        self.span.set_attributes(_attributes(attributes))

    def end(self) -> None:
        self.span.end()


class OtelBackend:
    def __init__(self, endpoint: str, service: str, instance: str) -> None:
        resource = Resource.create({"service.name": service, "service.instance.id": instance})
        self.provider = TracerProvider(resource=resource)
        # The exporter reads the scheme: http:// is a plaintext channel, https:// TLS. Batching keeps the export
        # off the request's path (OTEL_BSP_SCHEDULE_DELAY and friends tune it, as the SDK documents).
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("sprinter")
        self.propagator = TraceContextTextMapPropagator()

    @contextmanager
    def span(self, name: str, attributes: dict[str, Any],
             remote: Iterable[tuple[str, Any]] | None) -> Iterator[_Handle]:
        parent = None if remote is None else self.propagator.extract({key: value for key, value in remote})
        with self.tracer.start_as_current_span(name, context=parent, attributes=_attributes(attributes)) as span:
            yield _Handle(span)

    def start(self, name: str, attributes: dict[str, Any]) -> _Handle:
        return _Handle(self.tracer.start_span(name, attributes=_attributes(attributes)))

    def carrier(self) -> list[tuple[str, str]]:
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier)
        return list(carrier.items())

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes the batch processor first
