"""`sprinter bench dashboards` (sim/bench/dashboards.py): the Grafana dashboards' panels become range queries with
Grafana's variables filled in, Prometheus's answers become named series, and each dashboard is drawn as a PNG. The
light tests use a loopback HTTP server that answers like Prometheus's query_range; the end-to-end one starts a real
Prometheus (Debian's `prometheus`) scraping a real cloud metrics registry for a few seconds."""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from sim.bench.dashboards import (DashboardResult, PanelQuery, dashboard_panels, evaluate_panels, filled,
                                  format_dashboards, grafana_rate_interval, legend, load_dashboard, plot_dashboard,
                                  prometheus_server, range_series, recorded_window)
from sim.bench.settings.operations import DashboardBenchSettings
from sim.bench.soak import write_scrape_targets
from tests.deploy.test_deploy import missing

pytest.importorskip("matplotlib")
DASHBOARDS = sorted((Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "dashboards").glob("*.json"))
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_graph_panel_and_query_is_extracted_in_order(path: Path) -> None:
    dashboard = load_dashboard(path)
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    panels = dashboard_panels(dashboard)
    in_order = sorted(graphs, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    assert [p.title for p in panels] == [p["title"] for p in in_order]
    assert sum(len(p.queries) for p in panels) == sum(len(p["targets"]) for p in graphs)
    assert all(p.section for p in panels), "every panel sits under a row"
    for panel in panels:
        for query in panel.queries:
            assert "$" not in filled(query.expr, 4, 2), query.expr


def test_grafana_variables_and_legends() -> None:
    assert grafana_rate_interval(scrape_s=1, step_s=2) == 4 and grafana_rate_interval(scrape_s=1, step_s=10) == 11
    expr = 'sum by (instance) (rate(x_total{job="j", instance=~"$instance"}[$__rate_interval]))'
    assert filled(expr, 4, 2) == 'sum by (instance) (rate(x_total{job="j", instance=~".*"}[4s]))'
    assert legend("{{mode}} position > {{ le }}", {"mode": "sd", "le": "2.0"}) == "sd position > 2.0"
    assert legend("", {"b": "2", "a": "1"}) == '{a="1", b="2"}'


class FakePrometheus(BaseHTTPRequestHandler):
    """Answers /api/v1/query_range with one series a query (a ramp), or an error for a query with `bad`."""
    asked: list[dict[str, list[str]]] = []

    def do_POST(self) -> None:
        form = parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
        FakePrometheus.asked.append(form)
        start, end, step = (float(form[k][0]) for k in ("start", "end", "step"))
        values = [[start + i * step, str(i / 10)] for i in range(int((end - start) / step) + 1)]
        if "bad" in form["query"][0]:
            body, code = {"status": "error", "errorType": "bad_data", "error": "parse error"}, 400
        else:
            body, code = {"status": "success", "data": {"resultType": "matrix", "result": [
                {"metric": {"instance": "cloud-a:9100", "method": "block", "le": "1.0"}, "values": values}]}}, 200
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_prometheus() -> str:
    FakePrometheus.asked = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakePrometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_panels_evaluate_and_plot_from_a_fake_range_result(fake_prometheus: str, tmp_path: Path) -> None:
    path = DASHBOARDS[0]
    panels = dashboard_panels(load_dashboard(path))
    results = evaluate_panels(panels, fake_prometheus, start=1000.0, end=1060.0, scrape_s=1, step_s=2)
    assert len(FakePrometheus.asked) == sum(len(p.queries) for p in panels)
    assert all(form["step"] == ["2"] and "[4s]" in form["query"][0] and "$" not in form["query"][0]
               for form in FakePrometheus.asked if "[" in form["query"][0])
    first = results[0]
    assert [s.name for s in first.series][:1] == [panels[0].queries[0].legend.replace("{{instance}}", "cloud-a:9100")]
    assert len(first.series[0].values) == 31 and first.series[0].values[-1] == pytest.approx(3.0)
    image = plot_dashboard("cloud", results[:4], 1000.0, 1060.0, tmp_path / "cloud.png", "a test")  # 4: drawing is slow
    assert image.read_bytes()[:8] == PNG and image.stat().st_size > 10_000
    table = format_dashboards([DashboardResult(path.name, "cloud", 1000.0, 1060.0, str(image), results)])
    assert len(table.splitlines()) == 2 + len(panels) and "60 s recorded" in table


def test_a_refused_query_is_reported_not_drawn(fake_prometheus: str, tmp_path: Path) -> None:
    panels = dashboard_panels({"panels": [
        {"type": "row", "title": "R", "gridPos": {"x": 0, "y": 0}},
        {"type": "timeseries", "title": "P", "gridPos": {"x": 0, "y": 1}, "fieldConfig": {"defaults": {"unit": "s"}},
         "targets": [{"refId": "A", "expr": "bad(", "legendFormat": "x"}]}]})
    [result] = evaluate_panels(panels, fake_prometheus, 0.0, 10.0, 1, 2)
    assert result.series == [] and result.errors == ["A: parse error"]
    plot_dashboard("d", [result], 0.0, 10.0, tmp_path / "d.png", "")
    assert "A: parse error" in format_dashboards([DashboardResult("d.json", "d", 0.0, 10.0, "", [result])])
    assert range_series(PanelQuery("A", "x", ""), [{"metric": {}, "values": [[1, "NaN"]]}])[0].values[0] != 0


def _scraped_s(base_url: str, settings: DashboardBenchSettings) -> float:
    try:
        start, end = recorded_window(base_url, settings)
    except RuntimeError:  # not scraped yet
        return 0.0
    return end - start


def test_a_real_prometheus_scrapes_a_cloud_registry_and_the_panels_show_it(tmp_path: Path) -> None:
    if shutil.which("prometheus") is None:
        missing("the prometheus server is not installed (Debian's prometheus package: make test installs it)")
    from prometheus_client import start_http_server

    from cloud.metrics import CloudMetrics

    metrics = CloudMetrics()
    server, _ = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    settings = DashboardBenchSettings(scrape_s=1.0, step_s=1.0, out=tmp_path)  # its soak's folder: OUT/soak
    settings.soak.out.mkdir()
    write_scrape_targets(settings.soak.out, [f"127.0.0.1:{server.server_address[1]}"], [])
    try:
        with prometheus_server(settings) as base_url:
            # 10 verify calls/s of 3 accepted tokens each, until 5 s of scrapes (Prometheus applies new targets
            # in up to 5 s)
            deadline = time.monotonic() + 25
            while time.monotonic() < deadline and _scraped_s(base_url, settings) < 5:
                for _ in range(10):
                    metrics.verify_calls.labels(method="block").inc()
                    metrics.tokens_accepted.inc(3)
                    time.sleep(0.1)
            start, end = recorded_window(base_url, settings)
            cloud = [p for p in DASHBOARDS if p.name == "sprinter-cloud.json"][0]
            results = evaluate_panels(dashboard_panels(load_dashboard(cloud)), base_url, start, end, 1.0, 1.0)
    finally:
        server.shutdown()
    assert end - start >= 3
    by_title = {r.title: r for r in results}
    assert not [r.errors for r in results if r.errors]
    calls = [v for s in by_title["Verify calls/s by method"].series for v in s.values if math.isfinite(v)]
    assert calls and max(calls) == pytest.approx(10, rel=0.35)
    tokens = [v for s in by_title["Tokens/s per replica"].series if s.name.startswith("verify") for v in s.values]
    assert max(tokens) == pytest.approx(40, rel=0.35)  # accepted + one per call
    up = by_title["Replicas up"].series[0]
    assert up.name == "up" and up.values[-1] == 1
