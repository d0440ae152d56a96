"""The GPU bundle: what `make gpu-check` needs beside the host's own Python and torch, built where PyPI is reachable.

    sprinter gpu bundle --out .gpu-bundle [--python-version 3.12]

The bundle is one folder, sent along with the working tree (the device tool's `carry`):
    wheels/      one wheel per distribution in `HOST_WHEELS`, at the version installed here (the versions the
                 tests ran against), for the host's Python (`pip download --no-deps --only-binary=:all:`)
    stubs/       the generated gRPC stubs (sprinter/v1/*_pb2*.py): they are never committed
    dist-info/   this project's `sprinter-*.dist-info` (name, version, entry points), so `sprinter`'s subcommands
                 are found with the working tree on PYTHONPATH, as an editable install would find them; no build
                 backend is needed, here or on the host
    manifest.json
torch is never in it: the host's own build is the one that knows its GPU. numpy and torch's other
requirements come with torch.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from common.errors import SprinterError
from sim.gpu_check.unpack import MANIFEST

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "proto" / "sprinter" / "v1"
# What the check imports beyond torch (the engine bench, the cloud service tests/cloud/test_cuda.py starts, pytest; httpx
# for `sprinter bench`, whose other benchmarks can then run there too):
# `BUNDLE_ROOTS` and everything they require, less what torch brings. tests/sim/gpu_check/test_gpu_check.py checks that the
# list is that closure, and runs the dry run with these alone.
BUNDLE_ROOTS = ("transformers", "httpx", "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "prometheus_client",
                "llguidance", "aiomqtt", "gguf", "accelerate", "psutil", "platformdirs", "tqdm", "pytest")
HOST_WHEELS = (
    # the model code: transformers at the project's pin (the host's own is older) and what it requires
    "transformers", "huggingface_hub", "tokenizers", "safetensors", "regex", "pyyaml", "packaging", "tqdm",
    "httpx2", "httpcore2", "h11", "anyio", "truststore", "hf-xet", "idna", "click", "typer", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    "annotated-doc", "shellingham", "rich", "markdown-it-py", "mdurl", "pygments",
    "httpx", "httpcore",
    # the cloud service: gRPC, metrics, structured output, the fleet plane, GGUF presets
    "grpcio", "protobuf", "grpcio-health-checking", "grpcio-reflection", "prometheus_client", "llguidance",
    "aiomqtt", "paho-mqtt", "psutil", "gguf", "requests", "urllib3", "certifi", "charset-normalizer",
    "platformdirs", "accelerate",
    # the CUDA tests' runner
    "pytest", "pluggy", "iniconfig",
)
MAX_BUNDLE_MB = 64  # what the device tool carries with the working tree


class BundleBuildError(SprinterError, RuntimeError):
    """A wheel that could not be had, or a bundle too large to send along."""


@dataclass(frozen=True)
class Bundle:
    path: Path
    python_version: str
    wheels: tuple[str, ...]
    size_mb: float


def build_bundle(out: Path, python_version: str = "3.12") -> Bundle:
    """Download the wheels, copy the stubs and the project's dist-info into `out`; refuse a bundle past the limit."""
    pins = [f"{name}=={version(name)}" for name in HOST_WHEELS]
    wheels_dir = out / "wheels"
    shutil.rmtree(out, ignore_errors=True)
    wheels_dir.mkdir(parents=True)
    _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
         "--dest", str(wheels_dir), *pins)
    _copy_stubs(out / "stubs")
    _write_dist_info(out / "dist-info")
    wheels = tuple(sorted(path.name for path in wheels_dir.glob("*.whl")))
    (out / MANIFEST).write_text(json.dumps({"python_version": python_version, "wheels": wheels, "pins": pins},
                                           indent=1))
    size_mb = sum(path.stat().st_size for path in out.rglob("*") if path.is_file()) / 2**20
    if size_mb > MAX_BUNDLE_MB:
        raise BundleBuildError(f"the bundle is {size_mb:.1f} MiB, over the {MAX_BUNDLE_MB} MiB carried to a GPU host")
    return Bundle(out, python_version, wheels, size_mb)


def _pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise BundleBuildError(f"pip {args[0]} failed:\n{done.stderr.strip()[-2000:]}")


def _copy_stubs(stubs: Path) -> None:
    generated = sorted(STUBS.glob("*_pb2*.py"))
    if not generated:
        raise BundleBuildError(f"no generated stubs in {STUBS}: run 'make proto' first")
    target = stubs / "sprinter" / "v1"
    target.mkdir(parents=True)
    for init in (STUBS.parent / "__init__.py", STUBS / "__init__.py"):
        shutil.copyfile(init, stubs / init.relative_to(STUBS.parent.parent))
    for path in generated:
        shutil.copyfile(path, target / path.name)


def _write_dist_info(target: Path) -> None:
    """This project's dist-info as an install would write it, from pyproject.toml: its name, version and entry points
    (the `sprinter` script and every subcommand group), which is all `importlib.metadata` reads to find them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dist_info = target / f"{project['name']}-{project['version']}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = {"console_scripts": project.get("scripts", {})} | project.get("entry-points", {})
    (dist_info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items()) + "\n"
        for group, entries in groups.items()))
