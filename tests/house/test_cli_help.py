"""`sprinter --help` answers at once: building the parser imports no torch, transformers, vLLM, ONNX Runtime, gRPC tools or numpy.

Each check runs in a fresh interpreter, so modules an earlier test imported cannot hide an import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "vllm", "onnxruntime", "grpc_tools", "numpy", "opentelemetry")

# Builds the parser, runs `--help` of every command and group under it, and reports what was imported.
PROBE = """
import argparse, contextlib, io, json, sys
import common.cli

def helps(parser, path):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield path + [name]
                yield from helps(sub, path + [name])

parser = common.cli.build_parser()
results = {}
for path in [[]] + list(helps(parser, [])):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            common.cli.build_parser().parse_args(path + ["--help"])
            code = None
        except SystemExit as exit:
            code = exit.code
    results[" ".join(path)] = code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
print(json.dumps({"helps": results, "heavy": heavy}))
"""


def _python_path() -> str:
    return os.pathsep.join([str(ROOT), str(ROOT / "proto"), os.environ.get("PYTHONPATH", "")])


@pytest.fixture(scope="module")
def probe() -> dict:
    code = f"HEAVY = {HEAVY!r}\n" + PROBE
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": _python_path()})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_building_the_parser_imports_nothing_heavy() -> None:
    code = (f"import sys, common.cli\ncommon.cli.build_parser()\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": _python_path()})
    assert done.returncode == 0, done.stderr
    assert "unavailable" not in done.stderr, done.stderr  # every subcommand registered
    assert done.stdout.strip() == "[]"


def test_every_help_exits_0(probe: dict) -> None:
    helps = probe["helps"]
    assert {"", "generate", "cloud serve", "edge serve", "simulate", "fleet", "link", "verifier", "bench"} <= set(helps)
    assert {path: code for path, code in helps.items() if code != 0} == {}


def test_help_imports_nothing_heavy(probe: dict) -> None:
    assert probe["heavy"] == []


@pytest.mark.parametrize("module", ["edge.generate_command", "cloud.command", "edge.serve_command",
                                    "edge.verifier_training.command", "sim.sweep.command", "common.fleet_plane.command",
                                    "sim.link.command", "sim.demo", "sim.fleet.command", "sim.local_fleet",
                                    "sim.fleet_demo", "sim.bench.settings.sweeps", "sim.bench.command"])
def test_command_module_imports_nothing_heavy(module: str) -> None:
    code = f"import sys, {module}\nprint(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": _python_path()})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
