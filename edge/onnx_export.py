"""Export a draft LM to ONNX once, with its KV cache as explicit inputs and outputs, and cache the file.

Graph interface (one sequence, no padding, so no attention mask: positions and the causal mask are
derived inside the graph from the past length):

    inputs   input_ids        int64   [1, n]        the tokens not yet in the cache
             logits_index     int64   [k]           which of those n positions go through the LM head
             past_key_i       float32 [1, kv_heads, past, head_dim]   per layer i (past may be 0)
             past_value_i     float32 [1, kv_heads, past, head_dim]
    outputs  logits           float32 [1, k, V]
             hidden           float32 [1, n, H]     last hidden state, after the final norm
             present_key_i    float32 [1, kv_heads, past + n, head_dim]
             present_value_i  float32 [1, kv_heads, past + n, head_dim]

`logits_index` exists for the same reason as `logits_to_keep` in `CachedLM`: on a prompt, the LM head
over every position would cost more than the whole decoder stack.

Choices (see the module docstring of `edge.onnx_draft` for the runtime side):
- Exporter: `torch.onnx.export(dynamo=True)` (torch.export + onnxscript). The TorchScript exporter
  also runs, but it traces Python branches in transformers' mask code with the example shapes; the
  dynamo exporter keeps `n` and `past` symbolic, so one graph serves prefill, decode and past = 0.
- Dtype: float32. ONNX Runtime's CPU provider has no bfloat16 MatMul and its float16 MatMul is no
  faster than float32 on x86 (measured: 0.55 ms both for a 896x4864 matvec), so lower precision
  would only add Casts. A bf16-loaded model is upcast (exactly) to float32 for export.
- Post-processing: onnxscript's ORT fusions (RMSNorm, skip-RMSNorm, rotary, attention ->
  com.microsoft ops). On CPU they cut Qwen2.5-0.5B decode from ~85 to ~55 ms/token: the graph is
  thousands of tiny nodes, and per-node overhead is a real share of a 1-token step.
- Cache key: sha256 over the export format version, torch/transformers/onnxscript versions, the
  fusion flag, the model config JSON and every state-dict entry (name, dtype, shape and all of its
  bytes). Hashing every byte is ~1 s for 0.5B parameters, cheap next to a 60 s export, and it changes
  whenever any weight changes. The same checkpoint loaded in bf16 and in float32 hashes differently
  (different bytes) and is exported twice; harmless.
- Atomicity: everything is written to a sibling temporary directory, which is renamed into place;
  a directory that exists under the final name is complete. A concurrent exporter that loses the
  rename race discards its copy.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from transformers import DynamicCache, PreTrainedModel

from common.models import LoadedModel, cache_root

log = logging.getLogger(__name__)

# Bump when the graph interface or the export recipe changes: old cache entries then stop matching.
EXPORT_FORMAT_VERSION = 1
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"  # weights live outside the protobuf (its limit is 2 GB)
INFO_FILE = "export.json"
# Example sizes for tracing: all distinct and > 1, so torch.export specialises none of them.
_EXAMPLE_NEW, _EXAMPLE_PAST, _EXAMPLE_KEEP = 3, 7, 2


class DraftExportError(RuntimeError):
    """The model cannot be exported, or the exported graph disagrees with torch."""


def input_names(n_layers: int) -> list[str]:
    return ["input_ids", "logits_index"] + [f"past_{kv}_{i}" for i in range(n_layers) for kv in ("key", "value")]


def output_names(n_layers: int) -> list[str]:
    return ["logits", "hidden"] + [f"present_{kv}_{i}" for i in range(n_layers) for kv in ("key", "value")]


class _FlatCacheLM(torch.nn.Module):
    """The causal LM with its KV cache flattened into tensors, which is what an ONNX graph can carry."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model
        self.n_layers = model.config.num_hidden_layers

    def forward(self, input_ids: torch.Tensor, logits_index: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(self.n_layers)]
        cache = DynamicCache(pairs, config=self.model.config)
        # One unpadded sequence: positions continue from the cache, and the causal mask needs nothing else.
        position_ids = (torch.arange(input_ids.shape[1]) + past[0].shape[2]).unsqueeze(0)
        out = self.model.model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True)
        hidden = out.last_hidden_state
        logits = self.model.lm_head(hidden.index_select(1, logits_index))
        presents = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        return (logits, hidden, *presents)


def kv_shape(model: PreTrainedModel) -> tuple[int, int]:
    """(kv_heads, head_dim) of the model's attention layers."""
    attention = model.model.layers[0].self_attn
    return model.config.num_key_value_heads, attention.head_dim


def model_fingerprint(model: PreTrainedModel, fuse: bool = True) -> str:
    """Cache key of the export: changes with the config, any weight, the exporter versions or options."""
    import onnxscript
    import transformers

    digest = hashlib.sha256()
    header = dict(format=EXPORT_FORMAT_VERSION, torch=torch.__version__, transformers=transformers.__version__,
                  onnxscript=onnxscript.__version__, fuse=fuse)
    digest.update(json.dumps(header, sort_keys=True).encode())
    digest.update(model.config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        # uint8 view: numpy has no bfloat16, and hashlib wants a contiguous buffer.
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:32]


def export_dir(model: PreTrainedModel, fuse: bool = True) -> Path:
    return cache_root() / "onnx" / model_fingerprint(model, fuse)


def export_draft(loaded: LoadedModel, fuse: bool = True, verify: bool = True) -> Path:
    """Path of the model's ONNX export, exporting it on first use (Qwen2.5-0.5B: about a minute).

    `fuse` applies ONNX Runtime's fused ops (RMSNorm, rotary, attention); `verify` compares one
    prefill and one decode step against torch before the file is cached.
    """
    started = time.perf_counter()
    target = export_dir(loaded.model, fuse)
    path = target / MODEL_FILE
    if path.exists():
        log.info("ONNX draft for %s: cached at %s", loaded.spec, path)
        return path
    _check_supported(loaded.model)
    log.info("exporting %s to ONNX once (float32, fuse=%s); cached in %s", loaded.spec, fuse, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _staging_dir(target) as staging, _quiet_exporter_logs():
        stages = _export_to(loaded.model, staging / MODEL_FILE, fuse)
        if verify:
            with _stage("verify against torch", stages):
                verify_export(loaded.model, staging / MODEL_FILE)
        _write_info(staging / INFO_FILE, loaded, fuse, stages)
        _publish(staging, target)
    log.info("ONNX export of %s done in %.1f s: %s", loaded.spec, time.perf_counter() - started, path)
    return path


def _check_supported(model: PreTrainedModel) -> None:
    """The graph keeps every past position: sliding-window or hybrid caches would need other logic."""
    if model.config.model_type not in ("llama", "qwen2"):
        log.warning("ONNX export is tested on llama and qwen2 only, not %s", model.config.model_type)
    layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise DraftExportError(f"only full-attention layers can be exported, not {sorted(layer_types)}")


@contextmanager
def _quiet_exporter_logs() -> Iterator[None]:
    """The exporter's libraries log every pass at INFO (onnx_ir with stack traces) and warn about
    deprecations and torchvision; our stage lines are the progress report, so raise theirs to ERROR."""
    loggers = [logging.getLogger(name) for name in ("onnx_ir", "onnxscript", "torch.onnx", "torch.export")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=UserWarning)
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.simplefilter("ignore", category=DeprecationWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextmanager
def _stage(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Log a stage's start and end: an export is long enough that silence looks like a hang."""
    log.info("ONNX export [%d] %s ...", len(timings) + 1, name)
    t0 = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - t0, 2)
    log.info("ONNX export [%d] %s done in %.1f s", len(timings), name, timings[name])


def _export_to(model: PreTrainedModel, path: Path, fuse: bool) -> dict[str, float]:
    import onnx_ir as ir

    stages: dict[str, float] = {}
    with _stage("prepare float32 copy", stages):
        fp32 = model if all(p.dtype == torch.float32 for p in model.parameters()) else copy.deepcopy(model).float()
        wrapper = _FlatCacheLM(fp32).eval()
        args, dynamic_shapes = _example_inputs(fp32)
    n_layers = wrapper.n_layers
    with _stage("torch.export + translate to ONNX", stages), torch.no_grad():
        program = torch.onnx.export(
            wrapper, args, dynamo=True, input_names=input_names(n_layers), output_names=output_names(n_layers),
            dynamic_shapes=dynamic_shapes, optimize=True, verbose=False,
        )
    onnx_model = program.model
    if fuse:
        with _stage("fuse ops for ONNX Runtime", stages):
            from onnxscript.rewriter.ort_fusions import optimize_for_ort

            onnx_model, counts = optimize_for_ort(onnx_model)
            log.info("fusions applied: %s", {k: v for k, v in counts.items() if v})
    with _stage("save", stages):
        ir.save(onnx_model, path, external_data=DATA_FILE)
    return stages


def _example_inputs(model: PreTrainedModel) -> tuple[tuple, tuple]:
    from torch.export import Dim

    kv_heads, head_dim = kv_shape(model)
    n_layers = model.config.num_hidden_layers
    input_ids = torch.randint(0, model.config.vocab_size, (1, _EXAMPLE_NEW))
    logits_index = torch.arange(_EXAMPLE_NEW - _EXAMPLE_KEEP, _EXAMPLE_NEW)
    past = tuple(torch.zeros(1, kv_heads, _EXAMPLE_PAST, head_dim) for _ in range(2 * n_layers))
    new, keep, past_len = Dim("n", min=1), Dim("k", min=1), Dim("past", min=0)
    dynamic_shapes = ({1: new}, {0: keep}, tuple({2: past_len} for _ in past))
    return (input_ids, logits_index, *past), dynamic_shapes


def verify_export(model: PreTrainedModel, path: Path, tolerance: float = 1e-3) -> None:
    """Prefill 5 tokens then decode 1 through ONNX Runtime and torch; raise if logits or hidden differ.

    The tolerance is relative to the largest logit: fused kernels sum in a different order.
    """
    from edge.onnx_draft import OnnxCachedLM
    from common.cached_lm import CachedLM

    torch_lm, onnx_lm = CachedLM(model, with_hidden=True), OnnxCachedLM(path, with_hidden=True)
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, model.config.vocab_size, (6,), generator=generator).tolist()
    for length in (5, 6):
        ref, got = torch_lm.advance_to(context[:length], 2), onnx_lm.advance_to(context[:length], 2)
        for what, a, b in (("logits", ref.logits, got.logits), ("hidden", ref.hidden.float(), got.hidden)):
            error = float((a - b).abs().max() / a.abs().max().clamp(min=1e-6))
            if not error <= tolerance:
                raise DraftExportError(f"ONNX export disagrees with torch on {what}: relative error {error:.2e}")


def _write_info(path: Path, loaded: LoadedModel, fuse: bool, stages: dict[str, float]) -> None:
    kv_heads, head_dim = kv_shape(loaded.model)
    info = dict(
        spec=loaded.spec, format=EXPORT_FORMAT_VERSION, dtype="float32", fuse=fuse, torch=torch.__version__,
        n_layers=loaded.model.config.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim,
        hidden_size=loaded.model.config.hidden_size, vocab_size=loaded.vocab_size, export_seconds=stages,
        created=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    path.write_text(json.dumps(info, indent=2))


@contextmanager
def _staging_dir(target: Path) -> Iterator[Path]:
    """A temporary directory next to `target` (same filesystem, so the final rename is atomic)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, target: Path) -> None:
    try:
        os.rename(staging, target)
    except OSError:
        if not (target / MODEL_FILE).exists():
            raise
        log.info("another process exported %s meanwhile; keeping its copy", target.name)


def read_export_info(onnx_path: Path) -> dict:
    """The sidecar written at export time (spec, shapes, stage timings)."""
    return json.loads((Path(onnx_path).parent / INFO_FILE).read_text())
