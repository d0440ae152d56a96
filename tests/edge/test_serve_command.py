"""`sprinter edge serve --mode auto` needs a cloud to choose among its ways of using one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def test_mode_auto_without_a_cloud_is_refused_at_start_in_one_line() -> None:
    path = os.pathsep.join([str(ROOT), str(ROOT / "proto"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "common.cli", "edge", "serve", "--mode", "auto"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "--mode auto" in done.stderr.strip().splitlines()[-1]
