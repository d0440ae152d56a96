"""Export a draft LM to ONNX once, with its KV cache as explicit inputs and outputs, and cache the file.

Graph interface (b sequences of one length, no padding, so no attention mask: positions and the causal mask are
derived inside the graph from the past length). b is 1 but for a draft tree's branches at one point, drafted side by
side (`OnnxCachedLM.advance_batch`):

    inputs   input_ids        int64   [b, n]        the tokens not yet in the cache
             logits_index     int64   [k]           which of those n positions go through the LM head
             past_key_i       float32 [b, kv_heads, past, head_dim]   per layer i (past may be 0)
             past_value_i     float32 [b, kv_heads, past, head_dim]
    outputs  logits           float32 [b, k, V]
             hidden           float32 [b, n, H]     last hidden state, after the final norm
             present_key_i    float32 [b, kv_heads, past + n, head_dim]
             present_value_i  float32 [b, kv_heads, past + n, head_dim]

`logits_index` exists for the same reason as `logits_to_keep` in `CachedLM`: on a prompt, the LM head
over every position would cost more than the whole decoder stack.

Choices (see the module docstring of `edge.runtime.onnx_draft` for the runtime side):
- Exporter: `torch.onnx.export(dynamo=True)` (torch.export + onnxscript). The TorchScript exporter
  also runs, but it traces Python branches in transformers' mask code with the example shapes; the
  dynamo exporter keeps `n` and `past` symbolic, so one graph serves prefill, decode and past = 0.
- Dtype: float32. ONNX Runtime's CPU provider has no bfloat16 MatMul (NOT_IMPLEMENTED) and its
  float16 MatMul is slower than float32 on this x86 CPU (a [1,896]x[896,65536] MatMul: ~5 ms float32,
  ~6 ms float16; see `sprinter bench draft`), so half precision would cost accuracy and Casts for
  nothing. A bf16-loaded model is upcast (exactly) to a float32 copy for export and verification.
- Optional quantisation (`weights="int8"`, `"int4"` or `"w8a8"`, edge/onnx_export/quantize.py): MatMul
  weights become ORT MatMulNBits blocks with int8 compute, or (w8a8) per-channel int8 on ORT's integer GEMM. A draft step reads every weight once, so it is
  memory-bandwidth bound and smaller weights are the only big lever left; but the logits then differ from the
  torch model (a different draft, not a faster copy of the same one), so a quantised export is checked by
  greedy agreement with torch rather than by a logit bound (edge/onnx_export/verify.py). Derived from the
  float32 export, cached next to it as `<key>-int8` or `<key>-int4-r<recipe version>`; w8a8 from an export of a
  SmoothQuant copy (edge/onnx_export/smooth.py), as `<key>-w8a8-r<recipe version>`.
- Post-processing: onnxscript's ORT fusions (RMSNorm, skip-RMSNorm, rotary, attention ->
  com.microsoft ops; CUDA has them too). Measured interleaved on CPU: SmolLM2-135M 15.8 -> 14.1
  ms/token (30 layers of small matrices: per-node overhead is a visible share), Qwen2.5-0.5B no
  change (~39.6 ms both: weight bandwidth dominates). Modest, but free at run time; `fuse=False`
  skips it (and its ~10 s at export). Then grouped-query attention becomes grouped MatMuls over the KV heads
  (edge/onnx_export/gqa.py): the fused `MultiHeadAttention` had every row copy its past several times a step,
  most of what a step's 2nd and 3rd row side by side cost.
- Cache key: sha256 over the export format version, torch/transformers/onnxscript versions, the
  fusion flag, the model config (minus its dtype) and every state-dict entry (name, shape and all of
  its bytes as float32). Hashing every byte takes ~1.5 s for Qwen2.5-0.5B, cheap next to a 60 s
  export, and the key changes whenever any weight changes; a checkpoint loaded in bf16 or in float32
  maps to the same export. Quantised exports live next to their source under `<key>-<weights>`.
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

from common.model.loading import LoadedModel, cache_root
from edge.onnx_export.quantize import DATA_FILE, RECIPES, WEIGHT_FORMATS, quantize_weights
from edge.onnx_export.smooth import smoothed_copy
from edge.onnx_export.verify import DraftExportError, check_quantised, verify_export

log = logging.getLogger(__name__)

# Bump when the graph interface or the export recipe changes: old cache entries then stop matching.
# 2: a batch axis (a tree's branches side by side); 3: GroupQueryAttention; 4: grouped MatMuls instead (gqa.py)
EXPORT_FORMAT_VERSION = 4
MODEL_FILE = "model.onnx"
INFO_FILE = "export.json"
# Example sizes for tracing: all distinct and > 1, so torch.export specialises none of them.
_EXAMPLE_NEW, _EXAMPLE_PAST, _EXAMPLE_KEEP, _EXAMPLE_BATCH = 3, 7, 2, 4


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
        # Unpadded sequences of one length: positions continue from the cache (the same in every row, broadcast),
        # and the causal mask needs nothing else.
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
    """Cache key of the export: changes with the config, any weight, the exporter versions or options.

    Weights are hashed as float32 (what the export holds) and the config without its dtype, so a
    bf16 checkpoint loaded in bf16 or in float32 maps to the same export.
    """
    import onnxscript
    import transformers

    digest = hashlib.sha256()
    header = dict(format=EXPORT_FORMAT_VERSION, torch=torch.__version__, transformers=transformers.__version__,
                  onnxscript=onnxscript.__version__, fuse=fuse)
    digest.update(json.dumps(header, sort_keys=True).encode())
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("dtype", "torch_dtype")}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        values = tensor.detach().float() if tensor.is_floating_point() else tensor.detach()
        digest.update(f"{name}|{values.dtype}|{tuple(values.shape)}".encode())
        # A uint8 view: hashlib wants a contiguous buffer of bytes.
        digest.update(values.contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:32]


def export_dir(model: PreTrainedModel, fuse: bool = True) -> Path:
    return cache_root() / "onnx" / model_fingerprint(model, fuse)


def export_draft(loaded: LoadedModel, fuse: bool = True, verify: bool = True, weights: str = "float32") -> Path:
    """Path of the model's ONNX export, exporting it on first use (Qwen2.5-0.5B: about a minute).

    `fuse` applies ONNX Runtime's fused ops (RMSNorm, rotary, attention); `verify` checks the graph against
    torch before the file is cached (float32: logits and hidden states; quantised: greedy agreement, see
    edge/onnx_export/verify.py); `weights` other than float32 quantises the MatMul weights of the float32
    export (lossy; see the module docstring).
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, not {weights!r}")
    if weights != "float32":
        return _quantized_export(loaded, fuse, verify, weights)
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
        fp32 = float32_model(loaded.model)
        stages = _export_to(fp32, staging / MODEL_FILE, fuse)
        errors = None
        if verify:
            with _stage("verify against torch", stages):
                errors = verify_export(fp32, staging / MODEL_FILE)
        _write_info(staging / INFO_FILE, loaded, fuse, stages, "float32", errors)
        _publish(staging, target)
    log.info("ONNX export of %s done in %.1f s: %s", loaded.spec, time.perf_counter() - started, path)
    return path


def _quantized_export(loaded: LoadedModel, fuse: bool, verify: bool, weights: str) -> Path:
    """The float32 export with its MatMul weights quantised to `weights`, made on first use (w8a8: from an export of
    the SmoothQuant copy, made in the staging directory and dropped there)."""
    recipe = RECIPES.get(weights)
    suffix = f"{weights}-r{recipe[1]}" if recipe else weights
    source = None if weights == "w8a8" else export_draft(loaded, fuse, verify)
    float32_dir = source.parent if source else export_dir(loaded.model, fuse)
    target = float32_dir.with_name(f"{float32_dir.name}-{suffix}")
    path = target / MODEL_FILE
    if path.exists():
        log.info("ONNX draft for %s (%s weights): cached at %s", loaded.spec, weights, path)
        return path
    log.info("quantising the ONNX draft of %s to %s weights once; cached in %s", loaded.spec, weights, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    stages: dict[str, float] = {}
    with _staging_dir(target) as staging, _quiet_exporter_logs():
        source = source or _smoothed_export(loaded, fuse, staging / "smoothed", stages)
        with _stage(f"quantise MatMul weights to {weights}", stages):
            quantize_weights(source, staging / MODEL_FILE, weights)
        shutil.rmtree(staging / "smoothed", ignore_errors=True)
        errors = None
        if verify:
            with _stage("check greedy agreement with torch", stages):
                errors = check_quantised(float32_model(loaded.model), loaded.tokenizer, staging / MODEL_FILE, weights)
        _write_info(staging / INFO_FILE, loaded, fuse, stages, weights, errors)
        _publish(staging, target)
    return path


def _smoothed_export(loaded: LoadedModel, fuse: bool, folder: Path, stages: dict[str, float]) -> Path:
    """The float32 export of a SmoothQuant copy of the model in `folder` (w8a8's source; not cached)."""
    _check_supported(loaded.model)
    with _stage("fold SmoothQuant's scales into a float32 copy", stages):
        smoothed = smoothed_copy(loaded.model, loaded.tokenizer)
    folder.mkdir()
    _export_to(smoothed, folder / MODEL_FILE, fuse, stages)
    return folder / MODEL_FILE


def float32_model(model: PreTrainedModel) -> PreTrainedModel:
    """The model itself if it is float32, else a float32 copy (exact for bf16 and fp16 weights)."""
    if all(p.dtype == torch.float32 for p in model.parameters()):
        return model
    log.info("making a float32 copy of the model for export")
    return copy.deepcopy(model).float()


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
    names = ("onnx_ir", "onnxscript", "torch.onnx", "torch.export", "onnxruntime.quantization")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    # ORT's dynamic quantiser logs a line per tensor through the root logger itself; a filter on the root logger
    # sees only those records (ours reach its handlers by propagation, past it).
    root_quiet = _BelowError()
    logging.getLogger().addFilter(root_quiet)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=UserWarning)
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.simplefilter("ignore", category=DeprecationWarning)
            yield
    finally:
        logging.getLogger().removeFilter(root_quiet)
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextmanager
def _stage(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Log a stage's start and end: an export is long enough that silence looks like a hang."""
    log.info("ONNX export [%d] %s ...", len(timings) + 1, name)
    t0 = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - t0, 2)
    log.info("ONNX export [%d] %s done in %.1f s", len(timings), name, timings[name])


def _export_to(model: PreTrainedModel, path: Path, fuse: bool, stages: dict[str, float] | None = None
               ) -> dict[str, float]:
    """Export `model` to `path`; returns `stages` (a new dict if None) with each stage's seconds added."""
    import onnx_ir as ir

    stages = {} if stages is None else stages
    wrapper = _FlatCacheLM(model).eval()
    args, dynamic_shapes = _example_inputs(model)
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
    if fuse:
        with _stage("grouped-query attention as grouped MatMuls", stages):
            _rewrite_attention(path)
    return stages


def _rewrite_attention(path: Path) -> None:
    """`edge.onnx_export.gqa` on the saved graph: it reads the graph alone, and saving it keeps the weights' file."""
    import onnx

    from edge.onnx_export.gqa import grouped_attention

    model = onnx.load(str(path), load_external_data=False)
    if grouped_attention(model):
        onnx.save(model, str(path))


def _example_inputs(model: PreTrainedModel) -> tuple[tuple, tuple]:
    from torch.export import Dim

    kv_heads, head_dim = kv_shape(model)
    n_layers = model.config.num_hidden_layers
    input_ids = torch.randint(0, model.config.vocab_size, (_EXAMPLE_BATCH, _EXAMPLE_NEW))
    logits_index = torch.arange(_EXAMPLE_NEW - _EXAMPLE_KEEP, _EXAMPLE_NEW)
    past = tuple(torch.zeros(_EXAMPLE_BATCH, kv_heads, _EXAMPLE_PAST, head_dim) for _ in range(2 * n_layers))
    batch, new, keep, past_len = Dim("batch", min=1), Dim("n", min=1), Dim("k", min=1), Dim("past", min=0)
    dynamic_shapes = ({0: batch, 1: new}, {0: keep}, tuple({0: batch, 2: past_len} for _ in past))
    return (input_ids, logits_index, *past), dynamic_shapes


def _write_info(path: Path, loaded: LoadedModel, fuse: bool, stages: dict[str, float], weights: str,
                errors: dict[str, float] | None) -> None:
    kv_heads, head_dim = kv_shape(loaded.model)
    info = dict(
        spec=loaded.spec, format=EXPORT_FORMAT_VERSION, dtype="float32", weights=weights, fuse=fuse, torch=torch.__version__,
        n_layers=loaded.model.config.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim,
        hidden_size=loaded.model.config.hidden_size, vocab_size=loaded.vocab_size, export_seconds=stages,
        verify=errors,
        recipe=RECIPES[weights][0] if weights in RECIPES else None,
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
    # mkdtemp (and onnx.save's data file) are private; the cache is as readable as the rest of cache_root().
    staging.chmod(0o755)
    for file in staging.iterdir():
        file.chmod(0o644)
    try:
        os.rename(staging, target)
    except OSError:
        if not (target / MODEL_FILE).exists():
            raise
        log.info("another process exported %s meanwhile; keeping its copy", target.name)


def read_export_info(onnx_path: Path) -> dict:
    """The sidecar written at export time (spec, shapes, stage timings)."""
    return json.loads((Path(onnx_path).parent / INFO_FILE).read_text())
