"""The edge's draft on llama.cpp (`--draft-runtime llama.cpp`): the draft's GGUF as shipped, same interface as `CachedLM`.

It runs through the same bindings as the cloud's llama.cpp engine (common/model/llama_cpp_runtime.py):
the GGUF's own quantisation (SmolLM2-135M's Q4_1, the Qwen presets' as shipped), never a dequantised copy, so
its rows differ a little from the torch and ONNX runtimes' (which run the GGUF dequantised): lossless modes stay
exact (the target decides), a lossy verifier sees a slightly different draft.

`LlamaCppDraftLM.advance_to(context, n_logits)` keeps the longest prefix of `context` its KV holds, removes
the cells past it (`llama_memory_seq_rm`) and decodes the rest, rows read only at the last `n_logits`
positions. With `with_hidden`, the context also returns per-token embeddings (`embeddings` on, pooling
none): the output of the final norm, the same vector as torch's `hidden_states[-1]` for Llama and Qwen2,
and it comes from the same decode as the logits (tests/edge/runtime/test_llama_cpp_draft.py compares it).

It does not draft a tree's branches side by side (`batches` is False: one sequence per context): trees draft
their branches one after another, which the drafters do for any runtime without `batches`. It does keep prompt
KV across requests (`--draft-cache-mb`): a snapshot is the sequence's state as llama.cpp writes it
(`llama_state_seq_get_data`: its cells' K and V, f16), read back into a fresh context and cut to the prefix reused.

Glossary
    model     the GGUF's weights, loaded once (`LlamaCppDraftModel`) behind any number of LMs
    context   llama.cpp's KV cells and compute buffers: one per LM (below, `LlamaCppDraftModel.new_lm`)
    cell      one position's K and V in every layer; a context holds `cells` of them, grown on demand
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.model.cached_lm import ForwardOutput, common_prefix_length
from common.model.llama_cpp_runtime import LlamaCppModelError, bindings, load_gguf

log = logging.getLogger(__name__)

BATCH_TOKENS = 256  # tokens per llama_decode: a longer prefill goes in several (CPU kernels gain little past this)
# Rows per llama_decode. llama.cpp reserves compute memory for its most rows at once, [rows, V] float32: 300 MB
# at 512 rows of Qwen's 152k vocabulary, 18 MB at 16. A draft asks one row a step; more go in several decodes.
MAX_ROWS = 16
FIRST_CELLS = 1024  # a new context's cells; doubled (and the context re-filled) when a context outgrows them


@dataclass(frozen=True)
class KVSnapshot:
    """An owned copy of a context's one sequence: `length` positions, as llama.cpp's state bytes."""

    length: int
    data: ctypes.Array


class LlamaCppDraftModel:
    """The draft's GGUF, loaded once; `new_lm` makes an LM (its own context) over it.

    One context per LM, not one context with a sequence per LM: a llama.cpp context is not thread-safe, and the
    edge drafts several generations at once on threads; contexts of their own let them decode at the same time
    with no lock, for ~15 ms to make one and ~20 MB of compute buffer each (Qwen2.5-0.5B), KV grown as needed.
    """

    def __init__(self, path: Path, threads: int | None = None) -> None:
        self.lib = bindings()
        self.path = path
        self.threads = threads or len(os.sched_getaffinity(0))  # as ONNX Runtime's default: every core we may use
        self.model = load_gguf(self.lib, path)
        weakref.finalize(self, self.lib.llama_model_free, self.model)
        self.vocab_size = self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(self.model))
        self.hidden_size = self.lib.llama_model_n_embd(self.model)
        self.max_cells = self.lib.llama_model_n_ctx_train(self.model)

    def new_lm(self, with_hidden: bool = False) -> LlamaCppDraftLM:
        """A fresh, empty LM over the shared weights."""
        return LlamaCppDraftLM(self, with_hidden)

    def new_context(self, cells: int, with_hidden: bool):
        """A context of `cells` cells, one sequence, embeddings per token when `with_hidden` (a pointer)."""
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_ctx = cells
        params.n_batch = params.n_ubatch = BATCH_TOKENS
        params.n_outputs_max = MAX_ROWS
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = self.threads
        params.embeddings = with_hidden
        params.pooling_type = lib.LLAMA_POOLING_TYPE_NONE  # one embedding per token, not one per sequence
        params.no_perf = True
        context = lib.llama_init_from_model(self.model, params)
        if not context:
            raise LlamaCppModelError(f"llama.cpp could not make a context of {cells} cells for {self.path}")
        return context


class LlamaCppDraftLM:
    """One generation's draft on llama.cpp: a context of its own and the tokens its KV holds."""

    batches = False  # one sequence per context: a tree's branches are drafted one after another
    reusable = True  # a snapshot of the sequence's state stands for its tokens, and any prefix of them

    def __init__(self, model: LlamaCppDraftModel, with_hidden: bool = False) -> None:
        self.model = model  # held: the weights outlive every context over them
        self.lib = model.lib
        self.with_hidden = with_hidden
        self.tokens: list[int] = []
        self.forward_calls = 0
        self.cells = 0
        self._context = None
        self._batch = self.lib.llama_batch_init(BATCH_TOKENS, 0, 1)
        self._owned = [None]  # the context, for the finalizer: it frees what the LM holds when the LM goes
        weakref.finalize(self, _free, self.lib, self._owned, self._batch)
        self._make_context(FIRST_CELLS)

    def _make_context(self, cells: int) -> None:
        """A new context of `cells` cells (the old one freed): empty, so `tokens` are forgotten."""
        if self._owned[0]:
            self.lib.llama_free(self._owned[0])
            self._owned[0] = None
        self._context = self._owned[0] = self.model.new_context(cells, self.with_hidden)
        self._memory = self.lib.llama_get_memory(self._context)
        self._embeddings = self.with_hidden
        self.cells = cells
        self.tokens = []

    def _fit(self, length: int) -> None:
        """Room for `length` positions: a context too small is replaced by one of the next power of two cells."""
        if length <= self.cells:
            return
        if length > self.model.max_cells:
            raise LlamaCppModelError(f"a context of {length} tokens exceeds the draft's {self.model.max_cells}")
        cells = min(self.model.max_cells, 1 << (length - 1).bit_length())
        log.debug("draft context grows to %d cells (re-decoding %d tokens)", cells, length)
        self._make_context(cells)

    def rollback(self, length: int) -> None:
        """Keep the first `length` positions' cells."""
        if len(self.tokens) <= length:
            return
        if not self.lib.llama_memory_seq_rm(self._memory, 0, length, -1):
            raise LlamaCppModelError(f"llama.cpp could not remove positions {length}.. of the draft's context")
        del self.tokens[length:]

    def kv_snapshot(self) -> tuple[KVSnapshot, int]:
        """An owned copy of the KV of `tokens` (the edge's draft cache keeps it across requests), and its bytes."""
        size = self.lib.llama_state_seq_get_size(self._context, 0)
        data = (ctypes.c_uint8 * size)()
        if self.lib.llama_state_seq_get_data(self._context, data, size, 0) != size:
            raise LlamaCppModelError("llama.cpp could not copy the draft's KV out")
        return KVSnapshot(len(self.tokens), data), size

    def start_from(self, tokens: list[int], kv: KVSnapshot) -> None:
        """Replace the KV with the first len(tokens) positions of a snapshot of `tokens` (or more)."""
        self._fit(kv.length)
        self.lib.llama_memory_seq_rm(self._memory, 0, 0, -1)
        self.tokens = []
        if not self.lib.llama_state_seq_set_data(self._context, kv.data, len(kv.data), 0):
            raise LlamaCppModelError(f"llama.cpp could not read back a snapshot of {kv.length} positions")
        if kv.length > len(tokens) and not self.lib.llama_memory_seq_rm(self._memory, 0, len(tokens), -1):
            raise LlamaCppModelError(f"llama.cpp could not cut a snapshot to its first {len(tokens)} positions")
        self.tokens = list(tokens)

    def advance_to(self, context: list[int], n_logits: int = 1) -> ForwardOutput:
        """Make the KV hold `context`; return logits [k, V] (and hidden states [k, H]) of its last k positions.

        Like `CachedLM`, `n_logits` larger than the fed tokens gives all of them, and 0 means all.
        """
        if not context:
            raise ValueError("context must hold at least one token")
        self._fit(len(context))
        keep = min(common_prefix_length(self.tokens, context), len(context) - 1)
        self.rollback(keep)
        new_tokens = context[keep:]
        n = len(new_tokens)
        k = n if n_logits <= 0 else min(n_logits, n)
        logits = np.empty((k, self.model.vocab_size), dtype=np.float32)
        hidden = np.empty((k, self.model.hidden_size), dtype=np.float32) if self.with_hidden else None
        start = 0
        while start < n:
            end = self._chunk_end(start, n, k)
            first_row = max(start, n - k)
            self._decode(new_tokens[start:end], keep + start, first_row - start)
            self.tokens.extend(new_tokens[start:end])  # as each decode lands: a failed one leaves tokens = cells
            for index in range(first_row - start, end - start):
                self._read(index, start + index - (n - k), logits, hidden)
            start = end
        self.forward_calls += 1
        return ForwardOutput(logits=torch.from_numpy(logits),
                             hidden=torch.from_numpy(hidden) if hidden is not None else None)

    def _chunk_end(self, start: int, n: int, k: int) -> int:
        """Where the decode of new tokens `start ...` ends (of n, the last k rows): at most BATCH_TOKENS tokens and
        MAX_ROWS rows. With embeddings on llama.cpp makes every token of a decode a row, so with hidden states a
        decode that holds rows holds at most MAX_ROWS tokens: a long prefix goes first, on its own, without them."""
        end = min(n, start + BATCH_TOKENS)
        first_row = max(start, n - k)
        if first_row >= end:
            return end
        if not self.with_hidden:
            return min(end, first_row + MAX_ROWS)
        if end - start <= MAX_ROWS:
            return end
        return first_row if first_row > start else start + MAX_ROWS

    def _decode(self, tokens: list[int], position: int, first_row: int) -> None:
        """One `llama_decode` of `tokens` from `position` on, rows kept from batch index `first_row`; with hidden
        states, embeddings are on for a decode that holds rows only (every token is a row then: `_chunk_end`)."""
        embeddings = self.with_hidden and first_row < len(tokens)
        if embeddings != self._embeddings:
            self.lib.llama_set_embeddings(self._context, embeddings)
            self._embeddings = embeddings
        batch = self._batch
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = position + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = embeddings or i >= first_row
        batch.n_tokens = len(tokens)
        status = self.lib.llama_decode(self._context, batch)
        if status != 0:
            raise LlamaCppModelError(f"llama_decode failed with status {status} ({len(tokens)} tokens at {position})")

    def _read(self, index: int, row: int, logits: np.ndarray, hidden: np.ndarray | None) -> None:
        """Batch index `index`'s logits (and embedding) into row `row` of the outputs."""
        pointer = self.lib.llama_get_logits_ith(self._context, index)
        if not pointer:
            raise LlamaCppModelError(f"llama.cpp returned no logits for batch row {index}")
        logits[row] = np.ctypeslib.as_array(pointer, shape=(self.model.vocab_size,))
        if hidden is not None:
            pointer = self.lib.llama_get_embeddings_ith(self._context, index)
            if not pointer:
                raise LlamaCppModelError(f"llama.cpp returned no embedding for batch row {index}")
            hidden[row] = np.ctypeslib.as_array(pointer, shape=(self.model.hidden_size,))


def _free(lib, context: list, batch) -> None:
    """An LM's llama.cpp memory, freed when the LM goes (its context, if any, and its batch)."""
    if context[0]:
        lib.llama_free(context[0])
    lib.llama_batch_free(batch)
