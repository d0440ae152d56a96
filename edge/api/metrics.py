"""The edge daemon's Prometheus metrics, in the design's measurement vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from common.spec.cost_model import CostModel
from edge.decoding.ahead_gauge import AheadRecord
from edge.decoding.decoder import EdgeResult
from edge.cloud_link.replicas import ReplicaSet


@dataclass
class RequestTotals:
    """Counts since the daemon started, all modes together: what fleet telemetry turns into rates."""

    requests: int = 0
    tokens: int = 0
    target_calls: int = 0
    degraded_requests: int = 0

    def since(self, before: RequestTotals) -> RequestTotals:
        return RequestTotals(self.requests - before.requests, self.tokens - before.tokens,
                             self.target_calls - before.target_calls,
                             self.degraded_requests - before.degraded_requests)


class ReplicaCollector:
    """The cloud replicas as this edge sees them, read at scrape time (a fleet config may replace the set)."""

    def __init__(self, replicas: Callable[[], ReplicaSet | None]) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        sessions = GaugeMetricFamily("sprinter_edge_cloud_sessions", "This edge's sessions on each cloud replica",
                                     labels=["replica"])
        usable = GaugeMetricFamily("sprinter_edge_cloud_replica_usable", "1 if a replica takes new sessions now",
                                   labels=["replica"])
        reopens = CounterMetricFamily("sprinter_edge_cloud_reopens", "Sessions reopened, by cause (desync, "
                                      "evicted, replica_failed, draining, busy)", labels=["cause"])
        replicas = self.replicas()
        if replicas is not None:
            for replica in replicas.describe():
                sessions.add_metric([replica["address"]], replica["sessions"])
                usable.add_metric([replica["address"]], float(replica["usable"]))
            for cause, count in replicas.reopen_causes.items():
                reopens.add_metric([cause], count)
        yield from (sessions, usable, reopens)


class PipelineGaugeCollector:
    """The pipeline gauge's estimates (edge/decoding/ahead_gauge.py) per pipeline and mode, read at scrape time:
    whether drafting ahead pays here (hit rate, the saving of a hit, the lag it costs, rounds measured)."""

    def __init__(self, records: Callable[[], dict[tuple[str, str], AheadRecord]]) -> None:
        self.records = records

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily("sprinter_edge_pipeline_gauge", "The pipeline gauge's estimates per pipeline and "
                                  "mode: hit_rate, saving_ms (per hit), lag_ms (per round), rounds",
                                  labels=["pipeline", "mode", "estimate"])
        for (pipeline, mode), record in sorted(self.records().items()):
            for estimate, value in record.snapshot().items():
                gauge.add_metric([pipeline, mode, estimate], value)
        yield gauge


def _placement_counters(r: CollectorRegistry) -> tuple[Counter, Counter]:
    """Where requests ran (placement, `--mode auto`'s first choice), and `--mode auto`'s switches after it."""
    return (Counter("sprinter_edge_placements", "Requests placed, by the placement (or mode auto) asked and what ran: "
                    "edge or cloud drafting, or the target alone", ["asked", "used"], registry=r),
            Counter("sprinter_edge_mode_switches", "Switches of --mode auto within a request, at a round boundary, by "
                    "the mode switched to", ["mode"], registry=r))


class EdgeMetrics:
    def __init__(self, cost_model: CostModel, replicas: Callable[[], ReplicaSet | None] = lambda: None,
                 ahead_records: Callable[[], dict[tuple[str, str], AheadRecord]] = dict) -> None:
        self.totals = RequestTotals()
        self.registry = CollectorRegistry()
        self.registry.register(ReplicaCollector(replicas))
        self.registry.register(PipelineGaugeCollector(ahead_records))
        r = self.registry
        # Read at scrape time: the cost model learns between scrapes, from every request.
        estimates = Gauge("sprinter_edge_cost_model", "The call policy's cost model: learned draft, link and "
                          "verify costs (ms) and observation counts", ["estimate"], registry=r)
        for key in cost_model.snapshot():
            estimates.labels(key).set_function(lambda key=key: cost_model.snapshot()[key])
        self.requests = Counter("sprinter_edge_requests", "Generation requests", ["mode"], registry=r)
        self.tokens = Counter("sprinter_edge_tokens_generated", "Tokens returned to clients", ["mode"], registry=r)
        self.target_calls = Counter("sprinter_edge_target_calls", "Cloud verifications", ["mode"], registry=r)
        self.degraded = Counter("sprinter_edge_degraded_requests", "Requests served partly without the cloud, by "
                                "reason: cloud_unreachable, deadline, loading, no_cloud", ["reason"], registry=r)
        self.in_flight = Gauge("sprinter_edge_requests_in_flight", "Generations running now", registry=r)
        self.cancelled = Counter("sprinter_edge_requests_cancelled", "Generations stopped because the client left",
                                 registry=r)
        self.rejected = Counter("sprinter_edge_requests_rejected", "Requests turned away before generating",
                                ["reason"], registry=r)
        self.fleet_rejected = Counter("sprinter_edge_fleet_messages_rejected", "Fleet-plane messages ignored or "
                                      "refused: oversized, not-json, not-object, schema, fields, digest, stale, "
                                      "refused", ["reason"], registry=r)
        self.refused = Counter("sprinter_edge_cloud_refusals", "Generations ended early by a cloud refusal", ["code"],
                               registry=r)
        self.placements, self.mode_switches = _placement_counters(r)
        self.queue_seconds = Histogram("sprinter_edge_cloud_queue_seconds", "Time a request waited in the cloud's "
                                       "admission queue", registry=r,
                                       buckets=(.01, .05, .1, .25, .5, 1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.draft_reused_tokens = Counter("sprinter_edge_draft_reused_tokens", "Prompt tokens whose draft KV came "
                                           "from an earlier request (--draft-cache-mb) instead of a prefill",
                                           registry=r)
        self.draft_prefill_saved = Counter("sprinter_edge_draft_prefill_saved_seconds", "Draft prefill time that "
                                           "reuse saved, estimated from this edge's prefill rate", registry=r)
        # What proposed the tokens (the draft model, or text copied by a suffix proposer) and how many calls kept.
        self.drafted = Counter("sprinter_edge_drafted_tokens", "Tokens proposed for the target to verify, by mode and "
                               "source (model, copied)", ["mode", "source"], registry=r)
        self.copied_kept = Counter("sprinter_edge_copied_tokens_kept", "Copied tokens the target kept", ["mode"],
                                   registry=r)
        # Branching (common/spec/tree/branching.py, copy_branches.py): tree rounds, paths, branch and copy tokens.
        self.tree_rounds = Counter("sprinter_edge_tree_rounds", "Verify calls that sent a draft tree", ["mode"],
                                   registry=r)
        self.tree_paths = Counter("sprinter_edge_tree_paths", "Root-to-leaf paths of the trees sent (per tree round: "
                                  "paths per round)", ["mode"], registry=r)
        self.branch_tokens = Counter("sprinter_edge_branch_tokens", "Tree tokens beyond the primary chain, sent and "
                                     "kept", ["mode", "outcome"], registry=r)
        self.side_path_wins = Counter("sprinter_edge_side_path_wins", "Tree rounds whose kept path left the primary "
                                      "chain", ["mode"], registry=r)
        self.copy_branch_tokens = Counter("sprinter_edge_copy_branch_tokens", "Tree tokens beyond the primary chain "
                                          "copied from text (suffix index), sent", ["mode"], registry=r)
        self.copy_path_wins = Counter("sprinter_edge_copy_path_wins", "Tree rounds whose kept path left the primary "
                                      "chain through a copy branch", ["mode"], registry=r)
        self.accepted_per_call = Histogram("sprinter_edge_accepted_per_call", "Draft tokens the target kept per call, "
                                           "by mode (acceptance by position: 1 - bucket(le=i) / count)", ["mode"],
                                           registry=r, buckets=tuple(range(17)))
        self.tokens_per_s = Histogram("sprinter_edge_tokens_per_s", "Generation speed per request", registry=r,
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))

    def observe(self, result: EdgeResult) -> None:
        mode = result.stats.mode
        self.requests.labels(mode).inc()
        self.tokens.labels(mode).inc(result.stats.new_tokens)
        self.target_calls.labels(mode).inc(result.stats.target_calls)
        self.tokens_per_s.observe(result.stats.tokens_per_s)
        self._observe_proposals(result)
        self.queue_seconds.observe(result.queued_s)
        self.draft_reused_tokens.inc(result.stats.draft_reused_tokens)
        self.draft_prefill_saved.inc(result.stats.draft_prefill_saved_ms / 1e3)
        if result.placed is not None:
            self.placements.labels(result.placed.asked, result.placed.used).inc()
            for switch in result.placed.later:
                self.mode_switches.labels(switch.mode).inc()
        if result.degraded_reason is not None:
            self.degraded.labels(result.degraded_reason).inc()
        self.totals.requests += 1
        self.totals.tokens += result.stats.new_tokens
        self.totals.target_calls += result.stats.target_calls
        self.totals.degraded_requests += int(result.degraded)
        if result.error is not None:
            self.refused.labels(result.error.code.name).inc()

    def _observe_proposals(self, result: EdgeResult) -> None:
        stats = result.stats
        copied = min(stats.suffix_tokens, stats.drafted_tokens)
        self.drafted.labels(stats.mode, "model").inc(stats.drafted_tokens - copied)
        self.drafted.labels(stats.mode, "copied").inc(copied)
        self.copied_kept.labels(stats.mode).inc(stats.suffix_kept)
        self.tree_rounds.labels(stats.mode).inc(stats.tree_rounds)
        self.tree_paths.labels(stats.mode).inc(stats.tree_paths)
        self.branch_tokens.labels(stats.mode, "sent").inc(stats.branch_tokens_sent)
        self.branch_tokens.labels(stats.mode, "kept").inc(stats.branch_tokens_kept)
        self.side_path_wins.labels(stats.mode).inc(stats.side_path_wins)
        self.copy_branch_tokens.labels(stats.mode).inc(stats.copy_branch_tokens)
        self.copy_path_wins.labels(stats.mode).inc(stats.copy_path_wins)
        for accepted in stats.accepted_lengths:
            self.accepted_per_call.labels(stats.mode).observe(accepted)
