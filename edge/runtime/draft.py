"""The draft's runtime, chosen once per process: ONNX Runtime over a cached export, llama.cpp over the draft's
GGUF (edge/runtime/llama_cpp_draft.py), or torch (the reference).

This module sits above both the exporter (edge/onnx_export/) and the ONNX runtime (edge/runtime/onnx_draft.py),
so that neither needs the other's help: the export is checked with the runtime, and the runtime
never exports.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from common.errors import PairMismatch
from common.model.cached_lm import CachedLM, DraftLM
from common.model.loading import LoadedModel, gguf_file
from edge.runtime.draft_choice import RUNTIMES, runtime_weights
from edge.runtime.draft_reuse import DraftKVCache, ReusingDraftLM
from edge.runtime.llama_cpp_draft import LlamaCppDraftLM, LlamaCppDraftModel
from edge.runtime.onnx_draft import OnnxCachedLM, OnnxDraftModel, session_device
from edge.onnx_export.export import export_draft

log = logging.getLogger(__name__)

__all__ = ["RUNTIMES", "draft_lm_factory", "exported_draft", "llama_cpp_draft", "load_draft_runtime"]


def exported_draft(loaded: LoadedModel, threads: int | None = None, weights: str = "float32",
                   **options: object) -> OnnxDraftModel:
    """The model's export (made on first use, then cached on disk) in a new session."""
    model = OnnxDraftModel(export_draft(loaded, weights=weights), threads=threads, **options)
    if weights == "w8a8" and session_device(model.session) == "cuda":
        log.warning("--draft-weights w8a8 is made for the CPU's integer GEMM (ONNX Runtime's DynamicQuantizeMatMul) "
                    "and is not measured on a GPU, where its ops may fall back to the CPU; there take int8 or int4")
    return model


def llama_cpp_draft(loaded: LoadedModel, threads: int | None = None) -> LlamaCppDraftModel:
    """The GGUF behind `loaded` on llama.cpp (a GGUF preset or a .gguf path: `gguf_file` refuses anything else),
    checked to score the vocabulary `loaded` scores."""
    model = LlamaCppDraftModel(gguf_file(loaded.spec), threads=threads)
    if model.vocab_size != loaded.vocab_size:
        raise PairMismatch(f"{loaded.spec}'s GGUF scores {model.vocab_size} tokens, its loaded model "
                           f"{loaded.vocab_size}: the llama.cpp draft would not fit the rows the rest expects")
    return model


def load_draft_runtime(loaded: LoadedModel, runtime: str = "onnx", threads: int | None = None,
                       with_hidden: bool = False, weights: str | None = None,
                       **onnx_options: object) -> CachedLM | OnnxCachedLM | LlamaCppDraftLM:
    """The draft's cached runtime: ONNX Runtime (exported on first use), llama.cpp on the GGUF, or the torch
    reference.

    `threads`: ONNX Runtime's intra-op pool or llama.cpp's threads (default every core); for torch, when given,
    it calls `torch.set_num_threads`, which is process-wide. `weights` (ONNX only; default float32, the exact
    export): `"int8"`, `"int4"` or `"w8a8"` selects a quantised export (faster, but a slightly different draft);
    llama.cpp refuses any (`DraftWeightsNotApplicable`). `onnx_options` go to `OnnxDraftModel`.
    """
    weights = runtime_weights(runtime, weights, onnx_default="float32")
    if runtime == "torch":
        if threads is not None:
            torch.set_num_threads(threads)
        return CachedLM(loaded.model, with_hidden=with_hidden)
    if runtime == "llama.cpp":
        return llama_cpp_draft(loaded, threads).new_lm(with_hidden)
    if runtime != "onnx":
        raise ValueError(f"unknown draft runtime {runtime!r}; expected one of {RUNTIMES}")
    return exported_draft(loaded, threads=threads, weights=weights, **onnx_options).new_lm(with_hidden)


def draft_lm_factory(loaded: LoadedModel, runtime: str, threads: int | None = None,
                     weights: str | None = None, cache: DraftKVCache | None = None) -> Callable[[bool], DraftLM]:
    """`with_hidden -> DraftLM`: fresh runtimes (one KV cache each, one per generation) over one set of weights;
    with a `cache` (edge/runtime/draft_reuse.py), each starts from the prompt KV an earlier generation left there.
    One cache serves one factory: its entries are KV of this model, weights and runtime alone. `weights` as
    `load_draft_runtime`'s (the edge resolves its own default, int8, with `runtime_weights`)."""
    weights = runtime_weights(runtime, weights, onnx_default="float32")
    if runtime == "torch":
        def fresh(with_hidden: bool) -> DraftLM:
            return CachedLM(loaded.model, with_hidden=with_hidden)
    elif runtime == "onnx":
        onnx_model = exported_draft(loaded, threads=threads, weights=weights)

        def fresh(with_hidden: bool) -> DraftLM:
            return onnx_model.new_lm(with_hidden=with_hidden)
    elif runtime == "llama.cpp":
        gguf_model = llama_cpp_draft(loaded, threads)  # loaded once: every LM's context shares its weights

        def fresh(with_hidden: bool) -> DraftLM:
            return gguf_model.new_lm(with_hidden=with_hidden)
    else:
        raise ValueError(f"unknown draft runtime {runtime!r}; expected one of {RUNTIMES}")
    if cache is None:
        return fresh
    return lambda with_hidden: ReusingDraftLM(fresh(with_hidden), cache)
