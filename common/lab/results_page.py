"""A measurement into its documentation page: `--page PAGE` on every benchmark command.

    sprinter bench cloud --targets smollm2-135m --page docs/benchmarks/cloud.md
    sprinter simulate --out results/bench --page docs/benchmarks/index.md --section sweep

The page's section `<!-- bench:NAME:start -->` ... `<!-- bench:NAME:end -->` (NAME: the command's own, or
`--section`) is replaced by a header saying the date, the machine, the commit and the command line, then the
command's table and its plots (copied beside the page, under img/, with the date in the name). What the section
held before is kept just below it, folded and titled with its own header, so a rerun never silently drops an
older result. A page without the section gets it appended at its end.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


def add_page_arguments(parser: argparse.ArgumentParser, section: str) -> None:
    """`--page` and `--section` on a benchmark command whose section is called `section` by default."""
    parser.add_argument("--page", type=Path, help="also write the table (and plots) into this Markdown page, "
                                                  "between its bench markers (docs/benchmarks/*.md)")
    parser.add_argument("--section", default=section, type=_section_name,
                        help=f"the page's section to replace (default {section})")


def _section_name(text: str) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", text):
        raise argparse.ArgumentTypeError(f"a section name is lower-case letters, digits and dashes, got {text!r}")
    return text


@dataclass(frozen=True)
class Measurement:
    """What a run publishes: its Markdown table (and notes), its plots and the command line that made it."""

    table: str
    command: str
    plots: tuple[Path, ...] = ()
    when: datetime.date = field(default_factory=datetime.date.today)
    machine: str | None = None  # where it was measured, when not this machine (a GPU host's results, published here)
    commit: str | None = None  # the commit it measured, when not this tree's HEAD


def publish_if_asked(args: argparse.Namespace, table: str, plots: tuple[Path, ...] = ()) -> None:
    """After a benchmark command's run: its section of `--page`, when the user gave one."""
    page = getattr(args, "page", None)
    if page is None:
        return
    command = "sprinter " + shlex.join(getattr(args, "argv", []))
    publish(page, args.section, Measurement(table=table.strip(), command=command, plots=tuple(plots)))
    print(f"wrote section {args.section!r} of {page}")


def markers(section: str) -> tuple[str, str]:
    return f"<!-- bench:{section}:start -->", f"<!-- bench:{section}:end -->"


def publish(page: Path, section: str, measurement: Measurement) -> None:
    """Replace `section` of `page` with `measurement`, folding what it held below it."""
    start, end = markers(section)
    text = page.read_text() if page.exists() else ""
    pattern = re.compile(re.escape(start) + "(.*?)" + re.escape(end), re.DOTALL)
    # blank lines around the markers: an HTML comment touching a table would end up inside it
    block = f"{start}\n\n{_body(page, section, measurement)}\n\n{end}"
    found = pattern.search(text)
    if found is None:
        page.write_text(text.rstrip("\n") + ("\n\n" if text else "") + block + "\n")
        return
    earlier = _folded(found.group(1))
    page.write_text(text[:found.start()] + block + earlier + text[found.end():])


def _body(page: Path, section: str, measurement: Measurement) -> str:
    when = measurement.when.isoformat()
    where, what = measurement.machine or machine(), measurement.commit or commit()
    lines = [f"Measured {when} on {where}, commit {what}:", "", "```bash", measurement.command, "```", "",
             measurement.table]
    images = page.parent / "img"
    for plot in measurement.plots:
        if not plot.exists():
            continue
        images.mkdir(parents=True, exist_ok=True)
        name = f"{section}-{plot.stem}-{when}{plot.suffix}"
        shutil.copyfile(plot, images / name)
        lines += ["", f"![{plot.stem}](img/{name})"]
    return "\n".join(lines)


def _folded(earlier: str) -> str:
    """The section's previous contents as a folded note below it, titled with their own first line."""
    earlier = earlier.strip()
    if not earlier:
        return ""
    title = earlier.splitlines()[0].rstrip(":").replace('"', "'")
    if not title.startswith("Measured"):
        title = "An earlier measurement"
    indented = "\n".join(("    " + line) if line else "" for line in earlier.splitlines())
    return f'\n\n??? note "Earlier: {title}"\n\n{indented}'


def machine() -> str:
    """The CPU's model, the flags that move our figures (AMX bf16, AVX-512) and the cores: figures differ by them."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    features = [name for flag, name in (("amx_bf16", "AMX-bf16"), ("avx512f", "AVX-512")) if flag in flags]
    described = f"{model} ({', '.join(features)})" if features else f"{model} (no AVX-512)" if flags else model
    return f"{described}, {os.cpu_count()} cores"


def commit() -> str:
    """Short hash of HEAD, marked when the tree has uncommitted changes (the numbers are not HEAD's)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
