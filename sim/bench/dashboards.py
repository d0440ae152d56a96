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
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from common.errors import UsageError
from common.lab.plots import saved_figure
from sim.bench.registry import Verdict
from sim.bench.run_folder import RunFolder
from sim.bench.settings.operations import DashboardBenchSettings
from sim.bench.soak import format_soak, soak
from sim.bench.verdict import Judged
from sim.processes import answers, free_port, wait_ready

CAPTION = ("the dashboard's own PromQL over a recorded soak (Prometheus, scrape {scrape_s:g} s): "
           "a plot, not a Grafana render")

LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
COLUMNS = 2
MOST_LINES = 8  # a panel's legend beyond this says how many more series it draws
# Grafana unit -> (divisor, axis label) so that the axis reads as the panel would.
UNITS = {"percentunit": (0.01, "%"), "s": (1e-3, "ms"), "ms": (1.0, "ms"), "bytes": (2**20, "MiB"),
         "reqps": (1.0, "req/s"), "ops": (1.0, "/s"), "short": (1.0, "")}


@dataclass(frozen=True)
class PanelQuery:
    ref_id: str
    expr: str  # as the dashboard has it, variables and all
    legend: str  # Grafana's legendFormat ("{{instance}}"); empty: the series' labels


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    section: str  # the row the panel sits under
    queries: tuple[PanelQuery, ...]


@dataclass
class Series:
    name: str  # the legend Grafana would show
    times: list[float]  # unix seconds
    values: list[float]  # NaN, +Inf and -Inf as Prometheus gives them


@dataclass
class PanelResult:
    title: str
    unit: str
    section: str
    series: list[Series] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # per query, what Prometheus refused


def dashboard_panels(dashboard: dict[str, Any]) -> list[Panel]:
    """The graph panels, in the dashboard's order, under the title of the row above each."""
    panels, section = [], ""
    for panel in sorted(dashboard["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"])):
        if panel["type"] == "row":
            section = panel["title"]
            continue
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        queries = tuple(PanelQuery(t["refId"], t["expr"], t.get("legendFormat", "")) for t in panel.get("targets", []))
        panels.append(Panel(panel["title"], unit, section, queries))
    return panels


def load_dashboard(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def grafana_rate_interval(scrape_s: float, step_s: float) -> float:
    """Grafana's $__rate_interval: the larger of four scrape intervals and a step plus a scrape interval."""
    return max(4 * scrape_s, step_s + scrape_s)


def filled(expr: str, rate_interval_s: float, step_s: float) -> str:
    """Grafana's variables as the default view has them: every instance (`All` is `.*`), its intervals."""
    expr = expr.replace("$__rate_interval", f"{rate_interval_s:g}s").replace("$__interval", f"{step_s:g}s")
    expr = expr.replace("$__range", f"{rate_interval_s:g}s")
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def legend(template: str, labels: dict[str, str]) -> str:
    if not template:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), template)


def range_series(query: PanelQuery, result: list[dict[str, Any]]) -> list[Series]:
    """A query_range answer's matrix as named series."""
    return [Series(legend(query.legend, item["metric"]), [float(t) for t, _ in item["values"]],
                   [float(v) for _, v in item["values"]]) for item in result]


def query_range(base_url: str, expr: str, start: float, end: float, step_s: float, timeout_s: float = 30) -> dict:
    """Prometheus's JSON answer to one range query (its `status`, `data` or `error`)."""
    body = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"})
    request = urllib.request.Request(f"{base_url}/api/v1/query_range", data=body.encode(),
                                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:  # a bad query: Prometheus says why in the body
        return json.loads(error.read())


def evaluate_panels(panels: list[Panel], base_url: str, start: float, end: float, scrape_s: float,
                    step_s: float) -> list[PanelResult]:
    """Every panel's queries over [start, end], as Grafana would ask them."""
    rate_interval_s = grafana_rate_interval(scrape_s, step_s)
    results = []
    for panel in panels:
        result = PanelResult(panel.title, panel.unit, panel.section)
        for query in panel.queries:
            answer = query_range(base_url, filled(query.expr, rate_interval_s, step_s), start, end, step_s)
            if answer.get("status") != "success":
                result.errors.append(f"{query.ref_id}: {answer.get('error', answer)}")
                continue
            result.series.extend(range_series(query, answer["data"]["result"]))
        results.append(result)
    return results



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
        log_path = data / "prometheus.log"
        wait_ready(lambda: answers(f"{base_url}/-/ready"), process, 60, 0.2,
                   lambda code: f"prometheus exited ({code}): see {log_path}",
                   f"prometheus was not ready after 60 s: see {log_path}")
        yield base_url
    finally:
        process.terminate()
        process.wait(timeout=30)


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


def plot_dashboard(title: str, results: list[PanelResult], start: float, end: float, out: Path, caption: str) -> Path:
    """One PNG: every panel of `results` over [start, end], x in seconds from `start`."""
    rows = max(1, math.ceil(len(results) / COLUMNS))
    out.parent.mkdir(parents=True, exist_ok=True)
    with saved_figure(out, rows, COLUMNS, dpi=80, rect=(0, 0, 1, 1 - 0.5 / rows / 2.6), figsize=(13, 2.6 * rows),
                      squeeze=False) as (figure, axes):
        for ax, result in zip(axes.flat, results):
            _draw_panel(ax, result, start)
            ax.set_xlim(0, end - start)
            ax.set_xlabel("s into the recording", fontsize=7)
        for ax in list(axes.flat)[len(results):]:
            ax.set_visible(False)
        figure.suptitle(f"{title}\n{caption}", fontsize=11)
    return out


def _draw_panel(ax, result: PanelResult, start: float) -> None:
    divisor, label = UNITS.get(result.unit, (1.0, result.unit))
    drawn = [s for s in result.series if any(math.isfinite(v) for v in s.values)]
    for series in drawn[:MOST_LINES]:
        ax.plot([t - start for t in series.times], [v / divisor for v in series.values], label=series.name, lw=1.2)
    ax.set_title(f"{result.section}: {result.title}" if result.section else result.title, fontsize=9)
    ax.set_ylabel(label, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if not drawn:
        why = "query error" if result.errors else "no data"
        ax.text(0.5, 0.5, why, transform=ax.transAxes, ha="center", va="center", color="grey")
    elif any(s.name for s in drawn):
        more = len(drawn) - MOST_LINES
        ax.legend(fontsize=6, loc="upper left", title=f"+{more} more" if more > 0 else None, title_fontsize=6)
