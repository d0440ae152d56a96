"""`sprinter bench soak --identities N,M,...`: several edge identities against one cloud, each backlogged.

Identity i is the cloud's bearer token `edge-i` (one line of the cloud's `--auth-tokens` file) and an
edge daemon of its own that sends it (SPRINTER_CLOUD_TOKEN, `--insecure`: loopback); N_i workers send
requests back to back to that edge. The cloud's admission line (cloud/admission_queue.py) takes turns
between identities once it is full, so what this measures is fairness: each identity's share of the
tokens completed while every identity was backlogged (requests that ended within DURATION_S of the
load's start; the drain after it is one identity's tail), and each identity's latency, which for the
light one is to be held against the same workers running alone (`--sessions N`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.stats import percentile
from sim.bench.load import RequestOutcome, seconds


@dataclass(frozen=True)
class Identity:
    name: str  # the cloud's EDGE_ID for it
    token: str
    workers: int  # concurrent requests through its own edge


def make_identities(counts: Sequence[int]) -> list[Identity]:
    return [Identity(f"edge-{i}", secrets.token_hex(16), n) for i, n in enumerate(counts)]


def write_tokens_file(directory: Path, identities: Sequence[Identity]) -> Path:
    """The cloud's `--auth-tokens` file (`EDGE_ID TOKEN` lines), readable by this user only."""
    path = directory / "cloud-tokens.txt"
    path.write_text("")
    os.chmod(path, 0o600)
    path.write_text("".join(f"{identity.name} {identity.token}\n" for identity in identities))
    return path


def identity_summary(identities: Sequence[Identity], outcomes: Sequence[RequestOutcome], identity_of: dict[int, int],
                     window_end_s: float) -> list[dict[str, Any]]:
    """Per identity: requests, completed tokens, latency p50/p99, and its share of the tokens completed in the load
    window (requests that ended by `window_end_s`, monotonic) and over the whole run (the drain included)."""
    done = [o for o in outcomes if o.ok]
    window_total = sum(o.tokens for o in done if o.ended_s <= window_end_s)
    total = sum(o.tokens for o in done)
    rows = []
    for i, identity in enumerate(identities):
        own = [o for o in outcomes if identity_of.get(o.index) == i]
        own_done = [o for o in own if o.ok]
        tokens = sum(o.tokens for o in own_done)
        window = sum(o.tokens for o in own_done if o.ended_s <= window_end_s)
        latencies = [o.latency_s for o in own_done]
        rows.append({"identity": identity.name, "workers": identity.workers, "requests": len(own),
                     "completed": len(own_done), "errors": len(own) - len(own_done), "tokens": tokens,
                     "tokens_window": window, "latency_s_p50": percentile(latencies, 0.5),
                     "latency_s_p99": percentile(latencies, 0.99),
                     "tokens_share_window": window / window_total if window_total else None,
                     "tokens_share": tokens / total if total else None})
    return rows


def identity_problems(rows: Sequence[dict[str, Any]]) -> list[str]:
    return [f"identity {row['identity']} completed no request" for row in rows if not row["completed"]]


def identity_table_rows(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """Table rows: one per identity."""
    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    return [(f"{row['identity']} ({row['workers']} workers): requests, tokens, latency s p50 / p99, "
             f"token share in window / overall",
             f"{row['requests']}, {row['tokens']}, {seconds(row['latency_s_p50'])} / {seconds(row['latency_s_p99'])}, "
             f"{share(row['tokens_share_window'])} / {share(row['tokens_share'])}") for row in rows]
