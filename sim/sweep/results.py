"""OUT/results.jsonl: the sweep's measurements, one JSON line per (rtt_ms, mode, pipeline, prompt_id).

A line written before the sweep had a pipeline axis has no "pipeline": it was measured with "off".
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


ResultKey = tuple[float, str, str, str]  # (rtt_ms, mode, pipeline, prompt_id)


def pipeline_of(record: dict[str, Any]) -> str:
    return record.get("pipeline") or "off"


def result_key(record: dict[str, Any]) -> ResultKey:
    return float(record["rtt_ms"]), record["mode"], pipeline_of(record), record["prompt_id"]


class ResultStore:
    """OUT/results.jsonl: one line per (rtt_ms, mode, pipeline, prompt_id), appended as each request finishes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._repair()

    def _repair(self) -> None:
        """A sweep killed mid-write leaves a partial last line: cut it, so the next append starts clean."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            log.warning("%s: dropping a partial last line (an interrupted write)", self.path)
            self.path.write_bytes(data[: data.rfind(b"\n") + 1])

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def done(self) -> set[ResultKey]:
        return {result_key(r) for r in self.records()}

    def append(self, record: dict[str, Any], path: Path | None = None) -> None:
        with open(path or self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
