"""How the operational benches (soak, chaos) judge a run of requests through the edge: what they count, the
problems that fail it, and the table that ends in PASS or FAIL, written with results.json into the run's folder."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.bench.load import RequestOutcome, failure_lines, latency_summary
from sim.bench.run_folder import RunFolder
from sim.bench.target_identity import TargetIdentity


@dataclass
class Judged:
    """A run's summary, what failed it (nothing: it passed), and its records by name (requests, samples, kills)."""

    summary: dict[str, Any]
    problems: list[str]
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.problems

    def write(self, settings: Any, out: Path, table: str) -> None:
        folder = RunFolder(out)
        folder.write_results(settings, summary=self.summary, problems=self.problems, **self.records)
        folder.write_table(table)


def outcome_summary(outcomes: Sequence[RequestOutcome], identity: TargetIdentity) -> dict[str, Any]:
    """The counts every such run reports: requests, how they ended, the greedy check, tokens, latency."""
    failed = [o for o in outcomes if not o.ok]
    degraded = [o for o in outcomes if o.ok and o.degraded]
    return {"requests": len(outcomes), "completed": len(outcomes) - len(failed), "errors": len(failed),
            "http_5xx": sum(1 for o in failed if o.status is not None and o.status >= 500),
            "degraded": len(degraded), "degraded_by_reason": dict(Counter(o.degraded_reason for o in degraded)),
            "degraded_by_mode": dict(Counter(o.mode for o in degraded)),
            "greedy_checked": identity.checked, "greedy_mismatches": len(identity.mismatches),
            "greedy_references_failed": identity.references_failed,
            "tokens": sum(o.tokens for o in outcomes if o.ok), **latency_summary(outcomes)}


def outcome_problems(outcomes: Sequence[RequestOutcome], identity: TargetIdentity) -> list[str]:
    """Failed requests and greedy answers unlike the target's fail every such run."""
    failed = [o for o in outcomes if not o.ok]
    problems = [f"{len(failed)} of {len(outcomes)} requests failed"] + failure_lines(outcomes) if failed else []
    if identity.mismatches:
        problems.append(f"{len(identity.mismatches)} of {identity.checked} greedy lossless answers differ from the "
                        f"target's: requests {identity.mismatches[:10]}")
    if not outcomes:
        problems.append("no request was sent")
    return problems


def by_reason(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in counts.items()) or "-"


def verdict_table(name: str, rows: Sequence[tuple[str, object]], problems: Sequence[str]) -> str:
    lines = [f"| {name} | |", "|---|---|"] + [f"| {row} | {value} |" for row, value in rows]
    lines.append(f"\n{'FAIL' if problems else 'PASS'}" + "".join(f"\n- {p}" for p in problems))
    return "\n".join(lines)
