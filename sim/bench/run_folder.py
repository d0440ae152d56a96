"""One bench run's folder: results.json stamped the same way by every bench, then its table and plots.

    folder = RunFolder(settings.out)
    folder.write_results(settings, rows=rows, summary=summary)   # {"date", "machine", "commit", "settings", ...}
    table = folder.write_table(markdown)                           # table.md; returns the markdown
    earlier = folder.read_results()                                # None when the folder has none yet

Every results.json opens with the same four keys: when it ran (`date`, local time to the second), where
(`machine`: the CPU model and the cores this process may use, `common/lab/results_page.machine`), what ran
(`commit`: short hash, marked when the tree had uncommitted changes) and how (`settings`: the bench's settings dataclass,
paths as strings). What the bench measured follows, under the names it passes.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from common.lab.results_page import commit, machine

RESULTS = "results.json"
TABLE = "table.md"


def jsonable(value: Any) -> Any:
    """Settings as JSON: dataclasses as dicts, paths as strings, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {item.name: jsonable(getattr(value, item.name)) for item in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value


def stamp(settings: Any) -> dict[str, Any]:
    """The four keys every results.json opens with."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "commit": commit(),
            "settings": jsonable(settings)}


@dataclasses.dataclass(frozen=True)
class RunFolder:
    out: Path

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)

    @property
    def results_path(self) -> Path:
        return self.out / RESULTS

    def write_results(self, settings: Any, **measured: Any) -> dict[str, Any]:
        """results.json: the stamp, then what was measured; returns what it wrote."""
        report = {**stamp(settings), **jsonable(measured)}
        self.results_path.write_text(json.dumps(report, indent=1))
        return report

    def read_results(self) -> dict[str, Any] | None:
        """An earlier run's results.json in this folder (a bench that keeps rows it does not measure again)."""
        return json.loads(self.results_path.read_text()) if self.results_path.exists() else None

    def write_table(self, markdown: str, name: str = TABLE) -> str:
        """table.md (or `name`); returns `markdown`, the table a bench prints."""
        (self.out / name).write_text(markdown if markdown.endswith("\n") else markdown + "\n")
        return markdown

    def path(self, name: str) -> Path:
        """Where a plot or another artefact of this run goes."""
        return self.out / name
