"""The edge daemon's Prometheus metrics, in the design's measurement vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.call_policy import CostModel
from edge.decoder import EdgeResult


@dataclass
class RequestTotals:
    """Counts since the daemon started, all modes together: what fleet telemetry turns into rates."""

    requests: int = 0
    tokens: int = 0
    target_calls: int = 0
    degraded_requests: int = 0


class EdgeMetrics:
    def __init__(self, cost_model: CostModel) -> None:
        self.totals = RequestTotals()
        self.registry = CollectorRegistry()
        r = self.registry
        # Read at scrape time: the cost model learns between scrapes, from every request.
        estimates = Gauge("sprinter_edge_cost_model", "The call policy's cost model: learned draft, link and "
                          "verify costs (ms) and observation counts", ["estimate"], registry=r)
        for key in cost_model.snapshot():
            estimates.labels(key).set_function(lambda key=key: cost_model.snapshot()[key])
        self.requests = Counter("sprinter_edge_requests", "Generation requests", ["mode"], registry=r)
        self.tokens = Counter("sprinter_edge_tokens_generated", "Tokens returned to clients", ["mode"], registry=r)
        self.target_calls = Counter("sprinter_edge_target_calls", "Cloud verifications", ["mode"], registry=r)
        self.degraded = Counter("sprinter_edge_degraded_requests", "Requests served partly without the cloud", registry=r)
        self.in_flight = Gauge("sprinter_edge_requests_in_flight", "Generations running now", registry=r)
        self.cancelled = Counter("sprinter_edge_requests_cancelled", "Generations stopped because the client left",
                                 registry=r)
        self.rejected = Counter("sprinter_edge_requests_rejected", "Requests turned away before generating",
                                ["reason"], registry=r)
        self.refused = Counter("sprinter_edge_cloud_refusals", "Generations ended early by a cloud refusal", ["code"],
                               registry=r)
        self.tokens_per_s = Histogram("sprinter_edge_tokens_per_s", "Generation speed per request", registry=r,
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))

    def observe(self, result: EdgeResult) -> None:
        mode = result.stats.mode
        self.requests.labels(mode).inc()
        self.tokens.labels(mode).inc(result.stats.new_tokens)
        self.target_calls.labels(mode).inc(result.stats.target_calls)
        self.tokens_per_s.observe(result.stats.tokens_per_s)
        if result.degraded:
            self.degraded.inc()
        self.totals.requests += 1
        self.totals.tokens += result.stats.new_tokens
        self.totals.target_calls += result.stats.target_calls
        self.totals.degraded_requests += int(result.degraded)
        if result.error is not None:
            self.refused.labels(result.error.code.name).inc()
