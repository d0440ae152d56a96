"""The documentation against the code: every documented `sprinter` command line parses with the real CLI,
every benchmark command can write its docs section (`--page`), every table of the benchmark pages sits in a
section that says its date and command, the reference pages `make docs` generates name what the code has, and
the built site draws its pictures in a real browser with no network. (`make docs` itself builds the site with --strict.)"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.deploy.test_deploy import CommandLine, parse

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "docs" / "reference"
BENCH_PAGES = ROOT / "docs" / "benchmarks"
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


def test_a_measurement_replaces_its_section_and_folds_the_one_before(tmp_path: Path) -> None:
    from common.lab.results_page import Measurement, markers, publish

    start, end = markers("cloud")
    page, plot = tmp_path / "cloud.md", tmp_path / "verified_tokens_per_s.png"
    plot.write_bytes(b"png")
    before, after = "# Cloud\n\nintro\n\n", "\n\n## Next\n"
    page.write_text(f"{before}{start}\nMeasured 2026-11-01 on a laptop:\n\n| old |\n|---|\n{end}{after}")
    publish(page, "cloud", Measurement("| new |\n|---|", "sprinter bench cloud --page cloud.md", (plot,)))
    text = page.read_text()
    assert text.startswith(before + start) and text.endswith(after)
    newest = text.split(start)[1].split(end)[0]
    assert "| new |" in newest and "sprinter bench cloud --page cloud.md" in newest and "| old |" not in newest
    assert re.search(r"Measured \d{4}-\d\d-\d\d on .+ cores, commit ", newest)
    images = list((tmp_path / "img").iterdir())
    assert len(images) == 1 and f"(img/{images[0].name})" in newest
    folded = text.split(end)[1]
    assert '??? note "Earlier: Measured 2026-11-01 on a laptop"' in folded and "    | old |" in folded

    publish(page, "draft", Measurement("| draft |", "sprinter bench draft"))  # a page without the section
    assert page.read_text().rstrip().endswith(markers("draft")[1]) and page.read_text().startswith(before)


def test_every_benchmark_command_can_write_its_docs_section() -> None:
    from common.cli import build_parser

    def subcommands(parser) -> dict:
        return next(a.choices for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")

    top = subcommands(build_parser())
    measuring = list(subcommands(top["bench"]).values()) + [top["simulate"]]
    measuring += [subcommands(top["verifier"])[name] for name in ("train", "study", "bound", "replay", "eval")]
    for parser in measuring:
        assert "--page" in parser._option_string_actions, parser.prog


def bench_sections(text: str) -> list[tuple[str, int, int]]:
    """(name, start offset, end offset) of every `<!-- bench:NAME:start/end -->` section of a page."""
    found = []
    for match in re.finditer(r"<!-- bench:([a-z0-9-]+):start -->", text):
        end = text.index(f"<!-- bench:{match.group(1)}:end -->", match.end())
        found.append((match.group(1), match.start(), end))
    return found


def test_every_benchmark_table_says_its_date_and_command() -> None:
    for page in sorted(BENCH_PAGES.glob("*.md")):
        text = page.read_text()
        sections = bench_sections(text)
        names = [name for name, _, _ in sections]
        assert len(names) == len(set(names)) == text.count(":end -->"), f"{page.name}: unpaired or repeated markers"
        for section, start, end in sections:
            body = text[start:end]
            assert re.search(r"\d{4}-\d\d-\d\d", body), f"{page.name} {section}: no date"
            assert re.search(r"`(sprinter|make) |```bash", body), f"{page.name} {section}: no command"
        for table in re.finditer(r"^\|.*\n\|[-| ]+\|$", text, re.MULTILINE):
            inside = any(start < table.start() < end for _, start, end in sections)
            assert inside or table.group(0).startswith("| page | what |"), \
                f"{page.name}: the table {table.group(0).splitlines()[0][:60]!r} is in no dated section"


def test_the_reference_pages_name_what_the_code_has(tmp_path: Path) -> None:
    from sim.reference_pages import write_reference

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


MERMAID_JS = ROOT / "docs" / "js" / "mermaid.min.js"
PICTURE_PAGES = ("index.html", "architecture/index.html")
# Material draws each mermaid block into a *closed* shadow root, which --dump-dom cannot see (nor can a page
# script). In the test's copy of each page this one line, run before Material's bundle, makes attachShadow return
# the element itself, so the SVG mermaid renders lands in the dumped DOM; nothing else on the page changes.
SHADOW_INTO_LIGHT = "<script>Element.prototype.attachShadow = function () { return this; };</script>"
# No network for the browser: every host name fails to resolve and any proxied fetch hits a closed port.
OFFLINE = ["--proxy-server=http://127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND"]


def test_the_home_and_architecture_pages_draw_their_pictures_offline(tmp_path: Path) -> None:
    """The site's mermaid blocks become SVG pictures in Debian's headless chromium, offline: mermaid.js ships with
    the site (make docs fetches it from npm) and Material uses it instead of a CDN."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium is not installed (`make test` installs Debian's chromium): the pictures are not checked")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed in this environment (`make test` and `make docs` install it)")
    if not MERMAID_JS.exists():
        pytest.skip("docs/js/mermaid.min.js is absent: `make mermaid` (part of `make docs` and `make test`) fetches it")
    site = tmp_path / "site"
    # Not --strict: the generated reference pages may not be there yet (make docs checks the links, strictly).
    subprocess.run([str(mkdocs), "build", "--no-strict", "--quiet", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    browsers = {}
    for number, name in enumerate(PICTURE_PAGES):
        page = site / name
        html = page.read_text()
        assert '<pre class="mermaid"><code>flowchart LR' in html, f"{name}: no mermaid block to draw"
        assert re.search(r'<script src="(\.\./)*js/mermaid\.min\.js"></script>', html), f"{name}: mermaid.js not shipped"
        probe = page.with_name("probe.html")
        probe.write_text(html.replace("<head>", "<head>" + SHADOW_INTO_LIGHT, 1))
        browsers[name] = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / f'profile{number}'}",
             *OFFLINE, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for name, browser in browsers.items():
        dom, _ = browser.communicate(timeout=60)
        assert browser.returncode == 0 and "</html>" in dom, f"{name}: chromium failed"
        assert re.search(r'<div class="mermaid"><svg [^>]*id="__mermaid_0"', dom), f"{name}: the picture was not drawn"
        assert "flowchart LR" not in dom, f"{name}: the mermaid source is still on the page as code"
