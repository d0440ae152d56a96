"""Lay a GPU bundle's wheels out as one site directory, with the standard library alone (run before anything else).

    python3 -m sim.gpu_check.unpack .gpu-bundle       # -> .gpu-bundle/site, then PYTHONPATH=.:.gpu-bundle/site

A wheel is a zip of what goes into site-packages, so unpacking it is the install (its console scripts
aside, which the check does not run). pip is not needed, nor a build backend, nor the network. The
bundle's own `site/` is written afresh whenever its wheels change (a stamp names them). A bundle made
for another Python than the one running this is refused here, in one line, before any import fails.
"""

from __future__ import annotations

import json
import shutil
import sys
import zipfile
from pathlib import Path

from common.errors import SprinterError  # the standard library alone, like this module

MANIFEST = "manifest.json"  # what wheelhouse.py wrote: the Python it targeted and the wheels, stubs and dist-info


class BundleError(SprinterError, RuntimeError):
    """A bundle that is missing, or made for another Python."""


def read_manifest(bundle: Path) -> dict:
    path = bundle / MANIFEST
    if not path.exists():
        raise BundleError(f"no {path}: build the bundle with 'make gpu-bundle' where PyPI is reachable, "
                          "and send its folder along with the working tree")
    return json.loads(path.read_text())


def unpack(bundle: Path) -> Path:
    """`bundle`/site holding every wheel, the gRPC stubs and the project's entry points; returns it."""
    manifest = read_manifest(bundle)
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python_version"] != running:
        raise BundleError(f"the bundle's wheels are for Python {manifest['python_version']}, this is Python {running}: "
                          f"rebuild it with 'make gpu-bundle GPU_PYTHON_VERSION={running}'")
    site, stamp = bundle / "site", bundle / "site" / ".unpacked"
    wanted = json.dumps(sorted(manifest["wheels"]))
    if stamp.exists() and stamp.read_text() == wanted:
        return site
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    for wheel in manifest["wheels"]:
        _unpack_wheel(bundle / "wheels" / wheel, site)
    for tree in ("stubs", "dist-info"):  # sprinter/v1/*_pb2*.py; sprinter-*.dist-info (entry points)
        shutil.copytree(bundle / tree, site, dirs_exist_ok=True)
    stamp.write_text(wanted)
    return site


def _unpack_wheel(wheel: Path, site: Path) -> None:
    """The wheel's files into `site`; its `*.data/purelib|platlib` trees too, where pip would put them."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            parts = Path(member.filename).parts
            if member.is_dir() or ".." in parts:
                continue
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue  # scripts and headers: nothing the check runs
                parts = parts[2:]
            target = site.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as source, open(target, "wb") as sink:
                shutil.copyfileobj(source, sink)
            if member.external_attr >> 16 & 0o111:
                target.chmod(0o755)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 -m sim.gpu_check.unpack BUNDLE", file=sys.stderr)
        return 2
    try:
        print(unpack(Path(argv[0])))
    except BundleError as err:
        print(f"gpu-check: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
