"""deploy/'s monitoring, checked offline (no image is run): the Grafana dashboards' every PromQL query names series that
the edge's or the cloud's Prometheus registry really exports, with labels those series have; the compose file's
Prometheus scrapes every service that serves metrics, and passes Prometheus's own checker (`promtool check config`);
Grafana's provisioning points at those dashboards and the datasource they name."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

from sim.reference_pages import side_metrics
from tests.deploy.test_deploy import COMPOSE, compose, compose_command_lines, missing, parse

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
PROMETHEUS = COMPOSE.parent / "prometheus.yml"
# Labels Prometheus adds to every series it scrapes (the target's), and `up`, the series it makes for each target.
TARGET_LABELS = {"job", "instance"}
SYNTHETIC = {"up": TARGET_LABELS}
SERIES = re.compile(r"\b([a-zA-Z_:][\w:]*)\s*(\{[^}]*\})?")
MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"")
LABEL_VALUES = re.compile(r"label_values\((.*),\s*(\w+)\s*\)")  # a template variable: the label whose values it lists
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
# What a query's words may be besides series: PromQL's functions, aggregations and keywords, and Grafana's variables.
PROMQL_WORDS = {"sum", "avg", "min", "max", "count", "rate", "increase", "irate", "histogram_quantile", "by", "without",
                "on", "ignoring", "group_left", "group_right", "label_values", "and", "or", "unless", "offset", "bool",
                "topk", "bottomk", "delta", "deriv", "abs", "clamp_min", "clamp_max", "vector", "scalar", "time"}


@cache
def exported() -> dict[str, set[str]]:
    """Every series name the two registries export (a counter's _total, a histogram's _bucket/_sum/_count) and the
    labels it carries, the target's labels included; `up` too."""
    series: dict[str, set[str]] = {name: set(labels) for name, labels in SYNTHETIC.items()}
    for metrics in side_metrics().values():
        for metric in metrics:
            labels = set(metric.labels) | TARGET_LABELS
            if metric.kind == "histogram":
                series[metric.name + "_bucket"] = labels | {"le"}
                series[metric.name + "_sum"] = series[metric.name + "_count"] = labels
            else:
                series[metric.name] = labels
    return series


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and template variable."""
    queries = [(f"{panel['title']} {target['refId']}", target["expr"])
               for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        queries.append((f"${variable['name']}", query))
    return queries


def query_series(query: str) -> list[tuple[str, set[str]]]:
    """The series a query selects and the labels its matchers name (strings and grouping clauses left out)."""
    bare = GROUPING.sub(" ", re.sub(r"\[[^\]]*\]", " ", query))
    found = []
    for name, selector in SERIES.findall(re.sub(r'"[^"]*"', '""', bare)):
        if name in PROMQL_WORDS or name.startswith("__") or re.fullmatch(r"[\d.e]+", name):
            continue
        found.append((name, set(MATCHER.findall(selector or ""))))
    return found


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_dashboard_query_names_real_series_with_real_labels(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    series = exported()
    queries = dashboard_queries(dashboard)
    assert len(queries) > 10
    for where, query in queries:
        listed = LABEL_VALUES.fullmatch(query.strip())
        query, asked = (listed.group(1), {listed.group(2)}) if listed else (query, set())
        selected = query_series(query)
        assert selected, f"{where}: no series in {query!r}"
        for name, labels in selected:
            # matchers name labels the series has
            assert name in series, f"{where}: {name} is not exported by the edge or the cloud ({query!r})"
            assert labels <= series[name], f"{where}: {name} has no label {labels - series[name]}"
        # grouping labels (by, on, ...) are labels of some series the query reads
        grouped = asked | {label.strip() for clause in GROUPING.findall(query) for label in clause.split(",") if label.strip()}
        assert grouped <= set().union(*(series[name] for name, _ in selected)), f"{where}: {query!r}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboards_are_importable_and_use_the_provisioned_datasource(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    source = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    uid = source["datasources"][0]["uid"]
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == uid and panel["description"], panel["title"]
            assert all(target["datasource"]["uid"] == uid for target in panel["targets"])
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    wanted = {"sprinter-cloud.json": ["tokens/s", "acceptance by position", "latency", "queue", "per forward", "kv",
                                      "prefix-cache", "replicas up"],
              "sprinter-edge.json": ["tokens/s by mode", "per target call", "proposer", "acceptance by position",
                                     "degraded", "placement", "edges up", "replicas usable"]}[path.name]
    assert [w for w in wanted if w not in titles] == []


def test_grafana_provisioning_points_at_the_dashboards_compose_mounts() -> None:
    grafana = compose()["services"]["grafana"]
    mounts = {target: (COMPOSE.parent / source).resolve()
              for source, target, *_ in (volume.split(":") for volume in grafana["volumes"]) if source.startswith(".")}
    provisioning = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "sprinter.yaml").read_text())
    path = provisioning["providers"][0]["options"]["path"]
    assert mounts[path] == (GRAFANA / "dashboards").resolve()
    assert mounts["/etc/grafana/provisioning"] == (GRAFANA / "provisioning").resolve()
    source = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())["datasources"][0]
    prometheus = compose()["services"]["prometheus"]
    assert source["url"] == "http://prometheus:9090" and prometheus["healthcheck"]["test"]
    assert grafana["depends_on"] == {"prometheus": {"condition": "service_healthy"}}


def test_prometheus_scrapes_every_service_that_serves_metrics() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: {t for c in job["static_configs"] for t in c["targets"]} for job in config["scrape_configs"]}
    parsed = {line.where.split(": ")[1]: parse(line) for line in compose_command_lines()}
    clouds = {f"{name}:{args.metrics_port}" for name, args in parsed.items() if name.startswith("cloud")}
    edges = {f"{name}:{args.listen.rpartition(':')[2]}" for name, args in parsed.items() if name.startswith("edge")}
    assert len(clouds) == 2 and None not in {args.metrics_port for name, args in parsed.items() if name.startswith("cloud")}
    assert jobs["sprinter-cloud"] == clouds and jobs["sprinter-edge"] == edges
    assert {"prometheus", "grafana"} <= set(jobs)
    mounted = compose()["services"]["prometheus"]["volumes"][0].split(":")
    assert (COMPOSE.parent / mounted[0]).resolve() == PROMETHEUS.resolve()
    assert mounted[1] in " ".join(compose()["services"]["prometheus"]["command"])


def test_promtool_checks_the_prometheus_config() -> None:
    binary = shutil.which("promtool")
    if binary is None:
        missing("promtool is not installed (Debian's prometheus package: make test installs it)")
    done = subprocess.run([binary, "check", "config", str(PROMETHEUS)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
