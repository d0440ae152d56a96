"""What the resident and llama.cpp engines share: a session's work goes through a batcher (cloud/batcher.py).

Both keep each session's KV in a handle of their own (`new_session_kv`) that the batcher's packed forward
appends to: the resident engine's buffers or pages, the llama.cpp engine's sequence. Over that, prefill,
verify, rollback and target-alone decoding (Generate) are written once, here; a prefix cache
(cloud/prefix_cache.py) is used where the engine keeps one.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

import torch

from cloud.batcher import Batcher
from cloud.engine import Abandoned, ForwardResult, GeneratedToken, EngineSession, TargetInfo, TargetRows, scored_prefill
from cloud.prefix_cache import PrefixCache, Reuse, reusing
from common.logits_processing import LogitsProcessor
from common.logprobs import TokenLogprob
from common.sampling import SamplingParams


class BatchedEngine:
    """The `TargetEngine` methods of an engine whose forwards go through `self.batcher`."""

    batcher: Batcher
    info: TargetInfo
    prefix_cache: PrefixCache | None

    def new_session_kv(self) -> Any:
        raise NotImplementedError

    @property
    def queue_depth(self) -> int:
        return self.batcher.queue_depth

    async def _prefill(self, cache: Any, context: list[int], top_n: int | None,
                       scope: str | None) -> tuple[tuple[TokenLogprob, ...], Reuse]:
        """The prompt but its last token into `cache`, apart from verify batches, like a session's, from its longest
        cached prefix in `scope`; with `top_n` (echo) chunk by chunk, each chunk's rows scoring the next prompt
        tokens (every row is read: nothing is reused)."""
        if len(context) < 2:
            return (), Reuse()
        if top_n is None:
            async with reusing(self.prefix_cache, cache, scope, context[:-1]) as reuse:
                await self.batcher.prefill(cache, context[reuse.tokens:-1])
            return (), reuse

        async def forward(chunk: list[int]) -> TargetRows:
            return (await self.batcher.forward(cache, chunk, n_logits=len(chunk))).rows

        return tuple(await scored_prefill(forward, context, top_n)), Reuse()

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
        """`tree`: `new_tokens` as a tree of tokens, their parents in the block (cloud/token_tree.py); rows as a
        chain's, row r after the path to the r-th of the last `n_logits` tokens."""
        return await self.batcher.forward(session.cache, new_tokens, n_logits, abandoned,
                                          full_logits=session.sampling.reads_logits, tree=tree)

    def rollback(self, session: EngineSession, keep: int) -> None:
        session.cache.truncate(keep)  # moves the length: the rejected entries are overwritten later

    async def generate(self, context: list[int], max_new: int, sampling: SamplingParams,
                       processor: LogitsProcessor | None,
                       prefix_scope: str | None = None) -> AsyncIterator[GeneratedToken]:
        """Sampled with a CPU generator seeded by `sampling.seed`, like a session's tokens (common/devices.py);
        `processor`: the request's grammar, bias and penalties; `prefix_scope`: whose cached prefixes it may reuse."""
        generator = torch.Generator().manual_seed(sampling.seed)
        context = list(context)  # grows by each token: the penalties count it
        cache = self.new_session_kv()
        try:
            cache.reserve(len(context) + max_new)
            started = time.perf_counter()
            prompt_logprobs, reuse = await self._prefill(cache, context, sampling.prompt_logprobs, prefix_scope)
            prefill_ms = (time.perf_counter() - started) * 1e3
            new_tokens = context[-1:]
            for _ in range(max_new):
                result = await self.batcher.forward(cache, new_tokens, n_logits=1, full_logits=sampling.reads_logits)
                token = result.rows.shaped(processor, context, []).next_token(sampling, generator)
                logprob = next(iter(result.rows.logprobs(sampling, [token])), None)
                context.append(token)
                yield GeneratedToken(token, prefill_ms + result.queue_ms + result.forward_ms, logprob, prompt_logprobs,
                                     reuse.tokens)
                if token in self.info.eos_token_ids:
                    return
                new_tokens, prefill_ms, prompt_logprobs, reuse = [token], 0.0, (), Reuse()
        finally:
            self._remember(cache, prefix_scope, context)
            cache.release()

