"""A Grafana dashboard's panels as PromQL range queries: which queries each panel runs (with Grafana's variables
filled in as an operator's default view would have them), evaluated by a Prometheus server's HTTP API
(`/api/v1/query_range`), and the series named by the panel's legend format."""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


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
