"""llama.cpp in this process, through llama-cpp-python's low-level (ctypes) API: one model, one context.

Both sides run llama.cpp through this module: the cloud's target engine (`LlamaCppModel`) and the edge's draft
runtime (edge/runtime/llama_cpp_draft.py, which loads a model with `load_gguf` and makes its own contexts).

The cloud's llama.cpp engine (cloud/llama_cpp_engine.py) asks this module for three things only:
decode a batch of segments (each a sequence's new tokens at its positions) in one `llama_decode`,
read the rows of the positions asked for, and edit a sequence's KV cells (remove a tail, copy a
prefix to another sequence). Everything here runs on one thread: a llama.cpp context is not
thread-safe.

Glossary
    cell        one token's K and V in every layer: llama.cpp's unit of KV (`bytes_per_cell`)
    sequence    a KV stream keyed by a sequence id (0 .. n_seq_max - 1); a session or a Generate holds one
    unified KV  every sequence's cells in one buffer (`kv_unified`): a sequence may take any free cell, and a
                cell may belong to several sequences at once, so copying a prefix shares its cells (no copy)
    segment     one sequence's new tokens in a decode: the sequence, the position of its first new token, the
                tokens, and how many of its last rows come back
    row         the logits after a position, [V] float32: they score the next token

Shapes: a segment's rows are [n_rows, V] float32 (numpy, copied out of llama.cpp's buffer).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import SprinterError, UsageError

log = logging.getLogger(__name__)
F16_BYTES = 2  # llama.cpp's default KV cell type (type_k, type_v) is f16
GGML_LOG_WARN, GGML_LOG_ERROR = 3, 4  # ggml_log_level
# Warnings that only say llama.cpp did what it was asked: the edge's draft asks per-token embeddings (pooling none)
# of a model that declares no pooling, on every new context. Logged at debug, not as warnings.
ASKED_FOR = ("pooling_type is [-1], but [0] was specified",)


class LlamaCppUnavailable(UsageError, RuntimeError):
    """llama-cpp-python is not installed (`make llama-cpp` builds it from source with native CPU flags). A
    `UsageError`: `sprinter` says it in one line, whichever side asked for llama.cpp."""


class LlamaCppModelError(SprinterError, ValueError):
    """llama.cpp could not load or run the model: its file, its architecture, or the context asked for."""


class KVCellsExhausted(SprinterError, RuntimeError):
    """llama.cpp found no free KV cells for a decode: the context's cells are all taken."""


def bindings():
    """The `llama_cpp` module, or a one-line refusal saying how to get it."""
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError) as err:  # OSError/RuntimeError: the package without its libraries
        raise LlamaCppUnavailable(f"llama.cpp (--engine llama.cpp, --draft-runtime llama.cpp) needs llama-cpp-python "
                                  f"built for this CPU ({err}); run "
                                  "`make llama-cpp` (builds it from source with native flags, a few minutes)") from err
    return llama_cpp


@dataclass(frozen=True)
class Segment:
    """One sequence's part of a decode: `tokens` written at positions `start ...`, the last `n_rows` rows read."""

    seq: int
    start: int
    tokens: list[int]
    n_rows: int


@dataclass(frozen=True)
class ContextShape:
    """How the context is sized: its cells (all sequences together: `kv_bytes` of them, plus `slack_cells`), its
    sequences, and the tokens one decode may carry. `unified` False gives each sequence a KV stream of its own (the
    cells split evenly; a prefix copy between streams copies whole buffers): the engine keeps unified KV, which
    shares prefixes and lets a sequence take any free cell; `sprinter bench llama-cpp` measures both."""

    kv_bytes: int
    slack_cells: int
    sequences: int
    batch_tokens: int
    threads: int
    unified: bool = True


class LlamaCppModel:
    """A GGUF model and one llama.cpp context over it (`shape.sequences` sequences)."""

    def __init__(self, path: Path, shape: ContextShape) -> None:
        lib = self.lib = bindings()
        self._log_callback = _quiet(lib)
        self.model = load_gguf(lib, path)
        self.path = path
        params = lib.llama_context_default_params()
        params.n_ctx = shape.kv_bytes // self.bytes_per_cell + shape.slack_cells
        params.n_batch = params.n_ubatch = shape.batch_tokens
        params.n_seq_max = shape.sequences
        params.n_threads = params.n_threads_batch = shape.threads
        params.kv_unified = shape.unified  # flash attention stays llama.cpp's own choice (auto), as llama-server's
        params.no_perf = True
        self.context = lib.llama_init_from_model(self.model, params)
        if not self.context:
            lib.llama_model_free(self.model)
            raise LlamaCppModelError(f"llama.cpp could not make a context of {params.n_ctx} cells and "
                                     f"{shape.sequences} sequences for {path}")
        self.shape = shape
        self.memory = lib.llama_get_memory(self.context)
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.vocab_size = lib.llama_vocab_n_tokens(self.vocab)
        self.cells = lib.llama_n_ctx(self.context)
        self._batch = lib.llama_batch_init(shape.batch_tokens, 0, 1)

    @property
    def bytes_per_cell(self) -> int:
        """One token's K and V over every layer, in f16: what a cell takes."""
        layers, kv_heads, head_dim = self.layout()
        return 2 * layers * kv_heads * head_dim * F16_BYTES

    def layout(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of the model's KV."""
        lib = self.lib
        return (lib.llama_model_n_layer(self.model), lib.llama_model_n_head_kv(self.model),
                lib.llama_model_n_embd(self.model) // lib.llama_model_n_head(self.model))

    def eos_token(self) -> int | None:
        """The GGUF's end-of-sequence token (as transformers reads it into a converted model's generation config)."""
        token = self.lib.llama_vocab_eos(self.vocab)
        return token if token >= 0 else None

    def decode(self, segments: list[Segment], full_rows: list[bool]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Every segment's tokens in one `llama_decode` (llama.cpp splits it into micro-batches by itself);
        per segment, the argmax of each row read [n_rows] and, where `full_rows`, the rows [n_rows, V]."""
        total = sum(len(s.tokens) for s in segments)
        if total > self.shape.batch_tokens:
            raise ValueError(f"a decode of {total} tokens exceeds this context's batch of {self.shape.batch_tokens}")
        batch, i = self._batch, 0
        for segment in segments:
            first_row = len(segment.tokens) - segment.n_rows
            for offset, token in enumerate(segment.tokens):
                batch.token[i] = token
                batch.pos[i] = segment.start + offset
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = segment.seq
                batch.logits[i] = offset >= first_row
                i += 1
        batch.n_tokens = total
        status = self.lib.llama_decode(self.context, batch)
        if status == 1:
            raise KVCellsExhausted(f"llama.cpp found no room for {total} tokens in its {self.cells} KV cells")
        if status != 0:
            raise LlamaCppModelError(f"llama_decode failed with status {status}")
        return self._rows(segments, full_rows)

    def _rows(self, segments: list[Segment], full_rows: list[bool]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Each segment's last rows, read by their index in the batch."""
        out, first = [], 0
        for segment, full in zip(segments, full_rows):
            rows = np.empty((segment.n_rows, self.vocab_size), dtype=np.float32) if full else None
            argmax = np.empty(segment.n_rows, dtype=np.int64)
            for r, index in enumerate(range(first + len(segment.tokens) - segment.n_rows, first + len(segment.tokens))):
                pointer = self.lib.llama_get_logits_ith(self.context, index)
                if not pointer:
                    raise LlamaCppModelError(f"llama.cpp returned no logits for batch row {index}")
                row = np.ctypeslib.as_array(pointer, shape=(self.vocab_size,))
                argmax[r] = int(row.argmax())
                if rows is not None:
                    rows[r] = row
            out.append((argmax, rows))
            first += len(segment.tokens)
        return out

    def remove(self, seq: int, start: int = 0) -> None:
        """Forget the sequence's cells from position `start` on (its rejected tail, or all of it)."""
        if not self.lib.llama_memory_seq_rm(self.memory, seq, start, -1):
            raise LlamaCppModelError(f"llama.cpp could not remove positions {start}.. of sequence {seq}")

    def share(self, source: int, target: int, length: int) -> None:
        """Make the first `length` positions of `source` part of `target` too (unified KV: the cells are shared)."""
        self.lib.llama_memory_seq_cp(self.memory, source, target, 0, length)

    def positions(self, seq: int) -> int:
        """How many positions the sequence holds in llama.cpp's cells (its last position + 1; 0 when empty)."""
        return max(0, self.lib.llama_memory_seq_pos_max(self.memory, seq) + 1)

    def close(self) -> None:
        lib = self.lib
        if self.context:
            lib.llama_batch_free(self._batch)
            lib.llama_free(self.context)
            lib.llama_model_free(self.model)
            self.context = self.model = None


def load_gguf(lib, path: Path):
    """The model in the GGUF file `path`, its weights on the CPU (a `llama_model` pointer; `llama_model_free` it)."""
    lib.llama_backend_init()
    _quiet(lib)
    model_params = lib.llama_model_default_params()
    model_params.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(str(path).encode(), model_params)
    if not model:
        raise LlamaCppModelError(f"llama.cpp could not load {path} (not a GGUF file, or an architecture this "
                                 "build does not know)")
    return model


_LOG_FORWARD: list = []  # the one callback set: llama.cpp keeps it as a bare pointer, so it lives as long as we do


def _quiet(lib):
    """llama.cpp logs every load to stderr: keep its warnings and errors, through `logging`. Returns the callback,
    set once per process and held here: llama.cpp keeps a bare pointer to it, and both sides load models."""
    if _LOG_FORWARD:
        return _LOG_FORWARD[0]

    @lib.llama_log_callback
    def forward(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if level in (GGML_LOG_WARN, GGML_LOG_ERROR):
            message = text.decode(errors="replace").rstrip()
            expected = level == GGML_LOG_WARN and any(phrase in message for phrase in ASKED_FOR)
            log.log(logging.DEBUG if expected else logging.WARNING if level == GGML_LOG_WARN else logging.ERROR,
                    "llama.cpp: %s", message)

    lib.llama_log_set(forward, ctypes.c_void_p())
    _LOG_FORWARD.append(forward)
    return forward
