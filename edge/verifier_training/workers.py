"""`sprinter verifier collect|train --workers N`: N collecting processes on one data directory.

Each process runs the same command with `--worker I` and collects every N-th shard from the I-th
(edge/verifier_training/collect.py; `train` then only collects: the command that started the
workers trains once they are done). When the machine has a core for each, a worker is pinned to core I
with one thread, so that the workers do not contend for cores. A worker that fails stops the rest.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


def worker_command(argv: list[str], index: int) -> list[str]:
    """This process's command line for worker `index` (its --workers kept: it names the stride)."""
    return [sys.executable, "-m", "common.cli", *argv, "--worker", str(index), "--threads", "1"]


def _pinned(core: int | None):
    if core is None:
        return None
    return lambda: os.sched_setaffinity(0, {core})


def run_workers(workers: int, data_dir: Path, argv: list[str]) -> None:
    """Start the workers (`argv`: this command's arguments), wait for all of them; raise SystemExit naming the
    first that failed."""
    cores = sorted(os.sched_getaffinity(0))
    pin = len(cores) >= workers
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen(worker_command(argv, i), env=environment,
                                  preexec_fn=_pinned(cores[i] if pin else None)) for i in range(workers)]
    log.info("collecting into %s with %d workers%s", data_dir, workers, " (one core each)" if pin else "")
    try:
        while any(p.poll() is None for p in processes):
            failed = [i for i, p in enumerate(processes) if p.returncode not in (None, 0)]
            if failed:
                raise SystemExit(f"collection worker {failed[0]} failed (exit code {processes[failed[0]].returncode})")
            time.sleep(1.0)
        failed = [i for i, p in enumerate(processes) if p.returncode != 0]
        if failed:
            raise SystemExit(f"collection worker {failed[0]} failed (exit code {processes[failed[0]].returncode})")
    finally:
        for p in processes:
            if p.poll() is None:
                p.terminate()
        for p in processes:
            p.wait()
