"""`sprinter bench dashboards`: pictures of the Grafana dashboards (deploy/grafana/dashboards/) over a recorded soak.

Starts a real Prometheus server (Debian's `prometheus`) that scrapes the soak's cloud (`--metrics-port`) and edge
(`/metrics`) every SCRAPE_S seconds, runs `bench soak` with the options below, then evaluates every panel's own PromQL
over the recording through Prometheus's HTTP API (`/api/v1/query_range`, Grafana's variables filled as its default
view has them: every instance, $__rate_interval = max(4 x scrape, step + scrape)) and draws each dashboard as a grid of
panels with matplotlib. These are plots of the dashboards' queries, not Grafana renders (Grafana does not run here).
Prints the soak's table and a table of the panels; writes OUT/results.json (every series of every panel),
dashboard-<name>.png (in OUT, or --images) and the soak's own files in OUT/soak/. It exits 1 when a query fails.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from common.errors import UsageError
from sim.bench.dashboard_plots import UNITS, plot_dashboard
from sim.bench.dashboard_queries import (PanelResult, dashboard_panels, evaluate_panels, load_dashboard,
                                         query_range)
from sim.bench.registry import Verdict
from sim.bench.run_folder import RunFolder
from sim.bench.settings.operations import DashboardBenchSettings
from sim.bench.soak import format_soak, soak
from sim.bench.verdict import Judged
from sim.processes import free_port

CAPTION = ("the dashboard's own PromQL over a recorded soak (Prometheus, scrape {scrape_s:g} s): "
           "a plot, not a Grafana render")


@dataclass
class DashboardResult:
    dashboard: str
    title: str
    start: float  # unix seconds: the first scrape that found a target up
    end: float
    image: str
    panels: list[PanelResult]


def bench_dashboards(settings: DashboardBenchSettings) -> Verdict:
    load, results = record_and_plot(settings)
    images = "images: " + ", ".join(r.image for r in results)
    return Verdict(f"{format_soak(load, settings.soak)}\n\n{format_dashboards(results)}\n\n{images}",
                   all(not p.errors for r in results for p in r.panels))


def record_and_plot(settings: DashboardBenchSettings) -> tuple[Judged, list[DashboardResult]]:
    """Record the soak with Prometheus, then evaluate and draw every dashboard."""
    settings.soak.out.mkdir(parents=True, exist_ok=True)
    for stale in settings.soak.out.glob("scrape-targets-*.json"):
        stale.unlink()
    with prometheus_server(settings) as base_url:
        load = soak(settings.soak)
        start, end = recorded_window(base_url, settings)
        results = [_dashboard_result(path, base_url, start, end, settings)
                   for path in sorted(settings.dashboards.glob("*.json"))]
    RunFolder(settings.out).write_results(settings, dashboards=results)
    return load, results


def _dashboard_result(path: Path, base_url: str, start: float, end: float,
                      settings: DashboardBenchSettings) -> DashboardResult:
    dashboard = load_dashboard(path)
    panels = evaluate_panels(dashboard_panels(dashboard), base_url, start, end, settings.scrape_s, settings.step_s)
    image_path = (settings.images or settings.out) / f"dashboard-{path.stem}.png"
    image = plot_dashboard(dashboard["title"], panels, start, end, image_path,
                           CAPTION.format(scrape_s=settings.scrape_s))
    return DashboardResult(path.name, dashboard["title"], start, end, str(image), panels)


def prometheus_config(scrape_s: float, targets_dir: Path) -> dict:
    """Two jobs, named as deploy/compose/prometheus.yml names them, whose targets the soak writes when it is up."""
    def job(name: str, side: str) -> dict:
        return {"job_name": name, "file_sd_configs": [{"files": [str(targets_dir / f"scrape-targets-{side}.json")],
                                                        "refresh_interval": f"{scrape_s:g}s"}]}
    return {"global": {"scrape_interval": f"{scrape_s:g}s", "scrape_timeout": f"{scrape_s:g}s"},
            "scrape_configs": [job("sprinter-cloud", "cloud"), job("sprinter-edge", "edge")]}


@contextmanager
def prometheus_server(settings: DashboardBenchSettings) -> Iterator[str]:
    """A Prometheus server on a free loopback port, its data in OUT/prometheus/ (fresh each run); its base URL."""
    binary = shutil.which(settings.prometheus)
    if binary is None:
        raise UsageError(f"--prometheus: {settings.prometheus!r} is not installed (Debian's prometheus package)")
    data = settings.out / "prometheus"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    config = data / "prometheus.yml"
    config.write_text(json.dumps(prometheus_config(settings.scrape_s, settings.soak.out.resolve()), indent=1))
    port = free_port()
    with open(data / "prometheus.log", "w") as log_file:
        process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={data / 'tsdb'}",
                                    f"--web.listen-address=127.0.0.1:{port}"],
                                   stdout=log_file, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base_url, process, data / "prometheus.log")
        yield base_url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _wait_ready(base_url: str, process: subprocess.Popen, log_path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited ({process.returncode}): see {log_path}")
        try:
            with urllib.request.urlopen(f"{base_url}/-/ready", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"prometheus was not ready after {timeout_s:.0f} s: see {log_path}")


def recorded_window(base_url: str, settings: DashboardBenchSettings) -> tuple[float, float]:
    """From the first scrape that found a cloud up to the last: the soak, without the model loading before it."""
    now = time.time()
    answer = query_range(base_url, 'max(up{job="sprinter-cloud"}) == 1', now - 3600, now, settings.scrape_s)
    times = [float(t) for item in answer["data"]["result"] for t, _ in item["values"]]
    if not times:
        raise RuntimeError("Prometheus never scraped the cloud: see OUT/prometheus/prometheus.log")
    return min(times), max(times)


def format_dashboards(results: list[DashboardResult]) -> str:
    """One line a panel: its series, points and the largest value it reached, in the panel's unit."""
    lines = [f"{'dashboard':<15} {'panel':<44} {'series':>6} {'points':>6} {'peak':>12}  note"]
    for result in results:
        lines.append(f"{result.title}: {result.end - result.start:.0f} s recorded, {len(result.panels)} panels")
        for panel in result.panels:
            values = [v for s in panel.series for v in s.values if v == v and abs(v) != float("inf")]
            divisor, unit = UNITS.get(panel.unit, (1.0, panel.unit))
            peak = f"{max(values) / divisor:.3g} {unit}".strip() if values else "-"
            note = "; ".join(panel.errors) or ("no data" if not values else "")
            lines.append(f"{Path(result.dashboard).stem:<15} {panel.title[:44]:<44} {len(panel.series):>6} "
                         f"{sum(len(s.values) for s in panel.series):>6} {peak:>12}  {note}")
    return "\n".join(lines)
