"""The llama.cpp engine: the target on llama.cpp's CPU kernels, its GGUF file as shipped (never dequantized).

On a CPU this is what a user would run the target on: llama.cpp's kernels, built for the CPU at hand
(docs/benchmarks/llama-cpp.md measures it against llama-server and the resident engine). It sits behind
the same seam and scheduler as the resident engine: the batcher (cloud/batcher.py) gathers whatever
verifies wait, and one `llama_decode` runs them all, each session's block as its own sequence, logits
only at the rows the rule reads (common/model/llama_cpp_runtime.py).

Glossary
    sequence      a session's (or a Generate's) KV in llama.cpp's one context: a sequence id; ids are
                  taken at open and given back at close, their cells removed or kept by the prefix
                  cache (cloud/llama_cpp_prefix.py)
    cell          one token's KV (llama.cpp's unit); the session store charges cells as the resident
                  engine's entries, in pages of PAGE_TOKENS, against the same --kv-budget-mb
    rollback      llama.cpp's per-sequence removal (`llama_memory_seq_rm`) of the rejected tail

The context's cells are the KV budget (plus one forward's tokens of slack), all sequences sharing
one buffer (unified KV): a sequence takes cells as it grows, as a session's pages are granted.
Every call into llama.cpp runs on the batcher's one worker thread, in order: a rollback or a close
is queued there (it returns at once) and is done before any later forward of that sequence.

Exactness: the rows are llama.cpp's own float32 logits of the GGUF as quantized, and the rules read
them unchanged (penalties and logit_bias applied to them here as to the resident engine's). llama.cpp
is not batch-invariant: a block's rows may differ from one-token decoding by rounding, so greedy
speculation can part from llama.cpp's own one-token output at near-ties (docs/llama-cpp-engine.md).

With `--draft` the engine is also its own draft's (cloud-sd): the draft's GGUF in a context of its
own, its batcher on this one's worker thread. Not here yet: draft trees (a tree's tokens would need a
sequence per branch; the open's limits say 0 tree tokens, so edges send chains).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from cloud.batcher import Batcher
from cloud.engine import EngineSession, TargetInfo, TargetRows
from cloud.errors import exhausted
from common.model.llama_cpp_runtime import ContextShape, LlamaCppModel, Segment
from cloud.resident_engine import BatchedEngine
from cloud.resident_kv import KVLayout
from common.model.loading import eos_token_ids, gguf_file, load_gguf_tokenizer, vocab_fingerprint
from common.sampling.distributions import SamplingParams

log = logging.getLogger(__name__)
PAGE_TOKENS = 16  # the ledger's unit for this engine: llama.cpp takes cells one by one, the budget counts pages
LLAMA_MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
SEQUENCE_RETRY_MS = 500  # a sequence id comes back as soon as a session or Generate ends


def default_threads() -> int:
    """The cores this process may run on (a `taskset` pins it): llama.cpp's threads, one per core."""
    return len(os.sched_getaffinity(0))


@dataclass(eq=False)  # identity: the prefix cache holds sessions in weak sets
class SequenceKV:
    """EngineSession.cache on this engine: one sequence of the shared context; what the batcher and the session
    store read of a session's KV (length, capacity, grants), counted in llama.cpp's cells."""

    layout: KVLayout  # page_tokens and max_tokens for the store's grants; bytes per cell
    seq: int
    on_release: Callable[["SequenceKV"], None]
    length: int = 0  # positions the session's context holds
    cells: int = 0  # positions llama.cpp holds for it, read after each forward and removal (>= length until trimmed)
    granted: int = 0
    copied_bytes: int = 0  # llama.cpp never moves a sequence's cells
    shared_tokens: int = 0  # its first cells are the prefix cache's (charged there)
    started_from: Any = None  # (the prefix cache's entry, tokens) its cells began with (cloud/llama_cpp_prefix.py)
    released: bool = False
    in_forward: bool = False

    @property
    def capacity(self) -> int:
        """What it holds, in whole pages: the cells llama.cpp keeps for it (a rollback's tail until removed)."""
        return self.layout.pages(max(self.length, self.cells)) * self.layout.page_tokens

    def capacity_for(self, tokens: int, headroom: int = 0) -> int:
        if tokens > self.layout.max_tokens:
            raise ValueError(f"{tokens} KV entries exceed this cloud's limit of {self.layout.max_tokens} per session")
        return max(self.capacity, self.layout.pages(min(tokens + headroom, self.layout.max_tokens))
                   * self.layout.page_tokens)

    def reserve(self, tokens: int) -> int:
        """llama.cpp takes cells as it decodes: nothing to allocate ahead; refuses past the limit or once released."""
        if self.released:
            raise ValueError("this session's KV was released")
        self.capacity_for(tokens)
        return 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate {self.length} KV entries to {length}")
        self.length = length

    def release(self) -> None:
        """The session is gone: its sequence's cells are removed, or kept as far as the prefix cache keeps them (after
        the forward under way, if any)."""
        if not self.released:
            self.released = True
            if not self.in_forward:
                self.on_release(self)

    def end_forward(self) -> None:
        self.in_forward = False
        if self.released:
            self.on_release(self)


class LlamaCppEngine(BatchedEngine):
    """`TargetEngine` over a `LlamaCppModel` and a batcher running its forwards (the caller runs the batcher)."""

    name = "llama.cpp"
    tree_attention = False

    def __init__(self, model: LlamaCppModel, info: TargetInfo, tokenizer: Any, layout: KVLayout) -> None:
        self.model = model
        self.info = info
        self.tokenizer = tokenizer
        self.layout = layout
        self.kv_bytes_per_token = layout.bytes_per_token
        self.kv_bytes_per_page = layout.bytes_per_page
        self.batcher: Batcher | None = None  # set by the server before the first session
        self.prefix_cache: Any = None  # cloud/llama_cpp_prefix.py, set likewise unless the cloud keeps none
        self.draft: LlamaCppEngine | None = None  # the cloud's own draft (`--draft`, mode cloud-sd): its own context
        self._free = list(range(model.shape.sequences - 1, -1, -1))  # sequence ids, taken from the end
        self._held: dict[int, SequenceKV] = {}
        self._lock = threading.Lock()  # ids come back on the worker thread

    @classmethod
    def load(cls, spec: str, threads: int, kv_budget_bytes: int, max_tokens: int, max_sequences: int,
             max_forward_tokens: int) -> "LlamaCppEngine":
        """The GGUF `spec` names, loaded as it is (blocking: call it from a thread)."""
        path = gguf_file(spec)
        tokenizer = load_gguf_tokenizer(path)
        shape = ContextShape(kv_bytes=kv_budget_bytes, slack_cells=max_forward_tokens,
                             sequences=min(LLAMA_MAX_SEQUENCES, max_sequences), batch_tokens=max_forward_tokens,
                             threads=threads)
        model = LlamaCppModel(path, shape)
        layers, kv_heads, head_dim = model.layout()
        layout = KVLayout(layers, kv_heads, head_dim, torch.float16, page_tokens=PAGE_TOKENS, max_tokens=max_tokens)
        # the stops of the same preset loaded by transformers (the edge's draft, the resident engine)
        info = TargetInfo(spec, model.vocab_size, eos_token_ids(model.eos_token(), tokenizer),
                          vocab_fingerprint(tokenizer))
        log.info("llama.cpp: %s, %d KV cells, %d sequences, %d threads", path.name, model.cells, shape.sequences,
                 threads)
        return cls(model, info, tokenizer, layout)

    def close(self) -> None:
        """Free the context once the worker has run what was queued for it (a shared worker may still hold edits)."""
        if self.batcher is not None:
            try:
                self.batcher.worker.submit(lambda: None).result(timeout=60)
            except RuntimeError:  # the worker was shut down, after running everything queued
                pass
        self.model.close()

    def new_session_kv(self) -> SequenceKV:
        seq = self.take_sequence(self.prefix_cache.evict_one if self.prefix_cache is not None else None)
        if seq is None:
            raise exhausted(f"all {self.model.shape.sequences} llama.cpp sequences of this cloud are in use by "
                            "sessions and Generate calls; retry shortly", SEQUENCE_RETRY_MS)
        cache = SequenceKV(self.layout, seq, self._release)
        self._held[seq] = cache
        return cache

    def kv_bytes_in_use(self) -> int:
        """The cells llama.cpp holds for every live sequence, as read after its last forward or removal, those it
        shares with the prefix cache once, and the prefix cache's."""
        held = sum(max(0, cache.cells - cache.shared_tokens) for cache in list(self._held.values()))
        cached = self.prefix_cache.tokens if self.prefix_cache is not None else 0
        return (held + cached) * self.layout.bytes_per_token

    def take_sequence(self, evict: Callable[[], bool] | None = None) -> int | None:
        """A free sequence id, evicting idle prefix-cache entries for one if `evict` is given; None: none free."""
        while True:
            with self._lock:
                if self._free:
                    return self._free.pop()
            if evict is None or not evict():
                return None

    def share(self, source: int, cache: SequenceKV, length: int) -> None:
        """Begin `cache` with the first `length` cells of sequence `source` (shared, on the worker, before any
        later forward of the cache)."""
        cache.length = length
        self._on_worker(lambda c: self._shared(source, c, length), cache)

    def _shared(self, source: int, cache: SequenceKV, length: int) -> None:
        self.model.share(source, cache.seq, length)
        cache.cells = self.model.positions(cache.seq)

    def free_sequence(self, seq: int) -> None:
        """A prefix-cache entry's sequence given back: its cells removed, then its id free (on the worker)."""
        self.batcher.worker.submit(self._free_id, seq).add_done_callback(_log_failure)

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Every sampling setting: each row comes back whole, as llama.cpp computed it."""

    def rollback(self, session: EngineSession, keep: int) -> None:
        cache: SequenceKV = session.cache
        cache.truncate(keep)
        self._on_worker(self._trim, cache)

    def keep_path(self, session: EngineSession, start: int, node_indices: list[int]) -> None:
        raise ValueError("the llama.cpp engine verifies chains only (its open's limits say 0 tree tokens)")

    # As the cloud's draft (cloud/cloud_sd.py: what CloudSpeculation reads of a DraftEngine): its spec, its
    # logits per row and a generation's cache.
    @property
    def spec(self) -> str:
        return self.info.spec

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def new_cache(self, tokens: int) -> SequenceKV:
        cache = self.new_session_kv()
        cache.reserve(tokens)
        return cache

    def packed_forward(self, caches: list[SequenceKV], new_tokens: list[list[int]], n_logits: list[int],
                       full_logits: list[bool], trees: list[list[int] | None]) -> list[TargetRows]:
        """The batcher's forward (cloud/batcher.py: PackedForward), on its worker: one llama_decode of every
        session's tokens, each after its own context."""
        if any(tree is not None for tree in trees):
            raise ValueError("the llama.cpp engine verifies chains only")
        for cache in caches:  # a length moved back without a rollback (cloud-sd's rounds): its tail goes first
            if cache.cells > cache.length:
                self._trim(cache)
        segments = [Segment(cache.seq, cache.length, list(tokens), n)
                    for cache, tokens, n in zip(caches, new_tokens, n_logits)]
        decoded = None
        try:
            decoded = self.model.decode(segments, list(full_logits))
        finally:  # a failed decode may leave part of the batch in llama.cpp: each sequence back to its context
            for cache, tokens in zip(caches, new_tokens):
                cache.length += len(tokens) if decoded is not None else 0
                self._trim(cache)
        return [TargetRows(torch.from_numpy(argmax), None if rows is None else torch.from_numpy(rows))
                for argmax, rows in decoded]

    def _trim(self, cache: SequenceKV) -> None:
        """On the worker: remove the sequence's cells past its length (a rollback's rejected tail); read what is
        left."""
        if self.model.positions(cache.seq) > cache.length:
            self.model.remove(cache.seq, cache.length)
        cache.cells = self.model.positions(cache.seq)

    def _release(self, cache: SequenceKV) -> None:
        """The session is gone: its sequence is kept by the prefix cache (trimmed to what an entry keeps), or freed."""
        kept = self.prefix_cache.kept(cache.seq) if self.prefix_cache is not None else None
        if self._held.get(cache.seq) is cache:
            del self._held[cache.seq]
        if kept is None:
            self._on_worker(lambda c: self._free_id(c.seq), cache)
        else:
            cache.length = kept
            self._on_worker(self._trim, cache)

    def _free_id(self, seq: int) -> None:
        """On the worker: the sequence's cells removed, then its id free for the next open."""
        self.model.remove(seq)
        with self._lock:
            self._free.append(seq)

    def _on_worker(self, function: Callable[[SequenceKV], None], cache: SequenceKV) -> None:
        """Queue `function(cache)` behind the forwards already on the worker (llama.cpp is used by that thread only):
        any later forward of the sequence finds it done."""
        future = self.batcher.worker.submit(function, cache)
        future.add_done_callback(_log_failure)


def _log_failure(future: Any) -> None:
    if future.exception() is not None:
        log.error("llama.cpp KV edit failed", exc_info=future.exception())
