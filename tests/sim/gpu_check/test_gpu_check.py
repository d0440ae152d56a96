"""`make gpu-check`'s CPU dry run, on a Python that has torch and nothing else, as the GPU host has.

The host is imitated by a fresh venv that sees torch and its own requirements only (linked from this
venv); everything else the check imports must come from a bundle built as `make gpu-bundle` builds the
one that is sent, here for this Python. `make gpu-check` then runs with `--device cpu`: every step at the
smallest sizes, the CUDA-only ones skipped with their reason. The bundle that is sent (.gpu-bundle, for
the GPU host's Python 3.12; `make test` builds it) must fit what the device tool carries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib.metadata import distribution, requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from common.spec.tree.draft_tree import depths
from sim.gpu_check.page import section_text
from sim.gpu_check.tree import SHAPES
from sim.gpu_check.unpack import BundleError, read_manifest, unpack
from sim.gpu_check.wheelhouse import BUNDLE_ROOTS, HOST_WHEELS, MAX_BUNDLE_MB, build_bundle

ROOT = Path(__file__).resolve().parents[3]
SENT = ROOT / ".gpu-bundle"
# What the GPU host brings itself: torch and its requirements, and numpy (torch's tensors' bridge).
HOST_PROVIDED = ("torch", "numpy")


def _with_requirements(names: tuple[str, ...]) -> set[str]:
    """`names` and everything they require on this platform (no extras), as normalised distribution names."""
    seen, todo = set(), [canonicalize_name(name) for name in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in map(Requirement, requires(name) or []):
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    return seen


def _bare_host(where: Path) -> Path:
    """A venv whose site-packages holds links to torch and its requirements alone; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    (site,) = where.glob("lib/python*/site-packages")
    for name in _with_requirements(HOST_PROVIDED):
        dist = distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    return where / "bin" / "python"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess, float]:
    scratch = tmp_path_factory.mktemp("gpu-check")
    bundle = build_bundle(scratch / "bundle", f"{sys.version_info.major}.{sys.version_info.minor}")
    python, out = _bare_host(scratch / "host"), scratch / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | {"OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run(["make", "-s", "gpu-check", f"GPU_PYTHON={python}", f"GPU_BUNDLE={bundle.path}", f"OUT={out}",
                           "GPU_CHECK_ARGS=--device cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    return out, done, time.perf_counter() - started


def test_the_dry_run_runs_every_step_on_torch_and_the_bundle_alone(dry_run):
    out, done, seconds = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert {s["step"]: s["status"] for s in summary["steps"]} == {
        "env": "done", "owed": "done", "table": "done", "graphs": "skipped", "tiles": "done", "prefix": "done", "tree": "done",
        "pytest": "done", "profile": "done"}
    env = json.loads((out / "env.json").read_text())
    assert env["transformers"] == "5.23.0" and env["device"] == "cpu"
    print(f"dry run: {seconds:.0f} s")


def test_the_dry_run_writes_what_comes_back_and_the_page_reads_it(dry_run):
    out, _, _ = dry_run
    assert sorted(p.name for p in out.iterdir()) == ["env.json", "features.json", "gpu-check.log", "owed.json",
                                                      "profile.txt", "pytest.txt", "summary.json", "table.json",
                                                      "tiles.json"]
    owed = json.loads((out / "owed.json").read_text())
    assert len(owed["rows"]) == 8 and all(g["value"] is not None for g in owed["goals"])
    table = json.loads((out / "table.json").read_text())
    assert len(table["rows"]) == 2 * 3 * 2 * 2 and not table["not_reached"]  # layouts x contexts x edges x batching
    features = json.loads((out / "features.json").read_text())
    assert "need a CUDA device" in features["graphs"]["reason"]
    tiles = features["tiles"]
    assert [r["context"] for r in tiles["rows"]] == [16, 32, 64] and not tiles["not_reached"]
    assert all(r["tiles_on_rows"] == 32 and r["tiles_off_rows"] == 12 for r in tiles["rows"])  # 2 x 6, each to 16
    assert all(r["tiles_on_graph_bucket"] == "2x32" for r in tiles["rows"])
    assert "**Query tiles per session**" in section_text(out)
    assert features["prefix"]["cached_tokens"] == 128 and features["prefix"]["trials"] == 3  # 2 whole pages of 64
    tree = features["tree"]
    assert [r["sessions"] for r in tree["rows"]] == [1, 2] and not tree["not_reached"]
    assert all(r["tree16_ms"] > 0 and r["tree16_over_chain6"] > 0 for r in tree["rows"])
    assert tree["check"]["paths"] == 6 and tree["check"]["within_tolerance"] and tree["check"]["argmax_agree"] == 1.0
    assert "skipped" in (out / "pytest.txt").read_text()
    text = section_text(out, out / "plot.png")
    assert "| verify p50 ms, 2 edges x 6 tokens, context 32 |" in text and "not captured" in text
    assert "from 128 cached tokens" in text
    assert "| 2 | " in text.split("**A draft tree in the verify forward**")[1] and "6 paths (2 sessions batched, float32)" in text
    assert (out / "plot.png").stat().st_size > 0


def test_the_sent_bundle_names_every_wheel_and_fits_the_carry():
    if not SENT.exists():
        pytest.fail("no .gpu-bundle: run 'make gpu-bundle' (make test builds it)")
    manifest = read_manifest(SENT)
    assert manifest["python_version"] == "3.12"
    assert len(manifest["wheels"]) == len(HOST_WHEELS) and not any(w.startswith("torch-") for w in manifest["wheels"])
    assert any(w.startswith("transformers-5.23.0-") for w in manifest["wheels"])
    size_mb = sum(p.stat().st_size for p in SENT.rglob("*") if p.is_file() and "site" not in p.parts) / 2**20
    assert size_mb <= MAX_BUNDLE_MB
    assert list((SENT / "stubs" / "sprinter" / "v1").glob("*_pb2_grpc.py"))
    assert "gpu = sim.gpu_check.command:register" in next(SENT.glob("dist-info/*/entry_points.txt")).read_text()


def test_the_bundle_names_what_its_roots_require_beyond_torch():
    needed = _with_requirements(BUNDLE_ROOTS) - _with_requirements(HOST_PROVIDED)
    assert sorted(canonicalize_name(n) for n in HOST_WHEELS) == sorted(needed)


def test_a_bundle_for_another_python_is_refused_in_one_line():
    with pytest.raises(BundleError, match=r"wheels are for Python 3\.12, this is Python 3\.\d+: rebuild"):
        unpack(SENT)
    with pytest.raises(BundleError, match="make gpu-bundle"):
        read_manifest(ROOT / "no-such-bundle")


def test_the_tree_step_verifies_a_branching_rounds_shape():
    parents = SHAPES["tree16"]
    assert len(parents) == len(SHAPES["chain16"]) == 16 and SHAPES["chain6"] == parents[:6]
    assert max(depths(parents)) == 6  # no path longer than the chain
    alternatives = list(range(6, 16, 2))  # each a sibling of chain token b, followed by one token
    assert [parents[node] for node in alternatives] == [-1, 0, 1, 2, 3] == [parents[b] for b in range(5)]
    assert [parents[node + 1] for node in alternatives] == alternatives
