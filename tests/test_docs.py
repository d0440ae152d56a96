"""The documentation against the code: every documented `sprinter` command line parses with the real CLI,
the benchmarks page keeps the markers `sprinter bench readme` writes between, and the reference pages
`make docs` generates name what the code has. (`make docs` itself builds the site with --strict.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from test_deploy import CommandLine, parse

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "docs" / "reference"
BENCH_PAGE = ROOT / "docs" / "benchmarks" / "index.md"
SHELL_FENCES = ("bash", "console", "sh", "shell")
SNIPPET = re.compile(r'^--8<-- "([^"]+)"\s*$', re.MULTILINE)


def documentation_pages() -> list[Path]:
    """README.md, docs/**/*.md (the generated reference aside) and the files the pages include as snippets."""
    pages = [ROOT / "README.md"] + [p for p in sorted((ROOT / "docs").rglob("*.md")) if GENERATED not in p.parents]
    included = [ROOT / name for page in pages for name in SNIPPET.findall(page.read_text())]
    return pages + [p for p in included if p not in pages]


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) of each shell command in a ```bash / console block, continuations joined."""
    found, fence, pending, start = [], None, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            continue
        if fence not in SHELL_FENCES:
            continue
        command = stripped.removeprefix("$ ")
        if not pending:
            start = number
        pending += command.removesuffix("\\").strip() + " "
        if not command.endswith("\\"):
            found.append((start, pending.strip()))
            pending = ""
    return found


def documented_command_lines() -> list[CommandLine]:
    lines = []
    for page in documentation_pages():
        for number, command in shell_lines(page.read_text()):
            words = shlex.split(command, comments=True)
            if words[:1] == ["sprinter"]:
                lines.append(CommandLine(f"{page.relative_to(ROOT)}:{number}", words[1:], {}))
    return lines


def test_the_fence_reader_joins_continuations_and_skips_other_blocks() -> None:
    text = "```bash\nsprinter a \\\n    --b 1  # note\nmake x\n```\n```text\nsprinter no\n```\n```console\n$ sprinter c\n```\n"
    assert shell_lines(text) == [(2, "sprinter a --b 1  # note"), (4, "make x"), (10, "sprinter c")]


def test_every_documented_sprinter_command_line_parses() -> None:
    lines = documented_command_lines()
    where = {line.where.split(":")[0] for line in lines}
    assert {"README.md", "docs/getting-started.md", "docs/verifier.md", "docs/benchmarks/policies.md"} <= where
    for line in lines:
        parse(line)


def test_the_benchmarks_page_takes_the_sweep_between_its_markers(tmp_path: Path) -> None:
    from sim.bench.readme import END, START, update_readme

    text = BENCH_PAGE.read_text()
    assert text.count(START) == 1 and text.count(END) == 1
    page, out = tmp_path / "index.md", tmp_path / "bench"
    page.write_text(text)
    out.mkdir()
    (out / "summary.md").write_text("| RTT ms | mode |\n|---|---|\n| 0 | sd |")
    update_readme(page, out)
    updated = page.read_text()
    assert "| 0 | sd |" in updated and "commit 4760804" not in updated
    assert updated.split(START)[0] == text.split(START)[0] and updated.split(END)[1] == text.split(END)[1]


def test_the_reference_pages_name_what_the_code_has(tmp_path: Path) -> None:
    from sim.reference import write_reference

    write_reference(tmp_path)
    cli, metrics, grpc = ((tmp_path / name).read_text() for name in ("cli.md", "metrics.md", "grpc.md"))
    for command in ("sprinter edge serve", "sprinter cloud serve", "sprinter simulate", "sprinter fleet status"):
        assert f"## {command}\n" in cli
    assert "| `--cloud-token`" in cli and "| `--kv-budget-mb`" in cli
    for metric in ("sprinter_edge_degraded_requests_total", "sprinter_edge_cloud_reopens_total",
                   "sprinter_cloud_kv_over_budget_total", "sprinter_cloud_target_forward_seconds"):
        assert f"| `{metric}` |" in metrics
    assert "| `sprinter_edge_degraded_requests_total` | counter | `reason` |" in metrics
    assert "### service TargetService" in grpc and "| `Session` | `stream EdgeFrame` | `stream CloudFrame` |" in grpc
    assert "| `max_block` | 1 | `uint32` | draft tokens per verify frame |" in grpc


def test_the_readme_opens_with_make_demo_and_make_test() -> None:
    first_block = (ROOT / "README.md").read_text().split("```")[1]
    assert first_block.lstrip().startswith("make demo") and "make test" in first_block
