"""ONNX Runtime sessions, made one way for every model the edge runs (the draft and the verifier).

The provider choice: CUDA when this onnxruntime build has it (onnxruntime-gpu), with the CPU for
the ops it lacks; the CPU alone otherwise.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import onnxruntime as ort

log = logging.getLogger(__name__)

OPTIMIZATION_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def providers() -> list[str]:
    """CUDA when this onnxruntime build has it, with the CPU for the ops it lacks; else the CPU."""
    if "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def available_cores() -> int:
    """Cores this process may run on (a container's CPU set, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def make_session(onnx_path: Path, threads: int | None = None, optimization: str = "all",
                 session_providers: list[str] | None = None) -> ort.InferenceSession:
    """An InferenceSession with `threads` intra-op threads (default: every core)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or available_cores()
    options.inter_op_num_threads = 1  # one sequential graph: a second pool would only compete for cores
    options.graph_optimization_level = OPTIMIZATION_LEVELS[optimization]
    # Idle ORT workers spin for a while after each run; beside torch (the target in the same process,
    # or the cloud on the same cores) that spinning steals the cores the target needs. Measured on
    # the Qwen pair in one process: target forwards ran ~5x slower with spinning on.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(onnx_path), options, providers=session_providers or providers())
    log.info("ONNX Runtime session on %s (%d threads, optimization %s)", session.get_providers()[0],
             options.intra_op_num_threads, optimization)
    return session
