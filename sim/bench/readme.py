"""`make bench`'s last step: the sweep's summary into the benchmarks page, between the bench markers.

    sprinter bench readme --out results/bench --readme docs/benchmarks/index.md

Everything between `<!-- bench:start -->` and `<!-- bench:end -->` is replaced by the date, the
machine (`uname -m` and its cores), the commit and OUT/summary.md; the rest of the page is kept.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from pathlib import Path

START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def commit() -> str:
    """Short hash of HEAD, marked when the tree has uncommitted changes (the numbers are not HEAD's)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def bench_block(out: Path) -> str:
    summary = (out / "summary.md").read_text().strip()
    when = datetime.date.today().isoformat()
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    return (f"{START}\nMeasured {when} on {machine}, commit {commit()} (`make bench`; plots and per-request "
            f"results in `{out}/`):\n\n{summary}\n{END}")


def update_readme(readme: Path, out: Path) -> None:
    text = readme.read_text()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"{readme} has no {START} ... {END} markers")
    readme.write_text(pattern.sub(lambda _: bench_block(out), text, count=1))
