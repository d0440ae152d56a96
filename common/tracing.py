"""Request traces, opt-in (`--otlp-traces-endpoint URL` on `edge serve` and `cloud serve`).

Call sites write `with tracer.span("edge.verify", mode=...)`; a stretch that no single block holds (a
degraded one) takes `tracer.start(...)` and `.end()`. Until `enable` is called the tracer is a no-op:
nothing of OpenTelemetry is imported and a span costs one attribute test and a shared object, so a
daemon without the flag pays nothing measurable. `enable` loads common/otel_tracing.py (the
OpenTelemetry SDK, its batch processor and OTLP gRPC exporter) lazily.

Across the link the context travels in the gRPC metadata of each Session call (W3C `traceparent`):
the edge adds it with `tracer.metadata(...)` when it starts a call, and the cloud's spans for that
call take it as their parent with `tracer.span(..., remote=context.invocation_metadata())`, so one
request is one trace over the edge and every replica it touched.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence

Metadata = Sequence[tuple[str, str]]


class SpanHandle(Protocol):
    def set(self, **attributes: Any) -> None:
        """Attributes learned while the span runs (a verdict's n_accepted, a failure's cause)."""

    def end(self) -> None:
        """Close a span opened with `Tracer.start` (a `with` block closes its own)."""


class _NoSpan:
    """The one object every span is while tracing is off: a context manager and a handle that do nothing."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set(self, **attributes: Any) -> None:
        return None

    def end(self) -> None:
        return None


NO_SPAN = _NoSpan()


class Backend(Protocol):
    def span(self, name: str, attributes: dict[str, Any], remote: Iterable[tuple[str, Any]] | None) -> Any: ...

    def start(self, name: str, attributes: dict[str, Any]) -> SpanHandle: ...

    def carrier(self) -> list[tuple[str, str]]: ...

    def shutdown(self) -> None: ...


class Tracer:
    """The process's tracer: a no-op until `enable` gives it an OpenTelemetry backend."""

    def __init__(self) -> None:
        self._backend: Backend | None = None

    @property
    def enabled(self) -> bool:
        return self._backend is not None

    def span(self, name: str, remote: Iterable[tuple[str, Any]] | None = None, **attributes: Any) -> Any:
        """A span around a `with` block, child of the current one (or, with `remote`, of the context in that gRPC
        metadata); it yields a `SpanHandle` and records an exception that leaves the block."""
        if self._backend is None:
            return NO_SPAN
        return self._backend.span(name, attributes, remote)

    def start(self, name: str, **attributes: Any) -> SpanHandle:
        """A span that runs until its `.end()`, child of the current one, not made current itself."""
        if self._backend is None:
            return NO_SPAN
        return self._backend.start(name, attributes)

    def metadata(self, metadata: Metadata | None) -> Metadata | None:
        """`metadata` with the current trace context added (unchanged while off)."""
        if self._backend is None:
            return metadata
        return tuple(metadata or ()) + tuple(self._backend.carrier())

    def enable(self, endpoint: str, service: str, instance: str) -> None:
        """Export spans to the OTLP gRPC collector at `endpoint` (e.g. http://127.0.0.1:4317), as `service`
        (sprinter-edge, sprinter-cloud) and `instance` (a replica's or an edge's id)."""
        from common.otel_tracing import OtelBackend  # here, not above: off costs no import

        self._backend = OtelBackend(endpoint, service, instance)

    def shutdown(self) -> None:
        """Export what is buffered, then stop (a process's clean exit)."""
        if self._backend is not None:
            self._backend.shutdown()
            self._backend = None


tracer = Tracer()


def enable_from_flag(endpoint: str | None, service: str, instance: str) -> None:
    """`--otlp-traces-endpoint`: enable tracing when it is given, and do nothing (import nothing) when not."""
    if endpoint:
        tracer.enable(endpoint, service, instance)


def add_tracing_argument(parser: Any) -> None:
    parser.add_argument("--otlp-traces-endpoint", metavar="URL",
                        help="export OpenTelemetry traces to this OTLP gRPC collector (e.g. http://127.0.0.1:4317); "
                             "off by default, and then nothing of OpenTelemetry is loaded")
