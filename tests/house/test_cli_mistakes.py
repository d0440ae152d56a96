"""A newcomer's mistakes get one clear line and exit code 2, never a traceback (each in a fresh `sprinter`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MISTAKES = [
    (["cloud", "serve", "--port", "99999"], "--port"),
    (["cloud", "serve", "--port", "http"], "--port"),
    (["cloud", "serve", "--metrics-port", "0"], "--metrics-port"),
    (["cloud", "serve", "--advertise", "host:70000"], "--advertise"),
    (["cloud", "serve", "--mqtt", "mqtt://broker:99999"], "--mqtt"),
    (["edge", "serve", "--listen", "127.0.0.1:99999"], "--listen"),
    (["generate", "--prompt", "hi", "--cloud", "127.0.0.1:99999"], "--cloud"),
    (["generate", "--prompt", "hi", "--cloud", "nowhere"], "--cloud"),
    (["generate", "--prompt", "hi", "--mode", "fast"], "--mode"),
    (["generate", "--prompt", "hi", "--k", "five"], "--k"),
    (["simulate", "--rtt-ms", "abc"], "--rtt-ms"),
    (["simulate", "--rtt-ms", "10,x"], "--rtt-ms"),
    (["simulate", "--mqtt", "tcp://broker"], "--mqtt"),
    (["verifier", "replay", "--data", "d", "--verifier", "v", "--out", "o", "--draft-ms", "1", "--verify-ms", "1",
      "--verify-per-token-ms", "1", "--rtt-ms", "1,two"], "--rtt-ms"),
    (["fleet", "status", "--mqtt", "mqtt://broker:0"], "--mqtt"),
    (["link", "--upstream", "127.0.0.1:notaport"], "--upstream"),
    (["link", "--upstream", "127.0.0.1:99999"], "--upstream"),
    (["link", "--upstream", "127.0.0.1:50051", "--listen", "127.0.0.1:70000"], "--listen"),
    (["fleet", "simulate", "--demo", "--edges", "10,many"], "--edges"),
    (["fleet", "simulate", "--demo", "--pipeline", ","], "--pipeline"),
    (["bench", "local", "--temperatures", "hot"], "--temperatures"),
    (["bench", "cloud", "--edges", "1,x"], "--edges"),
    (["bench", "fleet", "--layouts", "one-core,three-cores"], "--layouts"),
    (["bench", "soak", "--temperatures", "0,warm"], "--temperatures"),
    (["bench", "dashboards", "--scrape-s", "0"], "--scrape-s"),
    (["bench", "chaos", "--kill-after-s", "0.3,soon"], "--kill-after-s"),
    (["bench", "pipeline", "--sweep", "results/pipeline", "--rtt-ms", "20,fast"], "--rtt-ms"),
]


def sprinter(*args: str, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT), str(ROOT / "proto"), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "common.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": path, **env})


def _refused(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    assert done.returncode == 2, done.stderr
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "flag"), MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_a_bad_value_names_its_flag(argv: list[str], flag: str) -> None:
    assert f"argument {flag}" in _refused(sprinter(*argv))


@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_an_unknown_model_is_one_line_listing_the_presets(flag: str) -> None:
    # Offline like this machine: the hub is not tried (that would wait out its retries), the answer is the same.
    line = _refused(sprinter("generate", "--prompt", "hi", flag, "no-such-model", HF_HUB_OFFLINE="1"))
    assert line.startswith("sprinter: error: model 'no-such-model' is neither a preset (tiny-random")
