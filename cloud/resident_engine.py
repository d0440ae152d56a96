"""The resident engine, the embedded default: the target in this process, KV resident on its device.

Each session's KV stays where the forward writes it: in buffers of its own (cloud/resident_kv.py,
attention per session) or in pages of one pool (cloud/kv_pool.py, one attention call per layer for
all sessions: `--attention paged`, the default on CUDA). Concurrent sessions' new tokens go through
one packed, unpadded forward with continuous batching and prefill chunks (cloud/batcher.py). The
session store charges every page to the KV budget (cloud/sessions.py). With a draft (`--draft`) it
also speculates by itself, for mode cloud-sd (cloud/cloud_sd.py): the draft's steps go through a
batcher of their own; its per-generation KV is the draft's, apart from the target's budget.

`BatchedEngine` is the part of it that any engine whose forwards go through the batcher shares: prefill,
verify, rollback and target-alone decoding (Generate) over a session's KV handle (`new_session_kv`); the
llama.cpp engine (cloud/llama_cpp_engine.py) is one over llama.cpp's sequences.

With a prefix cache (cloud/prefix_cache.py) a Generate's target KV starts from the longest cached prefix of its
prompt and its whole pages are cached when it ends; the cloud's draft prefills the whole prompt (its KV is per
generation).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

import torch

from cloud.batcher import Batcher
from cloud.engine import (Abandoned, EngineSession, ForwardResult, GeneratedToken, TargetInfo, TargetRows,
                          scored_prefill)
from cloud.kv_pool import KVPool, PagedKV
from cloud.prefix_cache import PrefixCache, Reuse, reusing
from cloud.packed_forward import Replay, forward_packed
from cloud.resident_kv import KVLayout, ResidentKV
from cloud.cloud_sd import CloudSpeculation, DraftEngine, SpeculatedRound, SpeculationRequest
from common.model.loading import LoadedModel, vocab_fingerprint
from common.sampling.logits_processing import LogitsProcessor
from common.sampling.logprobs import TokenLogprob
from common.sampling.distributions import SamplingParams


class BatchedEngine:
    """The `TargetEngine` methods of an engine whose forwards go through `self.batcher`."""

    batcher: Batcher
    info: TargetInfo
    prefix_cache: PrefixCache | None
    draft: DraftEngine | None  # the cloud's own draft (`--draft`): cloud-sd; DraftEngine's or the llama.cpp engine's

    def new_session_kv(self) -> Any:
        raise NotImplementedError

    @property
    def queue_depth(self) -> int:
        return self.batcher.queue_depth

    async def _prefill(self, cache: Any, context: list[int], top_n: int | None, scope: str | None,
                       with_last: bool = False, full_logits: bool = True,
                       ) -> tuple[tuple[TokenLogprob, ...], Reuse, ForwardResult | None]:
        """The prompt but its last token into `cache`, apart from verify batches, like a session's, from its longest
        cached prefix in `scope`; `with_last`: the last token too, and the rows after it (a Generate's first token,
        without a forward of its own). With `top_n` (echo) chunk by chunk, each chunk's rows scoring the next prompt
        tokens (every row is read: nothing is reused, and the last token is left to the caller)."""
        if top_n is not None:
            async def forward(chunk: list[int]) -> TargetRows:
                return (await self.batcher.forward(cache, chunk, n_logits=len(chunk))).rows

            return tuple(await scored_prefill(forward, context, top_n)), Reuse(), None
        end = len(context) if with_last else len(context) - 1
        if end < 1:
            return (), Reuse(), None
        async with reusing(self.prefix_cache, cache, scope if len(context) > 1 else None, context[:-1]) as reuse:
            result = await self.batcher.prefill(cache, context[reuse.tokens:end], full_logits=full_logits)
        return (), reuse, result if with_last else None

    def _remember(self, cache: Any, scope: str | None, context: list[int]) -> None:
        """A generation's whole pages into the prefix cache as it ends (prompt and output: what a conversation's
        next turn resends)."""
        if self.prefix_cache is not None and scope is not None:
            self.prefix_cache.remember(cache, scope, context)

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Every sampling setting: the forward returns full-vocabulary logits."""

    async def prefill(self, session: EngineSession, tokens: list[int], abandoned: Abandoned | None = None) -> None:
        await self.batcher.prefill(session.cache, tokens, abandoned)

    async def forward(self, session: EngineSession, new_tokens: list[int], n_logits: int,
                      abandoned: Abandoned | None = None, tree: list[int] | None = None) -> ForwardResult:
        """`tree`: `new_tokens` as a tree of tokens, their parents in the block (common/spec/tree/draft_tree.py); rows
        as a chain's, row r after the path to the r-th of the last `n_logits` tokens."""
        return await self.batcher.forward(session.cache, new_tokens, n_logits, abandoned,
                                          full_logits=session.sampling.reads_logits, tree=tree)

    def rollback(self, session: EngineSession, keep: int) -> None:
        session.cache.truncate(keep)  # moves the length: the rejected entries are overwritten later

    async def generate(self, context: list[int], max_new: int, sampling: SamplingParams,
                       processor: LogitsProcessor | None,
                       prefix_scope: str | None = None) -> AsyncIterator[GeneratedToken]:
        """Sampled with a CPU generator seeded by `sampling.seed`, like a session's tokens (common/model/devices.py);
        `processor`: the request's grammar, bias and penalties; `prefix_scope`: whose cached prefixes it may reuse."""
        generator = torch.Generator().manual_seed(sampling.seed)
        context = list(context)  # grows by each token: the penalties count it
        cache = self.new_session_kv()
        try:
            cache.reserve(len(context) + max_new)
            started = time.perf_counter()
            result, prompt_logprobs, reuse = await self._open_generation(cache, context, sampling, prefix_scope)
            ms = (time.perf_counter() - started) * 1e3
            for step in range(max_new):
                if step:
                    result = await self.batcher.forward(cache, context[-1:], 1, full_logits=sampling.reads_logits)
                    ms, prompt_logprobs, reuse = result.queue_ms + result.forward_ms, (), Reuse()
                token = result.rows.shaped(processor, context, []).next_token(sampling, generator)
                logprob = next(iter(result.rows.logprobs(sampling, [token])), None)
                context.append(token)
                yield GeneratedToken(token, ms, logprob, prompt_logprobs, reuse.tokens)
                if token in self.info.eos_token_ids:
                    return
        finally:
            self._remember(cache, prefix_scope, context)
            cache.release()

    async def _open_generation(self, cache: Any, context: list[int], sampling: SamplingParams,
                               scope: str | None) -> tuple[ForwardResult, tuple[TokenLogprob, ...], Reuse]:
        """The prompt into `cache` and the rows after its last token. Without prompt logprobs the last token rides
        in the prefill's last chunk, so the first token costs no forward of its own (a conversation's next turn: its
        new tokens and the first step in one forward)."""
        prompt_logprobs, reuse, result = await self._prefill(cache, context, sampling.prompt_logprobs, scope,
                                                             with_last=sampling.prompt_logprobs is None,
                                                             full_logits=sampling.reads_logits)
        if result is None:  # echo read every prompt row: the last token goes in a forward of its own
            result = await self.batcher.forward(cache, context[-1:], 1, full_logits=sampling.reads_logits)
        return result, prompt_logprobs, reuse

    @property
    def draft_spec(self) -> str | None:
        return self.draft.spec if self.draft is not None else None

    async def speculate(self, context: list[int], max_new: int, sampling: SamplingParams,
                        processors: tuple[LogitsProcessor | None, LogitsProcessor | None],
                        speculation: SpeculationRequest,
                        prefix_scope: str | None = None) -> AsyncIterator[SpeculatedRound]:
        """cloud-sd: both prompts prefilled apart from other work, then rounds (cloud/cloud_sd.py), the first
        counting the prefills and bringing the prompt's logprobs when asked (echo)."""
        if self.draft is None:
            raise ValueError("this engine has no draft model (start the cloud with --draft)")
        room = len(context) + max_new + speculation.cap  # a verify writes its whole block before the rollback
        target_cache, draft_cache = self.new_session_kv(), self.draft.new_cache(room)
        try:
            target_cache.reserve(room)
            started = time.perf_counter()
            prompt_logprobs, reuse, _ = await self._prefill(target_cache, context, sampling.prompt_logprobs,
                                                            prefix_scope)
            if len(context) > 1:
                await self.draft.batcher.prefill(draft_cache, context[:-1])
            prefill_ms = (time.perf_counter() - started) * 1e3
            rounds_of = CloudSpeculation(self.draft, target_cache, draft_cache, sampling, self.info.vocab_size,
                                         self.info.eos_token_ids, *processors, speculation)

            async def target_forward(new_tokens: list[int], n_logits: int) -> ForwardResult:
                return await self.batcher.forward(target_cache, new_tokens, n_logits,
                                                  full_logits=sampling.reads_logits)

            async with contextlib.aclosing(rounds_of.rounds(context, max_new, target_forward)) as rounds:
                async for speculated in rounds:
                    yield replace(speculated, step_ms=speculated.step_ms + prefill_ms, prompt_logprobs=prompt_logprobs,
                                  cached_tokens=reuse.tokens)
                    prefill_ms, prompt_logprobs, reuse = 0.0, (), Reuse()
                    context = context + speculated.tokens
        finally:
            self._remember(target_cache, prefix_scope, context)
            target_cache.release()
            draft_cache.release()


def target_info(target: LoadedModel) -> TargetInfo:
    return TargetInfo(target.spec, target.vocab_size, target.eos_token_ids, vocab_fingerprint(target.tokenizer))


@dataclass
class ResidentEngine(BatchedEngine):
    """`TargetEngine` over a loaded transformers model and its batcher (which the caller runs)."""

    target: LoadedModel
    batcher: Batcher
    kv_layout: KVLayout
    kv_pool: KVPool | None = None  # paged: every session's pages; None: each session's own buffers
    draft: DraftEngine | None = None  # the cloud's own draft (`--draft`): cloud-sd
    prefix_cache: PrefixCache | None = None  # KV reusable across sessions by prefix; the session store charges it
    name: str = "resident"
    tree_attention: bool = True  # cloud/packed_forward.py: positions by depth, each token seeing its ancestors
    query_tiles: bool = False  # cloud/query_tiles.py: the batcher's forwards pad each session's rows (warm_up's too)
    replay: Replay | None = None  # cloud/cuda_graphs.py: the batcher's forwards replay CUDA graphs (warm_up captures)

    def __post_init__(self) -> None:
        self._caches: weakref.WeakSet[ResidentKV] = weakref.WeakSet()  # every live per-session buffer pair
        self.info = target_info(self.target)
        self.tokenizer = self.target.tokenizer
        self.kv_bytes_per_token = self.kv_layout.bytes_per_token
        self.kv_bytes_per_page = self.kv_layout.bytes_per_page

    def new_session_kv(self) -> ResidentKV | PagedKV:
        if self.kv_pool is not None:
            return self.kv_pool.session()
        cache = ResidentKV(self.kv_layout)
        self._caches.add(cache)
        return cache

    def kv_bytes_in_use(self) -> int:
        """Paged: the pool's pages taken; per session: the bytes of every buffer still alive (a session's, a
        Generate's, one a forward under way still holds)."""
        if self.kv_pool is not None:
            return (self.kv_pool.pages - self.kv_pool.free_pages) * self.kv_layout.bytes_per_page
        cached = self.prefix_cache.nbytes() if self.prefix_cache is not None else 0
        return cached + sum(cache.keys.nbytes + cache.values.nbytes for cache in list(self._caches))

    def warm_up(self) -> None:
        """Run the forward's shapes once before serving (on CUDA this compiles paged attention); refuses to start,
        naming the way out, when the device cannot run this attention."""
        caches = [self.new_session_kv(), self.new_session_kv()]
        try:
            for new_tokens in ([[0]], [[0] * 3, [0] * 4]):
                forward_packed(self.target.model, caches[:len(new_tokens)], new_tokens, [1] * len(new_tokens),
                               query_tiles=self.query_tiles, replay=self.replay)
        except Exception as err:
            if self.kv_pool is None:
                raise
            way_out = "--cuda-graphs off, or --attention per-session" if self.replay else "--attention per-session"
            raise ValueError(f"paged attention{' replayed from CUDA graphs' if self.replay else ''} does not run on "
                             f"{self.kv_layout.device} ({type(err).__name__}: {err}); start with {way_out}") from err
        finally:
            for cache in caches:
                cache.release()

    def keep_path(self, session: EngineSession, start: int, node_indices: list[int]) -> None:
        """After a tree's forward: keep the KV of the nodes `node_indices` (a root-to-node path, in order) as the
        entries from `start` (where node 0's was written), nothing after them. Moves entries within the session's
        own capacity: the KV budget charged is unchanged, and the length only drops."""
        session.cache.keep_path(start, node_indices)
