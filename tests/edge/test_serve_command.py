"""`sprinter edge serve`'s default mode: whether to speculate is the daemon's choice when it has a cloud."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from edge.serve_command import default_mode

ROOT = Path(__file__).resolve().parents[2]


def test_with_a_cloud_the_daemon_chooses_whether_to_speculate_without_one_it_drafts() -> None:
    assert default_mode(["127.0.0.1:50051"]) == "auto"
    assert default_mode(None) == "sprinter-exact"  # verifies once a cloud is found (--mqtt), drafts alone until then


def test_mode_auto_without_a_cloud_is_refused_at_start_in_one_line() -> None:
    path = os.pathsep.join([str(ROOT), str(ROOT / "proto"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "common.cli", "edge", "serve", "--mode", "auto"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "--mode auto" in done.stderr.strip().splitlines()[-1]
