"""OpenTelemetry request traces (common/tracing.py): off, nothing is imported; on, a real edge daemon and real cloud
replicas (processes, `--otlp-traces-endpoint`) send one trace per request to an in-process OTLP collector, whose span
tree is checked: the API request, drafting, each verify with the cloud's queue wait, forward and rule, and a
failover's spans on two replicas."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from sim.processes import CloudProcess, edge_daemon_process, free_port, start_side_by_side

# The collector serves opentelemetry-proto's OTLP stubs: the `otel` extra, which `make setup` installs.
pytest.importorskip("opentelemetry.proto.collector.trace.v1", reason="the otel extra is not installed: pip install -e '.[otel]'")
from otlp_collector import OtlpCollector, ReceivedSpan  # noqa: E402 -- after the skip

ROOT = Path(__file__).resolve().parents[2]
# Spans go out 50 ms after they end (the SDK's default is 5 s): a replica killed mid-request has sent its verifies.
EXPORT_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "50", "OMP_NUM_THREADS": "1"}
OFF_PROBE = """
import sys
from common.tracing import NO_SPAN, tracer, enable_from_flag
import common.cli
common.cli.build_parser()
enable_from_flag(None, "sprinter-edge", "edge")
metadata = (("authorization", "Bearer x"),)
with tracer.span("edge.request", n=1) as span:
    span.set(status=200)
print(tracer.span("x") is NO_SPAN and tracer.start("y") is NO_SPAN and tracer.metadata(metadata) is metadata,
      sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""


def test_tracing_off_imports_nothing_and_every_span_is_the_shared_no_op() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "proto"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", OFF_PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "[]"]


def _cloud(tmp_path: Path, name: str, collector: OtlpCollector, *extra: str) -> CloudProcess:
    return CloudProcess("--target", "tiny-random", "--dtype", "float32", "--drain-s", "1",
                        "--otlp-traces-endpoint", collector.endpoint, *extra, log_path=tmp_path / f"{name}.log",
                        startup_timeout_s=180, env=EXPORT_ENV)


def _edge_args(clouds: str, collector: OtlpCollector) -> list[str]:
    return ["--draft", "tiny-random-draft", "--draft-runtime", "torch", "--dtype", "float32", "--verifier",
            "confidence:0.3", "--cloud", clouds, "--otlp-traces-endpoint", collector.endpoint]


def _complete(base: str, max_tokens: int, k: int) -> dict:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "mode": "sd",
            "k": k}
    response = httpx.post(base + "/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["sprinter"]


def _named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def _request_done(spans: list[ReceivedSpan]) -> bool:
    """The request's span and every cloud stream's span have come (the edge closes its session at the end)."""
    return bool(_named(spans, "edge.request")) and bool(_named(spans, "cloud.session"))


def _check_tree(spans: list[ReceivedSpan], killed: str = "") -> dict[str, ReceivedSpan]:
    """One trace, rooted at the API request, every other span under a parent in it; returns spans by id. The
    spans of a `killed` instance are in the trace, but its stream's span never ended, so it never came: they are
    left out of the tree."""
    assert len({s.trace_id for s in spans}) == 1, "one request, one trace"
    spans = [s for s in spans if s.instance != killed or not killed]
    by_id = {s.span_id: s for s in spans}
    roots = [s for s in spans if not s.parent_id]
    assert [(r.name, r.service) for r in roots] == [("edge.request", "sprinter-edge")]
    assert all(s.parent_id in by_id for s in spans if s.parent_id), "every parent was exported"

    def parent(span: ReceivedSpan) -> ReceivedSpan:
        return by_id[span.parent_id]

    def under(span: ReceivedSpan, name: str) -> bool:
        while span.parent_id:
            span = parent(span)
            if span.name == name:
                return True
        return False

    assert [parent(s).name for s in _named(spans, "edge.generate")] == ["edge.request"]
    for name in ("edge.draft", "edge.verify", "edge.open"):
        assert _named(spans, name) and all(under(s, "edge.generate") for s in _named(spans, name)), name
    assert all(parent(s).name == "edge.verify" for s in _named(spans, "edge.attempt"))
    for session in _named(spans, "cloud.session"):
        assert session.service == "sprinter-cloud" and parent(session).service == "sprinter-edge"
    for name in ("cloud.open", "cloud.verify"):
        assert _named(spans, name) and all(parent(s).name == "cloud.session" for s in _named(spans, name)), name
    for name in ("cloud.queue", "cloud.forward", "cloud.rule"):
        assert _named(spans, name) and all(parent(s).name == "cloud.verify" for s in _named(spans, name)), name
    return by_id


@pytest.mark.slow
def test_one_request_is_one_trace_across_the_edge_and_the_cloud(tmp_path: Path) -> None:
    with OtlpCollector() as collector, _cloud(tmp_path, "cloud", collector) as cloud, \
            edge_daemon_process(_edge_args(cloud.address, collector), free_port(), tmp_path / "edge.log",
                                timeout_s=300, env=EXPORT_ENV) as edge:
        result = _complete(edge.base, 24, 3)
        spans = collector.wait_for(_request_done)
    assert not result["degraded"]
    _check_tree(spans)
    request = _named(spans, "edge.request")[0]
    assert request.attributes["status"] == 200 and request.attributes["n"] == 1
    verifies = _named(spans, "cloud.verify")
    assert {s.instance for s in verifies} == {f"cloud-{cloud.port}"}
    assert sum(s.attributes["n_accepted"] for s in _named(spans, "edge.verify")) <= 24
    assert all(s.attributes["method"] for s in _named(spans, "cloud.rule"))


@pytest.mark.slow
def test_a_failover_is_one_trace_with_spans_on_two_replicas(tmp_path: Path) -> None:
    with OtlpCollector() as collector:
        # a 20 ms batch window per verify: the generation runs long enough for the kill to land mid-request
        clouds = {name: _cloud(tmp_path, name, collector, "--batch-window-ms", "20") for name in "ab"}
        start_side_by_side(*clouds.values())
        by_instance = {f"cloud-{c.port}": c for c in clouds.values()}
        try:
            addresses = ",".join(c.address for c in clouds.values())
            with edge_daemon_process(_edge_args(addresses, collector), free_port(), tmp_path / "edge.log",
                                     timeout_s=300, env=EXPORT_ENV) as edge:
                outcome: dict = {}
                request = threading.Thread(target=lambda: outcome.update(_complete(edge.base, 120, 2)))
                request.start()
                first = collector.wait_for(lambda spans: bool(_named(spans, "cloud.verify")))
                victim = by_instance[_named(first, "cloud.verify")[0].instance]
                victim.kill()  # SIGKILL: its stream breaks mid-request, and the session moves
                request.join(300)
                spans = collector.wait_for(lambda s: _request_done(s) and len({v.instance for v in
                                                                             _named(s, "cloud.verify")}) == 2)
        finally:
            for cloud in clouds.values():
                cloud.kill()
    assert outcome and not outcome["degraded"], outcome
    by_id = _check_tree(spans, killed=f"cloud-{victim.port}")
    survivor = next(c for c in clouds.values() if c is not victim)
    failovers = _named(spans, "edge.failover")
    assert [f.attributes["replica"] for f in failovers] == [victim.address]
    assert failovers[0].attributes["cause"] == "replica_failed"
    reopened = [s for s in _named(spans, "edge.open") if s.attributes["reopen"]]
    assert reopened and reopened[-1].attributes["replica"] == survivor.address
    assert any(s.error for s in _named(spans, "edge.attempt")), "the attempt the kill broke is marked failed"
    sessions = {s.instance: by_id[s.parent_id].name for s in _named(spans, "cloud.session")}
    assert sessions[f"cloud-{survivor.port}"] in ("edge.attempt", "edge.open")  # opened by the retry after the move


@pytest.mark.slow
def test_a_stretch_without_the_cloud_is_a_degraded_span(tmp_path: Path) -> None:
    """No replica listens: every verify fails, and the generation goes on from the draft under `edge.degraded`."""
    with OtlpCollector() as collector, \
            edge_daemon_process(_edge_args(f"127.0.0.1:{free_port()}", collector) + ["--cloud-retry-s", "60"],
                                free_port(), tmp_path / "edge.log", timeout_s=300, env=EXPORT_ENV) as edge:
        result = _complete(edge.base, 12, 3)
        spans = collector.wait_for(lambda s: bool(_named(s, "edge.request")) and bool(_named(s, "edge.degraded")))
    assert result["degraded"] and result["degraded_reason"] == "cloud_unreachable"
    assert len({s.trace_id for s in spans}) == 1 and not [s for s in spans if s.service != "sprinter-edge"]
    by_id = {s.span_id: s for s in spans}
    degraded = _named(spans, "edge.degraded")
    assert [(by_id[d.parent_id].name, d.attributes["reason"]) for d in degraded] == [("edge.generate", "cloud_unreachable")]
    assert all(v.error for v in _named(spans, "edge.verify")), "the verify that gave up is marked failed"
